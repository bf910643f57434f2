"""Request parsing for OpenAI's Responses API (`POST /v1/responses`) -> a chat request.

A Responses body is translated into the chat path, as SGLang and vLLM do: `instructions` and the
`input` items become chat messages (rendered by the chat template, so the prompt is exactly what
/v1/chat/completions would render for the same conversation), flat function `tools` become chat
tools, `reasoning.effort` becomes the template's thinking switch. Everything here raises a 400 in
OpenAI's envelope naming the field (`input[2].call_id`, `tools[0].type`, `text.format`, ...).
Unknown fields are ignored with one warning line; known fields the server cannot serve are a 400
naming them. Pure Python (no tokenizer).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

from trnrt.engine.request import SamplingParams
from trnrt.serve.http.errors import APIError, bad_request, safe, unsupported
from trnrt.serve.protocol.fields import check_unicode_tree, is_text
from trnrt.serve.protocol.fields import read_bool, read_int, read_str
from trnrt.serve.protocol.chat_messages import _check_json_schema
from trnrt.serve.protocol.openai import REASONING_EFFORTS, ChatRequest
from trnrt.serve.protocol.sampling import OPENAI, check_sampling, read_sampling
from trnrt.serve.protocol.structured import read_text_format
from trnrt.serve.protocol.tool_choice import FORCED as FORCED_TOOL, check_named, read_openai as read_tool_choice

log = logging.getLogger("trnrt.serve")

# SGLang's refusal of stateful requests on a server without the store, word for word.
STORE_DISABLED_MESSAGE = ("Response store is disabled. Stateful Responses require --enable-response-store on a "
                          "standalone server; response storage is unavailable in PD mode.")
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for the Responses API
INCLUDE_VALUES = ("reasoning.encrypted_content", "message.output_text.logprobs", "message.input_image.image_url",
                  "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                  "computer_call_output.output.image_url", "code_interpreter_call.outputs")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty")
# Accepted and ignored (clients and agents send them; a 400 would break them).
IGNORED_FIELDS = {"no_logs", "max_tool_calls", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
                  "service_tier", "stream_options", "image", "moderation", "access_programs"}
RESPONSES_FIELDS = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "reasoning", "text", "stream", "store", "previous_response_id", "metadata", "user", "truncation", "include",
    "top_logprobs", "background", "conversation", "prompt", "context_management", "prompt_cache_options",
    *SAMPLING_KEYS, *IGNORED_FIELDS,
}
ROLES = ("user", "assistant", "system", "developer")
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class ResponsesRequest:
    """A validated Responses body. `chat` is the chat request it renders as (its `messages` hold
    the input only: the handler puts the instructions and a stored conversation around them)."""

    chat: ChatRequest
    input_messages: list[dict]
    instructions: str | None = None
    tools_echo: list[dict] = field(default_factory=list)
    tool_choice_echo: str | dict = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    reasoning_echo: dict | None = None
    text_echo: dict = field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool | None = None  # None: not given (OpenAI's default is true)
    previous_response_id: str | None = None
    metadata: dict = field(default_factory=dict)
    user: str | None = None
    truncation: str = "disabled"
    want_logprobs: bool = False
    top_logprobs: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    service_tier: str | None = None

    @property
    def model(self) -> str | None:
        return self.chat.model


def _check_fields(body: dict) -> None:
    unknown = [k for k in body if k not in RESPONSES_FIELDS]
    if unknown:
        log.warning("ignoring unknown request fields: %s", ", ".join(safe(repr(k)) for k in unknown[:16]))


def _obj(body: dict, name: str) -> dict | None:
    v = body.get(name)
    if v is not None and not isinstance(v, dict):
        raise bad_request(f"{name} must be an object", name)
    return v


def _refuse_stateful(body: dict) -> None:
    """Fields that need server state or features this server does not have."""
    if body.get("background") is not None:
        if not isinstance(body["background"], bool):
            raise bad_request("background must be a boolean", "background")
        if body["background"]:
            raise unsupported("background", "is not supported by this server: responses run in the foreground")
    for name, why in (("conversation", "needs the Conversations API, which this server does not serve"),
                      ("prompt", "(a stored prompt template) is not supported by this server"),
                      ("context_management", "is not supported by this server")):
        if body.get(name) is not None:
            raise unsupported(name, why)
    pco = _obj(body, "prompt_cache_options")
    if pco and pco.get("prewarm"):
        raise unsupported("prompt_cache_options.prewarm")


def parse_responses(body: dict) -> ResponsesRequest:
    """Validate a /v1/responses body (the conversation of `previous_response_id` is the
    handler's: it needs the store)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body)
    _refuse_stateful(body)
    model = read_str(body, "model", None)
    stream = read_bool(body, "stream", False)
    store = read_bool(body, "store", None)
    prev = read_str(body, "previous_response_id", None)
    if prev is not None and not prev:
        raise bad_request("previous_response_id must be a non-empty string", "previous_response_id")
    user = read_str(body, "user", None)
    for name in ("prompt_cache_key", "safety_identifier", "service_tier", "prompt_cache_retention"):
        read_str(body, name, None)
    read_int(body, "max_tool_calls", None, lo=0)
    if body.get("stream_options") is not None:
        so = _obj(body, "stream_options")
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        read_bool(so, "include_obfuscation", False, label="stream_options.include_obfuscation")
    max_output = read_int(body, "max_output_tokens", None, lo=1)
    metadata = _metadata(body.get("metadata"))
    truncation = body.get("truncation")
    if truncation is None:
        truncation = "disabled"
    if truncation not in ("auto", "disabled"):
        raise bad_request(f"truncation must be 'auto' or 'disabled', got {safe(repr(truncation))}", "truncation")
    parallel = read_bool(body, "parallel_tool_calls", True)

    # Sampling: the Responses fields plus vLLM's extras (top_k, min_p, seed, stop, repetition_penalty),
    # read as chat reads them.
    params: SamplingParams = check_sampling(read_sampling({k: body.get(k) for k in SAMPLING_KEYS if k in body},
                                                          OPENAI), None, OPENAI)
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise bad_request("include must be a list of strings", "include")
    for v in include:
        if v not in INCLUDE_VALUES:
            raise bad_request(f"include: {safe(repr(v))} is not one of {', '.join(INCLUDE_VALUES)}", "include")
    top = read_int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    want_lp = "message.output_text.logprobs" in include or bool(top)
    params.logprobs = (top or 0) if want_lp else None

    # reasoning -> the template's thinking switch (as chat's reasoning_effort)
    kwargs: dict = {}
    reasoning = _obj(body, "reasoning")
    reasoning_echo = None
    if reasoning is not None:
        effort = read_str(reasoning, "effort", None, label="reasoning.effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning.effort")
        summary = reasoning.get("summary", reasoning.get("generate_summary"))
        if summary is not None and summary not in ("auto", "concise", "detailed"):
            raise bad_request("reasoning.summary must be 'auto', 'concise' or 'detailed'", "reasoning.summary")
        if effort is not None:
            kwargs["reasoning_effort"] = effort
            kwargs["enable_thinking"] = effort != "none"
        reasoning_echo = {"effort": effort, "summary": summary}

    text = _obj(body, "text")
    text_echo = {"format": {"type": "text"}}
    if text is not None:
        fmt = text.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
                raise bad_request("text.format must be an object with a type", "text.format")
            params.grammar = read_text_format(fmt)
            text_echo["format"] = fmt
        verbosity = text.get("verbosity")
        if verbosity not in (None, "medium"):
            raise unsupported("text.verbosity", "other than 'medium' is not supported by this server")
        if verbosity is not None:
            text_echo["verbosity"] = verbosity

    tools_chat, tools_echo = _tools(body.get("tools"))
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        raise unsupported("tool_choice", "allowed_tools is not served; use 'auto', 'none', 'required' or a "
                                         "named function")
    mode, tool_name = read_tool_choice(tool_choice)
    if tool_choice is None:
        tool_choice = "auto"
    if mode == FORCED_TOOL and not tools_chat:
        raise bad_request("tool_choice 'required' or a named function needs tools", "tool_choice")
    check_named(tools_chat, tool_name, "tool_choice.name")

    instructions = body.get("instructions")
    if instructions is not None:
        instructions = _text_content(instructions, "instructions", "system")
    messages = _input_messages(body.get("input"), required=prev is None)

    chat = ChatRequest(model=model, stream=stream, include_usage=True, max_tokens=max_output, params=params,
                       max_tokens_param="max_output_tokens", messages=messages,
                       tools=tools_chat or None, tool_choice=(mode or "auto") if tools_chat else "none",
                       tool_name=tool_name, parallel_tool_calls=parallel,
                       template_kwargs=kwargs, enable_thinking=kwargs.get("enable_thinking", True),
                       want_logprobs=want_lp, user_skip_special_tokens=True)
    return ResponsesRequest(
        chat=chat, input_messages=messages, instructions=instructions, tools_echo=tools_echo,
        tool_choice_echo=tool_choice, parallel_tool_calls=parallel, max_output_tokens=max_output,
        reasoning_echo=reasoning_echo, text_echo=text_echo, store=store, previous_response_id=prev,
        metadata=metadata, user=user, truncation=truncation, want_logprobs=want_lp, top_logprobs=top or 0,
        temperature=params.temperature, top_p=params.top_p)


def _metadata(md) -> dict:
    """OpenAI's rule: up to 16 string pairs, keys <= 64 characters, values <= 512."""
    if md is None:
        return {}
    if not isinstance(md, dict):
        raise bad_request("metadata must be an object of string keys and string values", "metadata")
    if len(md) > 16:
        raise bad_request(f"metadata holds at most 16 pairs, got {len(md)}", "metadata")
    for k, v in md.items():
        if not is_text(k) or len(k) > 64:
            raise bad_request("metadata keys must be strings of at most 64 characters", "metadata")
        if not is_text(v) or len(v) > 512:
            raise bad_request(f"metadata[{safe(repr(k))}] must be a string of at most 512 characters", "metadata")
    return dict(md)


def _tools(tools) -> tuple[list[dict], list[dict]]:
    """Flat Responses function tools -> (chat tools for the template and the parser, the echo)."""
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    chat, echo, names = [], [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", where)
        typ = t.get("type")
        if typ != "function":
            if isinstance(typ, str):
                raise unsupported(f"{where}.type", f"{safe(repr(typ))} is not supported: this server serves "
                                                   "function tools only")
            raise bad_request(f"{where}.type must be 'function'", f"{where}.type")
        name = t.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad_request(f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$", f"{where}.name")
        if name in names:
            raise bad_request(f"{where}.name: the tool {name!r} is defined twice", f"{where}.name")
        names.add(name)
        params = t.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
            try:
                _check_json_schema(params, f"{where}.parameters")
            except APIError as e:
                raise bad_request(e.message, f"{where}.parameters")
        desc = t.get("description")
        if desc is not None and not is_text(desc):
            raise bad_request(f"{where}.description must be a valid Unicode string", f"{where}.description")
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
        check_unicode_tree(t, where)
        fn = {"name": name, "parameters": params if params is not None else {"type": "object", "properties": {}}}
        if desc is not None:
            fn = {"name": name, "description": desc, "parameters": fn["parameters"]}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": name, "description": desc, "parameters": params,
                     "strict": strict})
    return chat, echo


# --- input items -> chat messages ------------------------------------------------------------
def _parts_text(content, where: str, allowed: tuple[str, ...]) -> str:
    if isinstance(content, str):
        if not is_text(content):
            raise bad_request(f"{where} is not valid Unicode (it holds a lone surrogate)", where)
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    out = []
    for j, p in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise bad_request(f"{pw} must be an object with a type", f"{pw}.type")
        typ = p["type"]
        if typ in ("input_image", "input_file", "input_audio"):
            raise unsupported(f"{pw}.type", f"{typ!r} is not supported: this server serves text only")
        if typ not in allowed:
            raise bad_request(f"{pw}.type must be one of {', '.join(allowed)}, got {safe(repr(typ))}", f"{pw}.type")
        key = "refusal" if typ == "refusal" else "text"
        if not is_text(p.get(key)):
            raise bad_request(f"{pw}.{key} must be a valid Unicode string", f"{pw}.{key}")
        out.append(p[key])
    return "".join(out)


def _text_content(content, where: str, role: str) -> str:
    allowed = ("output_text", "refusal", "input_text", "text") if role == "assistant" else ("input_text", "text")
    return _parts_text(content, where, allowed)


def _input_messages(inp, required: bool) -> list[dict]:
    """`input` (a string or a list of items) -> chat messages; consecutive assistant output
    (reasoning, message, function_call items) folds into one assistant turn, as the model made it."""
    if inp is None:
        if required:
            raise bad_request("input is required", "input")
        return []
    if isinstance(inp, str):
        if not is_text(inp):
            raise bad_request("input is not valid Unicode (it holds a lone surrogate)", "input")
        if not inp and required:
            raise bad_request("input must not be empty", "input")
        return [{"role": "user", "content": inp}] if inp else []
    if not isinstance(inp, list):
        raise bad_request("input must be a string or a list of input items", "input")
    if not inp and required:
        raise bad_request("input must contain at least one item", "input")
    messages: list[dict] = []
    turn: dict | None = None  # the assistant turn being assembled

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        typ = item.get("type")
        if typ is None and "role" in item:
            typ = "message"
        if not isinstance(typ, str):
            raise bad_request(f"{where}.type must be a string", f"{where}.type")
        if typ == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {safe(repr(role))}",
                                  f"{where}.role")
            content = item.get("content")
            if content is None:
                if role != "assistant":
                    raise bad_request(f"{where}.content is required", f"{where}.content")
                content = ""
            text = _text_content(content, f"{where}.content", role)
            if role == "assistant":
                t = assistant()
                if t.get("tool_calls"):  # text after calls: a new turn
                    turn = None
                    t = assistant()
                t["content"] = (t["content"] + text) if t["content"] else text
            else:
                turn = None
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif typ == "reasoning":
            text = _reasoning_text(item, where)
            t = assistant()
            if t["content"] or t.get("tool_calls"):
                turn = None
                t = assistant()
            t["reasoning_content"] = t.get("reasoning_content", "") + text
        elif typ == "function_call":
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
            args = item.get("arguments", "{}")
            if args is None:
                args = "{}"
            if not isinstance(args, str):
                raise bad_request(f"{where}.arguments must be a JSON string", f"{where}.arguments")
            check_unicode_tree([name, call_id, args], where)
            try:
                parsed = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                parsed = None
            # Templates iterate a mapping (HF convention). Malformed history (clients replay what
            # a model wrote) renders as a call without arguments rather than failing the request.
            arguments = parsed if isinstance(parsed, dict) else {}
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif typ == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
            out = item.get("output")
            if out is None:
                raise bad_request(f"{where}.output is required", f"{where}.output")
            text = _parts_text(out, f"{where}.output", ("input_text", "output_text", "text"))
            turn = None
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif typ == "item_reference":
            raise unsupported(f"{where}.type", "'item_reference' is not supported by this server: send the item "
                                               "itself (or previous_response_id with --enable-response-store)")
        else:
            raise unsupported(f"{where}.type", f"{safe(repr(typ))} is not supported: this server takes message, "
                                               "reasoning, function_call and function_call_output items")
    return messages


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary (encrypted content
    alone is dropped: this server never emits any)."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise bad_request(f"{where}.{key} must be a list", f"{where}.{key}")
        texts = []
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or not is_text(p.get("text")):
                raise bad_request(f"{where}.{key}[{j}] must be an object with a text", f"{where}.{key}")
            if p.get("type", part_type) != part_type:
                raise bad_request(f"{where}.{key}[{j}].type must be {part_type!r}", f"{where}.{key}")
            texts.append(p["text"])
        if texts:
            return "".join(texts) if key == "content" else "\n".join(texts)
    return ""


def is_response_id(v) -> bool:
    return isinstance(v, str) and v.startswith("resp_") and len(v) <= 128 and is_text(v)


__all__ = ["ResponsesRequest", "parse_responses", "STORE_DISABLED_MESSAGE", "is_response_id"]
