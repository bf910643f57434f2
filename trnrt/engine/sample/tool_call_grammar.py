"""The GLM tool-call grammar of `tool_choice` "required" / a named tool, as an xgrammar structural tag. Pure Python.

Wire form (the chat template's; parsed by trnrt.serve.output.tool_calls):

    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>

xgrammar's built-in `glm_4_7` tag is not used, for two measured faults (reference:
structured_outputs.md §4): its tags are text, so they accept the tag spelled out with ordinary
tokens; and a string argument with minLength/maxLength becomes `[\\0-\\U0010ffff]{m,n}`, which can
swallow `</arg_value>`, `</tool_call>` and a second call. The tag built here instead:

- demands every tag as its special token (`TokenFormat` by the token's text: the compiler's tool
  vocabulary, trnrt.engine.sample.grammar, keeps exactly these tokens as ordinary tokens), so the
  spelled-out text is rejected at a tag position;
- keeps the tags' texts out of every free region: raw string values and the reasoning exclude
  them (`excludes`), JSON values exclude them inside their strings, so a value never holds a tag
  (spelled out or as a token) that the text-level parser would mistake for one;
- enforces string length bounds itself, so they cannot leak: a top-level string argument with
  minLength/maxLength is the regex "any code point but `<`" `{m,n}` (no tag can start inside
  it); a string nested in a JSON value gets the pattern "any code point but `<`, `"`, `\\` and
  controls" `{m,n}` (xgrammar drops the bounds of strings it filters, and counts a pattern on the
  escaped text: forbidding escapes keeps both lengths equal). So a length-bounded string cannot
  hold `<` (nor, nested, a quote, a backslash or a control character): a documented restriction,
  for outputs that always validate. The classes are spelled as ranges that skip the surrogates:
  xgrammar 0.2.8's negated classes accept the bytes of a UTF-16 surrogate (`ED A0 80`), which
  decode to three U+FFFD and break the length.

Arguments follow the schema's `properties` in declared order (required ones present, optional
ones may be skipped, no other keys); `pattern` strings are matched by the pattern alone; string
`format`s are not enforced on top-level string arguments. Which values are raw text and which
JSON is `is_raw_string`, the rule the parser types values by.
"""

from __future__ import annotations

import copy
from typing import Any

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
ARG_KEY, ARG_KEY_END = "<arg_key>", "</arg_key>"
ARG_VALUE, ARG_VALUE_END = "<arg_value>", "</arg_value>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_TAGS = (TOOL_START, TOOL_END, ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END)
# The special tokens a tool grammar names: the tool vocabulary keeps these (and no other special
# token) as ordinary tokens.
GRAMMAR_TOKENS = TOOL_TAGS + (THINK_START, THINK_END)
MAX_JSON_WHITESPACE = 16  # per gap inside JSON values (as trnrt.engine.sample.grammar's JSON schemas)

# Code-point classes of bounded strings (surrogates skipped, see the module docstring).
RAW_CHAR = "[\\u0000-\\u003b\\u003d-\\ud7ff\\ue000-\\U0010ffff]"  # any but '<'
JSON_CHAR = ("[\\u0020-\\u0021\\u0023-\\u003b\\u003d-\\u005b\\u005d-\\ud7ff"
             "\\ue000-\\U0010ffff]")  # any but controls, '"', '<', '\\'
# JSON-schema keywords whose values are data, not schemas (never rewritten).
_DATA_KEYWORDS = ("enum", "const", "default", "examples", "required")


class ToolGrammarError(ValueError):
    """A tool schema the grammar cannot be built from. `field`: where, in the request's spelling."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def schema_types(schema: Any):
    """The `type` of a property schema; an enum of strings counts as "string"."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if t is None and schema.get("enum") and all(isinstance(v, str) for v in schema["enum"]):
        return "string"
    return t


def is_raw_string(schema: Any) -> bool:
    """True when an argument of this schema is written raw (the string itself, no quotes): its
    types, null aside, are all "string". Everything else is written as JSON."""
    t = schema_types(schema)
    types = [x for x in (t if isinstance(t, list) else [t]) if x != "null"]
    return bool(types) and all(x == "string" for x in types)


def _token(text: str) -> dict:
    return {"type": "token", "token": text}


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _bounds(schema: dict, where: str) -> tuple[int, int | None] | None:
    """(minLength, maxLength or None) of a string schema, None when it has neither."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is None and hi is None:
        return None
    for name, v in (("minLength", lo), ("maxLength", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ToolGrammarError(f"{where}.{name} must be a non-negative integer", where)
    lo = lo or 0
    if hi is not None and lo > hi:
        raise ToolGrammarError(f"{where}: minLength {lo} is greater than maxLength {hi}", where)
    return lo, hi


def _repeat(lo: int, hi: int | None) -> str:
    return f"{{{lo},{'' if hi is None else hi}}}"


def _raw_string(schema: dict, where: str) -> dict:
    """A top-level string argument, written raw up to `</arg_value>`."""
    enum = schema.get("enum")
    if "const" in schema and isinstance(schema["const"], str):
        enum = [schema["const"]]
    if isinstance(enum, list):
        strings = [v for v in enum if isinstance(v, str)]
        if not strings:
            raise ToolGrammarError(f"{where}.enum holds no string", where)
        return {"type": "or", "elements": [_const(v) for v in strings]}
    if isinstance(schema.get("pattern"), str):
        return {"type": "regex", "pattern": schema["pattern"]}
    b = _bounds(schema, where)
    if b is not None:
        return {"type": "regex", "pattern": RAW_CHAR + _repeat(*b)}
    return {"type": "any_text", "excludes": list(GRAMMAR_TOKENS)}


def _bound_nested_strings(node: Any, where: str) -> Any:
    """A copy of a JSON sub-schema whose length-bounded strings (without a pattern) carry the
    bounds as an escape-free pattern instead (see the module docstring)."""
    if isinstance(node, list):
        return [_bound_nested_strings(v, where) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYWORDS else _bound_nested_strings(v, where)) for k, v in node.items()}
    t = out.get("type")
    is_string = t == "string" or (isinstance(t, list) and "string" in t)
    if is_string and "pattern" not in out:
        b = _bounds(out, where)
        if b is not None:
            out.pop("minLength", None)
            out.pop("maxLength", None)
            out["pattern"] = "^" + JSON_CHAR + _repeat(*b) + "$"
    return out


def _json_value(schema: Any, defs: dict, where: str) -> dict:
    sub = copy.deepcopy(schema) if isinstance(schema, dict) else {}
    for k, v in defs.items():  # "#/$defs/x" resolves against the value's own schema
        sub.setdefault(k, v)
    return {"type": "json_schema", "json_schema": _bound_nested_strings(sub, where), "style": "json",
            "excludes": list(GRAMMAR_TOKENS), "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _call(tool: dict, where: str) -> dict:
    """One call of one tool: `<tool_call>NAME` (pairs in schema order) `</tool_call>`."""
    fn = tool.get("function") or {}
    params = fn.get("parameters") or {}
    if not isinstance(params, dict):
        raise ToolGrammarError(f"{where}.parameters must be a JSON schema object", where)
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise ToolGrammarError(f"{where}.parameters.properties must be an object", where)
    required = params.get("required") or []
    defs = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
    elements = [_token(TOOL_START), _const(fn["name"])]
    for key, sub in props.items():
        w = f"{where}.parameters.properties.{key}"
        value = _raw_string(sub, w) if is_raw_string(sub) else _json_value(sub, defs, w)
        pair = {"type": "sequence", "elements": [_token(ARG_KEY), _const(key), _token(ARG_KEY_END),
                                                 _token(ARG_VALUE), value, _token(ARG_VALUE_END)]}
        elements.append(pair if key in required else {"type": "optional", "content": pair})
    elements.append(_token(TOOL_END))
    return {"type": "sequence", "elements": elements}


def tool_call_tag(tools: list[dict], *, name: str | None = None, parallel: bool = False,
                  reasoning: bool = False) -> dict:
    """The structural tag (a JSON-able dict) of a forced tool call.

    tools: the request's tools (OpenAI shape: {"type": "function", "function": {name, parameters}}).
    name: a named tool (exactly one call of it); None: "required" (a call of any tool).
    parallel: "required" may make several calls, back to back (at least one); a named tool always
    makes one. reasoning: the output starts inside `<think>` (the prompt opened it): free text
    without the tags' texts, then the `</think>` token, then the call(s).
    Nothing may follow the calls but a stop token. Raises ToolGrammarError.
    """
    by_name = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") or {}
        if isinstance(fn.get("name"), str):
            by_name.setdefault(fn["name"], (t, f"tools[{i}].function"))
    if name is not None:
        if name not in by_name:
            raise ToolGrammarError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        calls: dict = _call(*by_name[name])
    else:
        if not by_name:
            raise ToolGrammarError("tool_choice 'required' needs at least one tool in tools", "tool_choice")
        options = [_call(t, w) for t, w in by_name.values()]
        calls = options[0] if len(options) == 1 else {"type": "or", "elements": options}
        if parallel:
            calls = {"type": "plus", "content": calls}
    if reasoning:
        think = {"type": "any_text", "excludes": list(GRAMMAR_TOKENS)}
        calls = {"type": "sequence", "elements": [think, _token(THINK_END), calls]}
    return {"type": "structural_tag", "format": calls}
