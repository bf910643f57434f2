"""The chat routes' messages and tools, read and checked: message content as text, roles, an
assistant's tool calls parsed for the template, tool definitions and their JSON Schemas. Raises
`OpenAIError` (400, naming the field); used by openai.py's parse_chat, and the JSON Schema check
by the Responses and Messages parsers.
"""

from __future__ import annotations

import json
import re

from trnrt.serve.http.errors import bad_request, safe, unsupported
from trnrt.serve.protocol.fields import is_text

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


def _text_of(content, where: str) -> str:
    """Message content as text: a string, or a list of text parts (other part types are refused)."""
    if isinstance(content, str):
        if not is_text(content):
            raise bad_request(f"{where}.content is not valid Unicode (it holds a lone surrogate)", f"{where}.content")
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                raise bad_request(f"{where}.content[{j}] must be an object with a type", f"{where}.content")
            if p["type"] not in ("text", "input_text"):
                raise unsupported(f"{where}.content[{j}].type={p['type']!r}",
                                  "is not supported: this server serves text only")
            if not is_text(p.get("text")):
                raise bad_request(f"{where}.content[{j}].text must be a valid Unicode string", f"{where}.content")
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
            if not is_text(m[k]):
                raise bad_request(f"{where}.{k} must be a valid Unicode string", "messages")
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
    if not _TOOL_NAME.match(fn["name"]):
        raise bad_request(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {safe(repr(fn['name']))}",
                          "tools")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
        _check_json_schema(params, f"{where}.function.parameters")
    if fn.get("description") is not None and not is_text(fn["description"]):
        raise bad_request(f"{where}.function.description must be a valid Unicode string", "tools")


def _check_json_schema(schema: dict, where: str) -> None:
    """A tool's parameters must be a valid JSON Schema (the `jsonschema` package's meta-schema
    check, draft 2020-12 unless `$schema` names another)."""
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise bad_request(f"{where}{path} is not a valid JSON Schema: {safe(e.message)[:200]}", "tools")
    except (RecursionError, TypeError, ValueError) as e:  # absurdly nested or odd input
        raise bad_request(f"{where} is not a valid JSON Schema: {type(e).__name__}", "tools")
