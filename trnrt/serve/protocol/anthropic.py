"""Request parsing and validation for Anthropic's Messages API -> the chat path's ChatRequest.

`POST /v1/messages` and `POST /v1/messages/count_tokens` are translated into the same parsed chat
request that `/v1/chat/completions` renders (as SGLang and vLLM do): `system` and the messages'
content blocks become chat messages (thinking -> `reasoning_content`, tool_use -> `tool_calls`,
tool_result -> `role: tool`), `tools` (`input_schema`) become function tools, `thinking` and
`output_config.effort` become template kwargs. So both routes render with the chat template and
the output goes through the same GLM reasoning and tool-call parsers.

Everything here raises an APIError (400 naming the field in its message) for bad input; the
handler re-shapes it into Anthropic's envelope. Unknown fields are ignored with a warning (as
on the other routes); known fields the engine cannot serve are a 400 naming them. Pure Python.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from trnrt.engine.request import GenerateRequest
from trnrt.serve.http.errors import bad_request, safe, unsupported
from trnrt.serve.protocol.fields import check_unicode_tree, is_text
from trnrt.serve.protocol.fields import read_bool, read_int, read_num, read_str
from trnrt.serve.protocol.chat_messages import _check_json_schema
from trnrt.serve.protocol.openai import ChatRequest, context_check
from trnrt.serve.protocol.sampling import MAX_STOP_STRINGS, Spelling, check_sampling, read_sampling
from trnrt.serve.protocol.tool_choice import check_named, read_anthropic as read_anthropic_tool_choice

log = logging.getLogger("trnrt.serve")

# Engine names -> this API's keys (error messages name the field as the client spelled it).
ANTHROPIC = Spelling({"max_new_tokens": "max_tokens", "stop": "stop_sequences"})

# Accepted and not used: prompt caching hints, routing and account fields, beta config that does
# not change what this server generates.
_IGNORED = {"no_logs", "metadata", "service_tier", "cache_control", "container", "diagnostics", "inference_geo", "speed",
            "context_management", "user_profile_id", "workspace_id"}
MESSAGES_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p",
                   "top_k", "tools", "tool_choice", "thinking", "output_config"} | _IGNORED
COUNT_TOKENS_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                       "cache_control", "speed", "context_management"}

EFFORTS = ("low", "medium", "high", "xhigh", "max")
SERVICE_TIERS = ("auto", "standard_only")
THINKING_DISPLAYS = ("summarized", "omitted")
ROLES = ("user", "assistant", "system")
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# Needs constrained decoding (structured outputs), which this server does not have yet.
_NEEDS_GRAMMAR = "needs structured outputs (--structured-outputs, a later release of this server)"


@dataclass
class MessagesRequest(ChatRequest):
    """A parsed Messages body: the chat request it renders as, plus what the renderer needs."""

    thinking_display: str | None = None  # "omitted": thinking blocks carry no text
    stop_sequences: list[str] = field(default_factory=list)
    single_tool_call: bool = False  # tool_choice.disable_parallel_tool_use: only the first call is returned


def _warn_unknown(body: dict, allowed: set[str]) -> None:
    unknown = [k for k in body if k not in allowed]
    if unknown:
        log.warning("ignoring unknown request fields: %s", ", ".join(safe(repr(k)) for k in unknown[:16]))


def _text(v, where: str) -> str:
    if not is_text(v):
        raise bad_request(f"{where} must be a valid Unicode string", where)
    return v


def _block_type(b, where: str) -> str:
    if not isinstance(b, dict) or not isinstance(b.get("type"), str):
        raise bad_request(f"{where} must be an object with a string type", where)
    return b["type"]


def _text_blocks(content, where: str, *, allow_empty: bool = True) -> str:
    """A string, or a list of text blocks (joined); any other block is a 400 naming it."""
    if isinstance(content, str):
        return _text(content, where)
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    parts = []
    for j, b in enumerate(content):
        t = _block_type(b, f"{where}[{j}]")
        if t != "text":
            raise unsupported(f"{where}[{j}].type={safe(repr(t))}", "is not supported here: only text blocks are")
        parts.append(_text(b.get("text"), f"{where}[{j}].text"))
    if not parts and not allow_empty:
        raise bad_request(f"{where} must not be empty", where)
    return "".join(parts)


def _system(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, list):
        return "\n".join(_text_blocks([b], f"system[{j}]") for j, b in enumerate(v)) if v else None
    return _text_blocks(v, "system") or None


def _tool_result(b: dict, where: str) -> dict:
    tid = b.get("tool_use_id")
    if not isinstance(tid, str) or not tid or not is_text(tid):
        raise bad_request(f"{where}.tool_use_id must be a non-empty string", where)
    read_bool(b, "is_error", False, label=f"{where}.is_error")
    content = b.get("content")
    text = "" if content is None else _text_blocks(content, f"{where}.content")
    return {"role": "tool", "tool_call_id": tid, "content": text}


def _tool_use(b: dict, where: str) -> dict:
    for k in ("id", "name"):
        if not isinstance(b.get(k), str) or not b[k] or not is_text(b[k]):
            raise bad_request(f"{where}.{k} must be a non-empty string", where)
    args = b.get("input")
    if not isinstance(args, dict):
        raise bad_request(f"{where}.input must be an object", where)
    check_unicode_tree(args, f"{where}.input")
    # Templates iterate `arguments` as a mapping (HF convention), as the chat route passes it.
    return {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}}


def _user(content: list, where: str) -> list[dict]:
    """A user turn's blocks in order: text blocks join into user messages, each tool_result is a
    `role: tool` message (consecutive ones share the template's observation turn)."""
    out: list[dict] = []
    text: list[str] = []

    def flush():
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        t = _block_type(b, w)
        if t == "text":
            text.append(_text(b.get("text"), f"{w}.text"))
        elif t == "tool_result":
            flush()
            out.append(_tool_result(b, w))
        elif t in ("tool_use", "thinking", "redacted_thinking"):
            raise bad_request(f"{w}: a {t} block is only allowed in an assistant message", w)
        elif t in ("image", "document", "search_result", "container_upload"):
            raise unsupported(f"{w}.type={t!r}", "is not supported: this server serves text only")
        else:
            raise bad_request(f"{w}.type {safe(repr(t))} is not a content block this server knows", w)
    flush()
    return out


def _assistant(content: list, where: str) -> dict:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        t = _block_type(b, w)
        if t == "text":
            text.append(_text(b.get("text"), f"{w}.text"))
        elif t == "thinking":
            reasoning.append(_text(b.get("thinking"), f"{w}.thinking"))
            if b.get("signature") is not None:  # opaque; never checked
                _text(b["signature"], f"{w}.signature")
        elif t == "redacted_thinking":
            pass  # encrypted reasoning of another server: nothing to render
        elif t == "tool_use":
            calls.append(_tool_use(b, w))
        elif t == "tool_result":
            raise bad_request(f"{w}: a tool_result block is only allowed in a user message", w)
        elif t in ("image", "document", "search_result"):
            raise unsupported(f"{w}.type={t!r}", "is not supported: this server serves text only")
        else:
            raise bad_request(f"{w}.type {safe(repr(t))} is not a content block this server serves", w)
    m: dict = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        m["reasoning_content"] = "".join(reasoning)
    if calls:
        m["tool_calls"] = calls
    return m


def _messages(v, system: str | None) -> list[dict]:
    if not isinstance(v, list):
        raise bad_request("messages: Field required (a list of messages)", "messages")
    if not v:
        raise bad_request("messages: at least one message is required", "messages")
    systems = [system] if system else []
    out: list[dict] = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {safe(repr(role))}", where)
        content = m.get("content")
        if not isinstance(content, (str, list)):
            raise bad_request(f"{where}.content: Field required (a string or a list of content blocks)", where)
        if role == "system":  # folded into the system prompt, as vLLM does
            s = _text_blocks(content, f"{where}.content")
            if s:
                systems.append(s)
        elif role == "user":
            if not content:
                raise bad_request(f"{where}.content: a user message must not be empty", where)
            out.extend([{"role": "user", "content": _text(content, f"{where}.content")}] if isinstance(content, str)
                       else _user(content, where))
        else:
            out.append({"role": "assistant", "content": _text(content, f"{where}.content")}
                       if isinstance(content, str) else _assistant(content, where))
    if not out:
        raise bad_request("messages: at least one user or assistant message is required", "messages")
    if systems:
        out.insert(0, {"role": "system", "content": "\n".join(systems)})
    return out


def _prefill(m: dict, where: str) -> None:
    """A final assistant message is continued (HF's continue_final_message, as the chat route's)."""
    if m.get("tool_calls"):
        raise bad_request(f"{where}: a final assistant message (a prefill) cannot end with tool_use", where)
    if m["content"] != m["content"].rstrip():
        raise bad_request(f"{where}: final assistant content cannot end with trailing whitespace", where)


def _tools(v) -> list[dict] | None:
    """Custom tools -> the chat route's function tools; server tools are refused by name."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_request("tools must be a list", "tools")
    out, names = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", where)
        typ = t.get("type")
        if typ not in (None, "custom"):
            raise unsupported(f"{where}.type", f"{safe(repr(typ))} is a server tool: this server serves custom tools "
                                               "(name, input_schema) only")
        name = t.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad_request(f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {safe(repr(name))}", where)
        if name in names:
            raise bad_request(f"{where}.name {name!r}: tool names must be unique", where)
        names.add(name)
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema: Field required (a JSON Schema object)", where)
        if schema.get("type") != "object":
            raise bad_request(f"{where}.input_schema.type must be 'object'", where)
        _check_json_schema(schema, f"{where}.input_schema")
        if t.get("strict") is not None and read_bool(t, "strict", False, label=f"{where}.strict"):
            raise unsupported(f"{where}.strict", _NEEDS_GRAMMAR)
        fn: dict = {"name": name, "parameters": schema}
        if t.get("description") is not None:
            fn["description"] = _text(t["description"], f"{where}.description")
        out.append({"type": "function", "function": fn})
    check_unicode_tree(out, "tools")
    return out or None


def _tool_choice(v, tools) -> tuple[str, str | None, bool]:
    """(the chat route's tool_choice, the named tool, whether only one call is made / returned).
    any -> "required", tool -> "required" with its name (a grammar enforces both)."""
    if v is None:
        return ("auto" if tools else "none"), None, False
    if not isinstance(v, dict):
        raise bad_request("tool_choice must be an object with a type (auto, any, tool or none)", "tool_choice")
    t = v.get("type")
    if t not in ("auto", "none", "any", "tool"):
        raise bad_request(f"tool_choice.type must be one of auto, any, tool, none, got {safe(repr(t))}",
                          "tool_choice")
    single = read_bool(v, "disable_parallel_tool_use", False, label="tool_choice.disable_parallel_tool_use")
    if t in ("any", "tool"):
        if not tools:
            raise bad_request(f"tool_choice.type {t!r} needs tools", "tool_choice")
        mode, name = read_anthropic_tool_choice(v)
        check_named(tools, name, "tool_choice.name")
        return mode, name, single or name is not None
    # none: the tools are left out of the prompt (as the chat route's tool_choice "none").
    return ("auto" if (t == "auto" and tools) else "none"), None, single


def _thinking(v, kwargs: dict, max_tokens: int | None) -> str | None:
    """`thinking` -> enable_thinking; returns the display mode."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request("thinking must be an object with a type (enabled, disabled or adaptive)", "thinking")
    t = v.get("type")
    if t == "disabled":
        kwargs["enable_thinking"] = False
        return None
    if t not in ("enabled", "adaptive", "between_tools"):
        raise bad_request(f"thinking.type must be one of enabled, disabled, adaptive, got {safe(repr(t))}",
                          "thinking")
    if t == "enabled":
        if v.get("budget_tokens") is None:
            raise bad_request("thinking.budget_tokens: Field required", "thinking.budget_tokens")
        budget = read_int(v, "budget_tokens", None, lo=1, label="thinking.budget_tokens")
        # served: after budget_tokens reasoning tokens the engine forces </think> (Anthropic's own
        # floor of 1024 and "< max_tokens" are not enforced; a budget >= max_tokens never binds)
        kwargs["_thinking_budget"] = budget
    display = read_str(v, "display", None, label="thinking.display")
    if display is not None and display not in THINKING_DISPLAYS:
        raise bad_request(f"thinking.display must be one of {', '.join(THINKING_DISPLAYS)}", "thinking.display")
    kwargs["enable_thinking"] = True
    return display


def _output_config(v, kwargs: dict) -> None:
    if v is None:
        return
    if not isinstance(v, dict):
        raise bad_request("output_config must be an object", "output_config")
    if v.get("format") is not None:
        raise unsupported("output_config.format", _NEEDS_GRAMMAR)
    effort = read_str(v, "effort", None, label="output_config.effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(f"output_config.effort must be one of {', '.join(EFFORTS)}", "output_config.effort")
        kwargs["reasoning_effort"] = effort


def _check_ignored(body: dict) -> None:
    """Accepted and not used, but typed like Anthropic's API (a wrong type is a 400)."""
    md = body.get("metadata")
    if md is not None:
        if not isinstance(md, dict):
            raise bad_request("metadata must be an object", "metadata")
        read_str(md, "user_id", None, label="metadata.user_id")
    tier = read_str(body, "service_tier", None)
    if tier is not None and tier not in SERVICE_TIERS:
        raise bad_request(f"service_tier must be one of {', '.join(SERVICE_TIERS)}", "service_tier")


def _parse(body: dict, *, count: bool) -> MessagesRequest:
    _warn_unknown(body, COUNT_TOKENS_FIELDS if count else MESSAGES_FIELDS)
    model = read_str(body, "model", None)
    if not model:
        raise bad_request("model: Field required", "model")
    max_tokens = None
    if not count:
        if body.get("max_tokens") is None:
            raise bad_request("max_tokens: Field required", "max_tokens")
        max_tokens = read_int(body, "max_tokens", None, lo=1)
    stream = False if count else read_bool(body, "stream", False)
    if not count:
        _check_ignored(body)
    stops = None if count else body.get("stop_sequences")
    if stops is not None and not isinstance(stops, list):
        raise bad_request("stop_sequences must be a list of strings", "stop_sequences")
    sampling = {} if count else {k: body.get(k) for k in ("temperature", "top_p", "top_k", "stop_sequences")}
    temperature = read_num(sampling, "temperature", 1.0)
    if not 0.0 <= temperature <= 1.0:
        raise bad_request(f"temperature must be in [0, 1], got {temperature!r}", "temperature")
    if sampling.get("top_k") is not None and read_int(sampling, "top_k", None) < 0:
        # Anthropic's top_k is >= 0 (0 is no limit here; the OpenAI-side -1 spelling is not theirs)
        raise bad_request(f"top_k must be >= 0, got {sampling['top_k']!r}", "top_k")
    params = check_sampling(read_sampling(sampling, ANTHROPIC), None, ANTHROPIC)
    if len(params.stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop_sequences accepts at most {MAX_STOP_STRINGS} strings", "stop_sequences")

    messages = _messages(body.get("messages"), _system(body.get("system")))
    tools = _tools(body.get("tools"))
    tool_choice, tool_name, single_call = _tool_choice(body.get("tool_choice"), tools)
    kwargs: dict = {}
    display = _thinking(body.get("thinking"), kwargs, max_tokens)
    params.max_thinking_tokens = kwargs.pop("_thinking_budget", None)
    _output_config(body.get("output_config"), kwargs)
    prefill = messages[-1]["role"] == "assistant"  # a prefill: the answer continues it
    if prefill:
        _prefill(messages[-1], f"messages[{len(body['messages']) - 1}]")
        kwargs["continue_final_message"] = True  # HF apply_chat_template's own argument
    return MessagesRequest(model=model, stream=stream, include_usage=False, max_tokens=max_tokens, params=params,
                           add_generation_prompt=not prefill,
                           messages=messages, tools=tools, tool_choice=tool_choice, template_kwargs=kwargs,
                           enable_thinking=kwargs.get("enable_thinking", True), thinking_display=display,
                           stop_sequences=list(params.stop), single_tool_call=single_call,
                           tool_name=tool_name, parallel_tool_calls=not single_call)


def parse_messages(body: dict) -> MessagesRequest:
    """Validate a /v1/messages body."""
    return _parse(body, count=False)


def parse_count_tokens(body: dict) -> MessagesRequest:
    """Validate a /v1/messages/count_tokens body (no max_tokens, no sampling)."""
    return _parse(body, count=True)


def engine_field_to_anthropic(name: str | None) -> str | None:
    """SamplingParams / GenerateRequest names back to this API's spelling, for error messages."""
    return {"max_new_tokens": "max_tokens", "prompt_token_ids": "messages", "stop": "stop_sequences",
            "max_thinking_tokens": "thinking.budget_tokens"}.get(
        name or "", name)


def messages_to_engine_request(mreq: MessagesRequest, prompt_ids: list[int], ctx: int,
                               vocab_size: int) -> GenerateRequest:
    """The engine request of a rendered Messages request (context and sampling ranges checked)."""
    mreq.params.max_new_tokens = context_check(ctx, mreq, len(prompt_ids), "messages")
    check_sampling(mreq.params, vocab_size, ANTHROPIC)
    return GenerateRequest(prompt_ids, mreq.params, stream=mreq.stream)


__all__ = ["MessagesRequest", "parse_messages", "parse_count_tokens", "engine_field_to_anthropic",
           "messages_to_engine_request"]
