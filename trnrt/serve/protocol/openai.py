"""Request parsing and validation for the OpenAI routes -> plain dataclasses + SamplingParams.

Everything here raises `OpenAIError` (400, naming the field) for bad input; nothing reaches the
engine unvalidated. Unknown fields are refused ("Unrecognized request argument supplied"), and
known fields the engine cannot serve yet are refused unless they carry their neutral value, so a
client never gets silently different behaviour than it asked for. Pure Python (no tokenizer).
"""

from __future__ import annotations

import uuid

import logging
from dataclasses import dataclass, field

from trnrt.engine.request import GenerateRequest, SamplingParams
from trnrt.serve.http.errors import OpenAIError, bad_request, safe
from trnrt.serve.protocol.fields import NEUTRAL, check_priority, check_unicode_tree, is_int as _is_int, is_text
from trnrt.serve.protocol.fields import read_bool as _bool
from trnrt.serve.protocol.fields import read_int as _int, read_str as _str, refuse_unserved
from trnrt.serve.protocol.chat_messages import _check_tool, _normalize_message
from trnrt.serve.protocol.chat_template import encode_text
from trnrt.serve.protocol.sampling import OPENAI, check_sampling, read_sampling
from trnrt.serve.protocol import structured
from trnrt.serve.protocol.tool_choice import FORCED as FORCED_TOOL, check_named, read_openai as read_tool_choice

log = logging.getLogger("trnrt.serve")

MAX_TOP_LOGPROBS = SamplingParams.MAX_TOP_LOGPROBS
MAX_PROMPTS = 1024  # prompts per /v1/completions body (as /generate's batch limit)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

_COMMON_FIELDS = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "user", "rid", "request_id",
    "routing_key",  # SGLang's router session key: accepted, no effect on one engine
    "no_logs",  # SGLang's: keep this request out of the production log (TRNRT_PROD_DIR)
}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "chat_template_kwargs", "reasoning_effort", "separate_reasoning", "stream_reasoning", "cache_salt",
    "n", "response_format", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
    "min_tokens", "no_stop_trim", "include_stop_str_in_output", "stop_regex", "regex", "ebnf",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "return_hidden_states", "parallel_tool_calls", "priority", "prompt_logprobs", "lora_path",
    "custom_logit_processor", "custom_params", "thinking_token_budget", "continue_final_message",
    "spaces_between_special_tokens", "modalities", "audio", "functions", "function_call", "prediction",
    "web_search_options", "verbosity", "chat_template",
    "add_generation_prompt", "return_token_ids", "return_prompt_token_ids", "return_tokens_as_token_ids",
}
COMPLETION_FIELDS = _COMMON_FIELDS | {
    "prompt", "echo", "logprobs", "n", "best_of", "suffix", "frequency_penalty", "presence_penalty", "cache_salt",
    "repetition_penalty", "logit_bias", "min_tokens", "no_stop_trim", "include_stop_str_in_output",
    "stop_regex", "regex", "ebnf", "json_schema", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "response_format", "return_hidden_states", "priority",
    "prompt_logprobs", "logprob_start_len", "lora_path", "custom_logit_processor", "custom_params",
    "thinking_token_budget", "spaces_between_special_tokens", "return_token_ids", "return_tokens_as_token_ids",
}


def _check_fields(body: dict, allowed: set[str]) -> None:
    """Unknown fields are ignored with a warning (as SGLang and vLLM do: routers and SDKs add
    their own); known fields the engine cannot serve are a 400 naming them."""
    unknown = [k for k in body if k not in allowed]
    if unknown:
        log.warning("ignoring unknown request fields: %s", ", ".join(safe(repr(k)) for k in unknown[:16]))
    refuse_unserved(body, [k for k in NEUTRAL if k in allowed and k not in _SERVED_HERE])


# In fields.NEUTRAL for other routes (/tokenize) but served on the OpenAI routes (structured
# outputs: read by protocol/structured.py; the engine refuses them, naming the flag, when off).
_SERVED_HERE = {"continue_final_message", "parallel_tool_calls", *structured.OPENAI_FIELDS, "frequency_penalty",
                "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens", "thinking_token_budget"}


def _read_prompt_logprobs(body: dict) -> int | None:
    """vLLM's prompt_logprobs: null (off) or an integer in [0, 20] (each prompt position's token
    logprob plus the top-N alternatives); anything else is a 400 naming the field."""
    return _int(body, "prompt_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)


def _read_max_tokens(body: dict, name: str, default, scoring: bool):
    """max_tokens (or max_completion_tokens): >= 1, or 0 when the request asks for prompt
    logprobs (the scoring use: the prompt is run and reported, nothing generated)."""
    v = _int(body, name, default, lo=0)
    if v == 0 and not scoring:
        raise bad_request(f"{name} must be >= 1, got 0 (0 only with prompt logprobs: echo with logprobs, "
                          f"or prompt_logprobs)", name)
    return v


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
    rid: str | None = None  # the engine request id the client chose (SGLang `rid`, vLLM `request_id`)
    priority: int | None = None  # SGLang's scheduling priority (None: the server's default)
    n: int = 1  # choices per prompt (each its own engine request; the prompt is computed once)
    cache_salt: str | None = None  # vLLM's prefix-cache namespace
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    return_token_ids: bool = False  # vLLM's: token ids in the choices (and the prompt's)
    return_prompt_token_ids: bool = False  # SGLang's (chat): the prompt's token ids
    # vLLM's: every token of the logprobs output written "token_id:<id>" instead of its text
    return_tokens_as_token_ids: bool = False
    # vLLM's prompt_logprobs: N alternatives per prompt position (None: not asked); rendered as
    # vLLM's per-position {token id: {logprob, rank, decoded_token}} list
    prompt_logprobs: int | None = None


@dataclass
class ChatRequest(CommonRequest):
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    tool_choice: str = "none"  # none | auto | required (protocol/tool_choice.py: also a named tool)
    tool_name: str | None = None  # the named tool of a forced call (tool_choice "required" + name)
    parallel_tool_calls: bool = True  # a forced "required" call may be several
    template_kwargs: dict = field(default_factory=dict)
    enable_thinking: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    want_logprobs: bool = False
    user_skip_special_tokens: bool = True
    # The client's own template (None: the server's) and the field it came in, for errors.
    chat_template: str | None = None
    chat_template_param: str = "chat_template_kwargs"
    # continue the last (assistant) message instead of starting a new one (vLLM, SGLang)
    continue_final_message: bool = False
    add_generation_prompt: bool = True


@dataclass
class CompletionRequest(CommonRequest):
    prompts: list = field(default_factory=list)  # each a str or a list[int]
    echo: bool = False
    logprobs: int | None = None
    # echo with logprobs: the legacy logprobs object covers the prompt's tokens first
    echo_logprobs: bool = False

    @property
    def prompt_logprobs_param(self) -> str:
        """The field that asked for prompt logprobs, as the client spelled it (for errors)."""
        return "prompt_logprobs" if self.prompt_logprobs is not None else "logprobs"


def _common(body: dict, max_tokens: int | None) -> tuple[CommonRequest, dict]:
    model = _str(body, "model", None)
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = continuous = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        for k in so:
            if k not in ("include_usage", "continuous_usage_stats"):
                raise bad_request(f"Unrecognized request argument supplied: stream_options.{k}", "stream_options")
        include_usage = _bool(so, "include_usage", False, label="stream_options.include_usage")
        continuous = _bool(so, "continuous_usage_stats", False, label="stream_options.continuous_usage_stats")
    _str(body, "user", None)  # metadata only; checked for type
    _str(body, "routing_key", None)  # the router's session-affinity key: checked for type
    # max_new_tokens is set once the prompt length is known; the ranges are checked here (before
    # any tokenization) and again with the vocabulary once the request is built.
    params = check_sampling(read_sampling(body, OPENAI), None, OPENAI)
    # vLLM's thinking_token_budget: -1 (the default) is unlimited; applied when the request reasons
    budget = _int(body, "thinking_token_budget", -1, -1)
    params.max_thinking_tokens = None if budget < 0 else budget
    rid = _str(body, "rid", None)
    rid = _str(body, "request_id", None) if rid is None else rid
    if rid is not None and not rid:
        raise bad_request("rid must be a non-empty string", "rid" if "rid" in body else "request_id")
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:  # vLLM serves best_of only equal to n (no ranking)
        raise bad_request(f"best_of must equal n ({n}) on this server, got {best_of}", "best_of")
    common = CommonRequest(model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                           params=params, rid=rid, priority=check_priority(body.get("priority"), lax=True), n=n,
                           continuous_usage=continuous, return_token_ids=_bool(body, "return_token_ids", False),
                           return_prompt_token_ids=_bool(body, "return_prompt_token_ids", False),
                           return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", False),
                           cache_salt=_cache_salt(body))
    return common, body


def _cache_salt(body: dict) -> str | None:
    """vLLM's cache_salt (SGLang accepts it too): a non-empty string, the prefix cache's namespace."""
    v = _str(body, "cache_salt", None)
    if v is not None and not v:
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    return None if v is None else "\x00" + v  # same namespace as /generate's cache_salt alone


MAX_N = 128  # choices per request (SGLang and vLLM leave it unbounded; every choice holds a slot)


def expand_choices(base: GenerateRequest, n: int, group: str) -> list[GenerateRequest]:
    """The n engine requests of one prompt: same prompt, prefix_group `group` (the engine computes
    the prompt once), choice i seeded `seed + i` when the client gave a seed (vLLM), request ids
    `<rid>_<i>` when the client chose a rid (SGLang's batch rule)."""
    if n == 1:
        return [base]
    out = []
    for i in range(n):
        params = base.sampling_params.clone()
        if params.seed is not None:
            params.seed = (params.seed + i) & ((1 << 64) - 1)
        kw = {"request_id": f"{base.request_id}_{i}"} if base.request_id else {}
        out.append(GenerateRequest(base.prompt_token_ids, params, stream=base.stream, priority=base.priority,
                                   prefix_group=group, cache_salt=base.cache_salt, **kw))
    return out


def parse_chat(body: dict) -> ChatRequest:
    """Validate a /v1/chat/completions body."""
    _check_fields(body, CHAT_FIELDS)
    prompt_lps = _read_prompt_logprobs(body)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = _read_max_tokens(body, "max_completion_tokens", None, prompt_lps is not None)
    else:
        max_tokens = _read_max_tokens(body, "max_tokens", None, prompt_lps is not None)
    common, _ = _common(body, max_tokens)
    common.prompt_logprobs = common.params.prompt_logprobs = prompt_lps
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
        check_unicode_tree(tools, "tools")
        if not tools:
            tools = None
    tool_choice, tool_name = read_tool_choice(body.get("tool_choice"))
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == FORCED_TOOL and not tools:
        raise bad_request("tool_choice 'required' or a named function needs tools", "tool_choice")
    check_named(tools, tool_name, "tool_choice.function.name")
    parallel = _bool(body, "parallel_tool_calls", True)
    if not parallel and tool_choice != FORCED_TOOL:
        # only a forced call is enforced by a grammar; 'auto' would need truncating the output
        raise bad_request("parallel_tool_calls false is served with tool_choice 'required' or a named "
                          "function", "parallel_tool_calls")

    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    check_unicode_tree(kwargs, "chat_template_kwargs")
    kwargs = dict(kwargs)
    for reserved in ("messages", "tools", "add_generation_prompt", "tokenize", "conversation", "continue_final_message"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs.{reserved} is set by the server", "chat_template_kwargs")
    # A client's own Jinja template (vLLM's top-level `chat_template`, or the kwarg) runs on the
    # server: render_chat refuses it unless the server trusts request templates, and then renders it
    # in a bounded sandbox (one 132-byte template once rendered 11.7 GB). Only its type is read here.
    client_template, template_param = _str(body, "chat_template", None), "chat_template"
    kw_template = kwargs.pop("chat_template", None)  # null: absent, as at the top level
    if kw_template is not None:
        if client_template is not None:
            raise bad_request("give chat_template once: at the top level or in chat_template_kwargs, not both",
                              "chat_template")
        if not isinstance(kw_template, str):
            raise bad_request("chat_template_kwargs.chat_template must be a string", "chat_template_kwargs")
        client_template, template_param = kw_template, "chat_template_kwargs"
    if client_template is not None and not client_template:
        where = "chat_template" if template_param == "chat_template" else "chat_template_kwargs.chat_template"
        raise bad_request(f"{where} must not be empty", template_param)
    effort = _str(body, "reasoning_effort", None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True))
    if not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")

    # Assistant prefill (vLLM's and SGLang's continue_final_message): the last message must be the
    # assistant's; it is rendered open-ended (HF's continue_final_message) with no generation prompt.
    cont = _bool(body, "continue_final_message", False)
    add_gen = _bool(body, "add_generation_prompt", not cont)
    if cont:
        if add_gen:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        if norm[-1]["role"] != "assistant":
            raise bad_request(f"continue_final_message needs the last message to be the assistant's, got "
                              f"{norm[-1]['role']!r}", "continue_final_message")
        if norm[-1].get("tool_calls"):
            raise bad_request("continue_final_message cannot continue a message with tool_calls",
                              "continue_final_message")
        if client_template is not None:
            raise bad_request("continue_final_message is served with the server's chat template only",
                              "continue_final_message")
        kwargs["continue_final_message"] = True  # HF apply_chat_template's own argument
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    common.params.logprobs = (top or 0) if logprobs else None
    common.params.grammar = structured.read_openai(body, sglang_keys=("regex", "ebnf"))
    return ChatRequest(
        **common.__dict__, messages=norm, tools=tools, tool_choice=tool_choice, template_kwargs=kwargs,
        enable_thinking=thinking, tool_name=tool_name, parallel_tool_calls=parallel,
        separate_reasoning=_bool(body, "separate_reasoning", True),
        stream_reasoning=_bool(body, "stream_reasoning", True),
        want_logprobs=logprobs,
        user_skip_special_tokens=common.params.skip_special_tokens,
        chat_template=client_template, chat_template_param=template_param,
        continue_final_message=cont, add_generation_prompt=add_gen,
    )


def parse_completion(body: dict) -> CompletionRequest:
    """Validate a /v1/completions body."""
    _check_fields(body, COMPLETION_FIELDS)
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    prompt_lps = _read_prompt_logprobs(body)
    echo_lps = echo and logprobs is not None
    max_tokens = _read_max_tokens(body, "max_tokens", 16, echo_lps or prompt_lps is not None)
    common, _ = _common(body, max_tokens)
    # the engine reports the prompt once with the larger N; each shape takes its own top-N
    wants = [n for n in (logprobs if echo_lps else None, prompt_lps) if n is not None]
    common.params.prompt_logprobs = max(wants) if wants else None
    common.prompt_logprobs = prompt_lps
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
    if len(prompts) > MAX_PROMPTS:  # bounds the engine requests one body can queue
        raise bad_request(f"prompt holds at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    for p in prompts:
        if isinstance(p, str) and not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p, str) and not is_text(p):
            raise bad_request("prompt is not valid Unicode (it holds a lone surrogate)", "prompt")
    common.params.logprobs = logprobs
    common.params.grammar = structured.read_openai(body, sglang_keys=("json_schema", "regex", "ebnf"))
    return CompletionRequest(**common.__dict__, prompts=prompts, echo=echo, logprobs=logprobs, echo_logprobs=echo_lps)


def engine_field_to_openai(name: str | None, prompt_param: str = "prompt",
                           prompt_logprobs_param: str = "prompt_logprobs") -> str | None:
    """SamplingParams / GenerateRequest names back to the request's spelling, for error messages
    (`prompt_logprobs_param`: the field that asked for prompt logprobs, `logprobs` for echo)."""
    return {"max_new_tokens": "max_tokens", "prompt_token_ids": prompt_param, "min_new_tokens": "min_tokens",
            "max_thinking_tokens": "thinking_token_budget", "prompt_logprobs": prompt_logprobs_param,
            "prompt_logprobs_start": prompt_logprobs_param}.get(name or "", name)


# --- to the engine ------------------------------------------------------------------------------
def context_check(ctx: int, creq: CommonRequest, n_prompt: int, param: str) -> int:
    """max_new_tokens for a prompt of `n_prompt` tokens; SGLang's messages for prompts that do not fit."""
    if n_prompt >= ctx:
        raise bad_request(f"The input ({n_prompt} tokens) is longer than the model's context length "
                          f"({ctx} tokens): {param} must tokenize to fewer than {ctx} tokens.", param)
    if creq.max_tokens is None:
        return ctx - n_prompt
    if n_prompt + creq.max_tokens > ctx:
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
            f"a total of {n_prompt + creq.max_tokens} tokens: {n_prompt} tokens from the input messages and "
            f"{creq.max_tokens} tokens for the completion ({creq.max_tokens_param}). Please reduce the number of "
            f"tokens in the input messages or the completion to fit within the limit.", creq.max_tokens_param)
    return creq.max_tokens


def chat_to_engine_request(creq: ChatRequest, prompt_ids: list[int], ctx: int, vocab_size: int) -> GenerateRequest:
    """The engine request of a rendered chat request (context and sampling ranges checked)."""
    creq.params.max_new_tokens = context_check(ctx, creq, len(prompt_ids), "messages")
    check_sampling(creq.params, vocab_size, OPENAI)
    kw = {"request_id": creq.rid} if creq.rid else {}
    return GenerateRequest(prompt_ids, creq.params, stream=creq.stream, priority=creq.priority,
                           cache_salt=creq.cache_salt, **kw)


def chat_to_engine_requests(creq: ChatRequest, prompt_ids: list[int], ctx: int, vocab_size: int
                            ) -> list[GenerateRequest]:
    """The creq.n engine requests of a rendered chat request (one per choice)."""
    base = chat_to_engine_request(creq, prompt_ids, ctx, vocab_size)
    if creq.n == 1:
        return [base]
    group = "chat-" + uuid.uuid4().hex
    if not creq.rid:
        base.request_id = ""
    return expand_choices(base, creq.n, group)


def completion_to_engine_requests(creq: CompletionRequest, tokenizer, ctx: int, vocab_size: int
                                  ) -> tuple[list[GenerateRequest], list[str]]:
    """One engine request per prompt, and the echo text of each."""
    reqs, echo_texts = [], []
    for i, p in enumerate(creq.prompts):
        if isinstance(p, str):
            ids = encode_text(tokenizer, p, "prompt", max_tokens=ctx)
            if not ids:
                raise bad_request("prompt tokenized to no tokens", "prompt")
            echo_texts.append(p)
        else:
            bad = next((t for t in p if not (0 <= t < vocab_size)), None)
            if bad is not None:
                raise bad_request(f"prompt contains an out-of-vocabulary token id {bad} (vocab size {vocab_size})",
                                  "prompt")
            ids = p
            echo_texts.append(tokenizer.decode(ids, skip_special_tokens=False) if creq.echo else "")
        params = creq.params.clone(max_new_tokens=context_check(ctx, creq, len(ids), "prompt"))
        check_sampling(params, vocab_size, OPENAI)
        kw = {}
        if creq.rid:  # several prompts: SGLang's batch rule, rid_i
            kw["request_id"] = creq.rid if len(creq.prompts) == 1 else f"{creq.rid}_{i}"
        base = GenerateRequest(ids, params, stream=creq.stream, priority=creq.priority, cache_salt=creq.cache_salt,
                               **kw)
        if creq.n > 1:
            if not creq.rid:
                base.request_id = ""
            choices = expand_choices(base, creq.n, f"cmpl-{uuid.uuid4().hex}-{i}")
            reqs.extend(choices)
            echo_texts.extend([echo_texts[-1]] * (creq.n - 1))
        else:
            reqs.append(base)
    return reqs, echo_texts


__all__ = ["ChatRequest", "CompletionRequest", "OpenAIError", "parse_chat", "parse_completion",
           "engine_field_to_openai", "chat_to_engine_request", "chat_to_engine_requests", "completion_to_engine_requests",
           "context_check", "expand_choices", "MAX_N"]
