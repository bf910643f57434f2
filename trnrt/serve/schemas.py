"""Request parsing and validation for the OpenAI routes -> plain dataclasses + SamplingParams.

Everything here raises `OpenAIError` (400, naming the field) for bad input; nothing reaches the
engine unvalidated. Unknown fields are refused ("Unrecognized request argument supplied"), and
known fields the engine cannot serve yet are refused unless they carry their neutral value, so a
client never gets silently different behaviour than it asked for. Pure Python (no tokenizer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from trnrt.engine.request import SamplingParams
from trnrt.serve.errors import OpenAIError, bad_request, unsupported

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = SamplingParams.MAX_TOP_LOGPROBS
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields accepted only with the value that means "off" (or an equivalent one); anything else is a
# 400 naming the field. The value test returns True when the given value is neutral.
_NEUTRAL: dict[str, Any] = {
    "n": lambda v: v == 1,
    "best_of": lambda v: v == 1,
    "frequency_penalty": lambda v: v == 0,
    "presence_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "logit_bias": lambda v: v == {},
    "min_tokens": lambda v: v == 0,
    "no_stop_trim": lambda v: v is False,
    "include_stop_str_in_output": lambda v: v is False,
    "stop_regex": lambda v: v in ([], ""),
    "regex": lambda v: False,
    "ebnf": lambda v: False,
    "json_schema": lambda v: False,
    "structured_outputs": lambda v: False,
    "guided_json": lambda v: False,
    "guided_regex": lambda v: False,
    "guided_choice": lambda v: False,
    "guided_grammar": lambda v: False,
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text" and len(v) == 1,
    "suffix": lambda v: v == "",
    "return_hidden_states": lambda v: v is False,
    "parallel_tool_calls": lambda v: v is True,
    "priority": lambda v: v == 0,
    "prompt_logprobs": lambda v: False,
    "logprob_start_len": lambda v: False,
    "lora_path": lambda v: False,
    "custom_logit_processor": lambda v: False,
    "custom_params": lambda v: False,
    "thinking_token_budget": lambda v: v == -1,
    "continue_final_message": lambda v: v is False,
    "spaces_between_special_tokens": lambda v: v is True,
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
    "functions": lambda v: False,
    "function_call": lambda v: False,
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
    "verbosity": lambda v: False,
}

_COMMON_FIELDS = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "user",
}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "chat_template_kwargs", "reasoning_effort", "separate_reasoning", "stream_reasoning",
    "n", "response_format", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
    "min_tokens", "no_stop_trim", "include_stop_str_in_output", "stop_regex", "regex", "ebnf",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "return_hidden_states", "parallel_tool_calls", "priority", "prompt_logprobs", "lora_path",
    "custom_logit_processor", "custom_params", "thinking_token_budget", "continue_final_message",
    "spaces_between_special_tokens", "modalities", "audio", "functions", "function_call", "prediction",
    "web_search_options", "verbosity",
}
COMPLETION_FIELDS = _COMMON_FIELDS | {
    "prompt", "echo", "logprobs", "n", "best_of", "suffix", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "no_stop_trim", "include_stop_str_in_output",
    "stop_regex", "regex", "ebnf", "json_schema", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "response_format", "return_hidden_states", "priority",
    "prompt_logprobs", "logprob_start_len", "lora_path", "custom_logit_processor", "custom_params",
    "thinking_token_budget", "spaces_between_special_tokens",
}


# --- typed readers ------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON clients sometimes print 16 as 16.0
    if not _is_int(v):
        raise bad_request(f"{name} must be an integer, got {v!r}", name)
    if lo is not None and v < lo:
        raise bad_request(f"{name} must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"{name} must be <= {hi}, got {v}", name)
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad_request(f"{name} must be a finite number, got {v!r}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean, got {v!r}", name)
    return v


def _str(body: dict, name: str, default: str | None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad_request(f"{name} must be a string, got {type(v).__name__}", name)
    return v


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key)
    for key, is_neutral in _NEUTRAL.items():
        if key in body and body[key] is not None:
            try:
                ok = is_neutral(body[key])
            except Exception:  # an odd type is simply not neutral
                ok = False
            if not ok:
                raise unsupported(key)


# --- parsed requests ----------------------------------------------------------------------------
@dataclass
class CommonRequest:
    """Fields shared by both routes after validation. `max_tokens` None = up to the context."""

    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    params: SamplingParams
    max_tokens_param: str = "max_tokens"  # the spelling the client used, for error messages


@dataclass
class ChatRequest(CommonRequest):
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    tool_choice: str = "none"
    template_kwargs: dict = field(default_factory=dict)
    enable_thinking: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    want_logprobs: bool = False
    user_skip_special_tokens: bool = True


@dataclass
class CompletionRequest(CommonRequest):
    prompts: list = field(default_factory=list)  # each a str or a list[int]
    echo: bool = False
    logprobs: int | None = None


def _common(body: dict, max_tokens: int | None) -> tuple[CommonRequest, dict]:
    model = _str(body, "model", None)
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        for k in so:
            if k not in ("include_usage", "continuous_usage_stats"):
                raise bad_request(f"Unrecognized request argument supplied: stream_options.{k}", "stream_options")
        include_usage = _bool(so, "include_usage", False)
        if _bool(so, "continuous_usage_stats", False):
            raise unsupported("stream_options.continuous_usage_stats")
    _str(body, "user", None)  # metadata only; checked for type
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop accepts at most {MAX_STOP_STRINGS} strings", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise bad_request("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
    temperature = _num(body, "temperature", 1.0)
    if temperature < 0:
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = _num(body, "top_p", 1.0)
    if not (0.0 < top_p <= 1.0):
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", -1, lo=-1)
    min_p = _num(body, "min_p", 0.0)
    if not (0.0 <= min_p <= 1.0):
        raise bad_request(f"min_p must be in [0, 1], got {min_p}", "min_p")
    seed = _int(body, "seed", None)
    params = SamplingParams(
        max_new_tokens=0,  # set once the prompt length is known
        temperature=temperature, top_p=top_p, top_k=-1 if top_k == 0 else top_k, min_p=min_p, seed=seed,
        stop=stop, stop_token_ids=stop_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
    )
    common = CommonRequest(model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                           params=params)
    return common, body


def parse_chat(body: dict) -> ChatRequest:
    """Validate a /v1/chat/completions body."""
    _check_fields(body, CHAT_FIELDS)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    else:
        max_tokens = _int(body, "max_tokens", None, lo=1)
    common, _ = _common(body, max_tokens)
    if body.get("max_completion_tokens") is not None:
        common.max_tokens_param = "max_completion_tokens"
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("messages is required and must be a list", "messages")
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    norm = [_normalize_message(m, i) for i, m in enumerate(messages)]

    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
        for i, t in enumerate(tools):
            _check_tool(t, i)
        if not tools:
            tools = None
    tool_choice = body.get("tool_choice")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    elif isinstance(tool_choice, dict) or tool_choice == "required":
        raise unsupported("tool_choice", "'required' or a named function is not supported by this server yet; "
                                         "use 'auto' or 'none'")
    elif tool_choice not in ("auto", "none"):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
                          "tool_choice")

    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs)
    for reserved in ("messages", "tools", "add_generation_prompt", "tokenize", "conversation"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs.{reserved} is set by the server", "chat_template_kwargs")
    effort = _str(body, "reasoning_effort", None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True))
    if not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")

    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    common.params.logprobs = (top or 0) if logprobs else None
    return ChatRequest(
        **common.__dict__, messages=norm, tools=tools, tool_choice=tool_choice, template_kwargs=kwargs,
        enable_thinking=thinking,
        separate_reasoning=_bool(body, "separate_reasoning", True),
        stream_reasoning=_bool(body, "stream_reasoning", True),
        want_logprobs=logprobs,
        user_skip_special_tokens=common.params.skip_special_tokens,
    )


def _text_of(content, where: str) -> str:
    """Message content as text: a string, or a list of text parts (other part types are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                raise bad_request(f"{where}.content[{j}] must be an object with a type", f"{where}.content")
            if p["type"] not in ("text", "input_text"):
                raise unsupported(f"{where}.content[{j}].type={p['type']!r}",
                                  "is not supported: this server serves text only")
            if not isinstance(p.get("text"), str):
                raise bad_request(f"{where}.content[{j}].text must be a string", f"{where}.content")
            parts.append(p["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or a list of content parts", f"{where}.content")


def _normalize_message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object", "messages")
    role = m.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", "messages")
    out: dict = {"role": "system" if role == "developer" else role}
    content = m.get("content")
    if content is None:
        if role != "assistant":
            raise bad_request(f"{where}.content is required for role {role}", "messages")
        out["content"] = ""
    else:
        out["content"] = _text_of(content, where)
    for k in ("name", "tool_call_id", "reasoning_content"):
        if m.get(k) is not None:
            if not isinstance(m[k], str):
                raise bad_request(f"{where}.{k} must be a string", "messages")
            out[k] = m[k]
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list", "messages")
        norm_calls = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"{where}.tool_calls[{j}].function.name must be a string", "messages")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise bad_request(f"{where}.tool_calls[{j}].function.arguments is not valid JSON", "messages")
            if not isinstance(args, dict):
                raise bad_request(f"{where}.tool_calls[{j}].function.arguments must be a JSON object", "messages")
            # Templates iterate `arguments` as a mapping (HF convention), so pass it parsed.
            norm_calls.append({"id": c.get("id"), "type": "function",
                               "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = norm_calls
    return out


def _check_tool(t, i: int) -> None:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise bad_request(f"{where} must be an object with type 'function'", "tools")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{where}.function.name must be a non-empty string", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"{where}.function.description must be a string", "tools")


def parse_completion(body: dict) -> CompletionRequest:
    """Validate a /v1/completions body."""
    _check_fields(body, COMPLETION_FIELDS)
    max_tokens = _int(body, "max_tokens", 16, lo=1)
    common, _ = _common(body, max_tokens)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    prompts: list
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                          "lists of token ids (none empty)", "prompt")
    for p in prompts:
        if isinstance(p, str) and not p:
            raise bad_request("prompt must not be empty", "prompt")
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if echo and logprobs is not None:
        raise unsupported("logprobs", "with echo needs prompt logprobs, which this server does not serve yet")
    common.params.logprobs = logprobs
    return CompletionRequest(**common.__dict__, prompts=prompts, echo=echo, logprobs=logprobs)


def engine_field_to_openai(name: str | None, prompt_param: str = "prompt") -> str | None:
    """SamplingParams / GenerateRequest names back to the request's spelling, for error messages."""
    return {"max_new_tokens": "max_tokens", "prompt_token_ids": prompt_param}.get(name or "", name)


__all__ = ["ChatRequest", "CompletionRequest", "OpenAIError", "parse_chat", "parse_completion",
           "engine_field_to_openai"]
