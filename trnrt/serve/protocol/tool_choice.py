"""`tool_choice` of every API -> (mode, name), and the grammar of a forced call. Pure Python.

Spellings (the chat route's mode in parentheses):
- OpenAI chat: "none" / "auto" / "required" / {"type": "function", "function": {"name": N}}.
- Responses: the same strings and {"type": "function", "name": N} (the chat spelling is accepted
  too); {"type": "allowed_tools"} is not served.
- Messages: {"type": "auto" | "none" | "any" ("required") | "tool", "name": N} (named).
`parallel_tool_calls` (Messages: not `tool_choice.disable_parallel_tool_use`) lets "required"
make several calls; a named tool makes exactly one.

"required" and a named tool are enforced by a grammar (trnrt.engine.sample.tool_call_grammar): they need
the server's --structured-outputs (the engine refuses the GrammarSpec otherwise, naming
tool_choice and the flag) and a tool-call parser, and exclude any other structured output.
"""

from __future__ import annotations

import json
from typing import Any

from trnrt.engine.sample.grammar_spec import GrammarSpec
from trnrt.engine.sample.tool_call_grammar import ToolGrammarError, tool_call_tag
from trnrt.serve.http.errors import bad_request, safe

FORCED = "required"  # the chat route's mode of "required" and of a named tool (with its name)
PARSER_OFF_MESSAGE = ("tool_choice {what} needs the GLM tool-call parser: start the server with "
                      "--tool-call-parser glm47 (not none)")


def _name(v: Any, label: str) -> str:
    if not isinstance(v, str) or not v:
        raise bad_request(f"{label} must be a non-empty string", label)
    return v


def read_openai(v: Any, *, allowed_tools_ok: bool = False) -> tuple[str, str | None]:
    """(mode, name) of OpenAI chat's / Responses' tool_choice; mode None: absent."""
    if v is None or v in ("auto", "none"):
        return v, None
    if v == "required":
        return FORCED, None
    if isinstance(v, dict):
        t = v.get("type")
        if t == "function":
            fn = v.get("function")
            if isinstance(fn, dict):
                return FORCED, _name(fn.get("name"), "tool_choice.function.name")
            return FORCED, _name(v.get("name"), "tool_choice.name")
        raise bad_request(f"tool_choice.type must be 'function', got {safe(repr(t))}", "tool_choice.type")
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                      f"{safe(repr(v))}", "tool_choice")


def read_anthropic(v: dict) -> tuple[str, str | None]:
    """(mode, name) of a Messages tool_choice object whose type is "any" or "tool"."""
    if v.get("type") == "any":
        return FORCED, None
    return FORCED, _name(v.get("name"), "tool_choice.name")


def check_named(tools: list[dict] | None, name: str | None, label: str) -> None:
    """A 400 naming `label` when the named function is not among the tools."""
    if name is None:
        return
    names = [(t.get("function") or {}).get("name") for t in tools or []]
    if name not in names:
        raise bad_request(f"{label}: function {safe(repr(name))} is not in tools", label)


def forced_call_grammar(creq, *, reasoning: bool, tool_parser: str | None) -> GrammarSpec | None:
    """The GrammarSpec of a chat request whose tool_choice forces a call (None: it does not).

    creq: a ChatRequest (tools, tool_choice, tool_name, parallel_tool_calls, params.grammar).
    reasoning: the prompt opened `<think>` (the grammar then starts with free reasoning).
    A 400 naming the field when the server has no tool-call parser, another structured output is
    asked for too, or a tool schema cannot be made a grammar.
    """
    if creq.tool_choice != FORCED:
        return creq.params.grammar
    what = f"{{'function': {creq.tool_name!r}}}" if creq.tool_name else "'required'"
    if tool_parser is None:
        raise bad_request(PARSER_OFF_MESSAGE.format(what=what), "tool_choice")
    if creq.params.grammar is not None:
        raise bad_request(f"tool_choice {what} cannot be combined with {creq.params.grammar.param} (both "
                          "constrain the output)", "tool_choice")
    try:
        tag = tool_call_tag(creq.tools or [], name=creq.tool_name, parallel=creq.parallel_tool_calls,
                            reasoning=reasoning)
    except ToolGrammarError as e:
        raise bad_request(str(e), e.field) from None
    return GrammarSpec("tool_call", json.dumps(tag, ensure_ascii=False, sort_keys=True), "tool_choice")
