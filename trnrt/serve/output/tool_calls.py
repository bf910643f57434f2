"""GLM tool-call parsers (`--tool-call-parser glm47|glm45`) into OpenAI `tool_calls`.

Pure Python, on detokenized text with the special markers kept. Wire forms:
- glm47 (GLM-4.7 / GLM-5.x): `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>…</tool_call>`,
  calls concatenated, a no-argument call is `<tool_call>name</tool_call>`.
- glm45 (GLM-4.5 / 4.6): the name is followed by a newline (real or a literal backslash-n) and
  pairs are newline-separated.
One state machine accepts both (whitespace between pairs is skipped); the flavour only decides
which text counts as content: glm45 keeps the text before the first call, glm47 all text outside
calls (as SGLang does).

Argument values are typed by the tool's JSON schema: `string` keeps the raw text; other types are
parsed as JSON (then as a Python literal, then kept raw). `arguments` is built pair by pair as
`json.dumps` would print the object (", " and ": " separators, non-ASCII kept), so the streamed
argument deltas concatenate to exactly the non-streamed string.

The same machine serves streaming and non-streaming requests. Calls to functions not in `tools`
are dropped (as SGLang does by default).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

from trnrt.engine.sample.tool_call_grammar import is_raw_string

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
ARG_KEY = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE = "<arg_value>"
ARG_VALUE_END = "</arg_value>"

_PAIR_RE = re.compile(
    re.escape(ARG_KEY) + r"(.*?)" + re.escape(ARG_KEY_END) + r"(?:\s|\\n)*" + re.escape(ARG_VALUE) + r"(.*?)"
    + re.escape(ARG_VALUE_END),
    re.DOTALL,
)

FORMATS = ("glm47", "glm45")


def new_call_id() -> str:
    """`call_` + 24 hex characters, like SGLang's ids."""
    return "call_" + uuid.uuid4().hex[:24]


def convert_value(raw: str, schema: dict | None):
    """Type one `<arg_value>` by the property's JSON schema (see the module docstring)."""
    if is_raw_string(schema):
        return raw
    text = raw.strip()
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value)  # literal_eval may give sets, bytes, ...: those stay raw text
        return value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


@dataclass
class ToolCall:
    """One parsed call. `arguments` is a JSON object string."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def to_openai(self) -> dict:
        return {"id": self.id, "index": self.index, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolEvents:
    """What one `feed` released: content text and tool-call deltas (OpenAI delta dicts)."""

    content: str = ""
    tool_deltas: list[dict] = field(default_factory=list)


class ToolCallParser:
    """Incremental GLM tool-call parser.

    Args:
        tools: the request's `tools` (OpenAI shape); names and parameter schemas come from here.
        fmt: "glm47" or "glm45".
    """

    def __init__(self, tools: list[dict], fmt: str = "glm47"):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt = fmt
        self.schemas: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function") or {}
            params = fn.get("parameters") or {}
            self.schemas[fn.get("name")] = (params.get("properties") or {}) if isinstance(params, dict) else {}
        self.calls: list[ToolCall] = []
        self._state = "out"  # out | name | args
        self._buf = ""
        self._current: ToolCall | None = None
        self._dropped = False  # the current call names an unknown function
        self._npairs = 0
        self._seen_call = False

    # --- streaming -------------------------------------------------------------------------
    def feed(self, text: str) -> ToolEvents:
        """Consume a delta of (post-reasoning) content text."""
        self._buf += text
        ev = ToolEvents()
        content: list[str] = []
        while True:
            if self._state == "out":
                idx = self._buf.find(TOOL_START)
                if idx >= 0:
                    self._emit_content(content, self._buf[:idx])
                    self._buf = self._buf[idx + len(TOOL_START):]
                    self._state = "name"
                    self._seen_call = True
                    continue
                keep = _partial(self._buf, TOOL_START)
                self._emit_content(content, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if self._state == "name":
                ends = [(self._buf.find(m), m) for m in ("\n", "\\n", ARG_KEY, TOOL_END) if m in self._buf]
                if not ends:
                    break
                idx, marker = min(ends)
                name = self._buf[:idx].strip()
                self._buf = self._buf[idx + (len(marker) if marker in ("\n", "\\n") else 0):]
                self._dropped = name not in self.schemas
                self._npairs = 0
                if not self._dropped:
                    self._current = ToolCall(index=len(self.calls), id=new_call_id(), name=name)
                    self.calls.append(self._current)
                    ev.tool_deltas.append({"index": self._current.index, "id": self._current.id, "type": "function",
                                           "function": {"name": name, "arguments": ""}})
                self._state = "args"
                continue
            if self._state == "args":
                s = self._buf
                while True:  # skip separators: whitespace, and glm45's literal backslash-n
                    s = s.lstrip()
                    if not s.startswith("\\n"):
                        break
                    s = s[2:]
                self._buf = s
                if not s:
                    break
                if self._buf.startswith(TOOL_END):
                    self._buf = self._buf[len(TOOL_END):]
                    self._close_call(ev)
                    self._state = "out"
                    continue
                if self._buf.startswith(ARG_KEY):
                    m = _PAIR_RE.match(self._buf)
                    if not m:
                        break  # pair not complete yet
                    self._buf = self._buf[m.end():]
                    self._add_pair(ev, m.group(1).strip(), m.group(2))
                    continue
                if not self._buf or ARG_KEY.startswith(self._buf) or TOOL_END.startswith(self._buf):
                    break
                # Stray text inside a call: skip to the next marker (the model's JSON is best effort).
                nxt = [i for i in (self._buf.find("<", 1),) if i > 0]
                self._buf = self._buf[nxt[0]:] if nxt else ""
                continue
            break
        ev.content = "".join(content)
        return ev

    def finish(self) -> ToolEvents:
        """End of output: close an unterminated call's JSON, release held-back text as content."""
        ev = ToolEvents()
        if self._state == "out":
            self._emit_content_list(ev, self._buf)
        elif self._state == "name":
            # `<tool_call>` + a partial name: not a call after all.
            self._emit_content_list(ev, TOOL_START + self._buf)
        elif self._state == "args" and self._current is not None and not self._dropped:
            self._close_call(ev, complete=False)
        self._buf = ""
        self._state = "out"
        return ev

    # --- non-streaming ---------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Whole output -> (content, complete calls). No complete call: the raw text is content."""
        a = self.feed(text)
        b = self.finish()
        calls = [c for c in self.calls if c.complete]
        if not calls:
            return text, []
        return (a.content + b.content).strip(), calls

    @property
    def has_complete_calls(self) -> bool:
        return any(c.complete for c in self.calls)

    # --- helpers -----------------------------------------------------------------------------
    def _emit_content(self, out: list[str], text: str) -> None:
        if text and (self.fmt == "glm47" or not self._seen_call):
            out.append(text)

    def _emit_content_list(self, ev: ToolEvents, text: str) -> None:
        parts: list[str] = []
        self._emit_content(parts, text)
        ev.content += "".join(parts)

    def _add_pair(self, ev: ToolEvents, key: str, raw: str) -> None:
        if self._dropped or self._current is None:
            return
        value = convert_value(raw, self.schemas.get(self._current.name, {}).get(key))
        piece = ("{" if self._npairs == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": " \
            + json.dumps(value, ensure_ascii=False)
        self._npairs += 1
        self._current.arguments += piece
        ev.tool_deltas.append({"index": self._current.index, "function": {"arguments": piece}})

    def _close_call(self, ev: ToolEvents, complete: bool = True) -> None:
        if not self._dropped and self._current is not None:
            piece = "{}" if self._npairs == 0 else "}"
            self._current.arguments += piece
            self._current.complete = complete
            ev.tool_deltas.append({"index": self._current.index, "function": {"arguments": piece}})
        self._current = None
        self._dropped = False


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
