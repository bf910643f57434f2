"""The prompt-token cache (opt-in, `TRNRT_PROMPT_CACHE_MB`): a chat turn's prompt ids from the
previous turn's ids plus the tokenized tail.

A multi-turn chat resends the whole conversation each turn, and tokenizing it again is the part
of rendering that grows with the conversation. This cache keeps, per rendered prompt, its text and
ids, keyed by a hash of (tokenizer, chat template, tools, template kwargs) and the message list.
A new request looks for the longest prefix of its message list that was rendered before; the
cached text must be an exact prefix of the new **full render** up to an added-token boundary
(the tokenizer splits its added tokens out of the text before anything else, so the ids before
such a boundary do not depend on what follows). The ids are then the cached ids up to that
boundary plus the tail's encoding. Nothing is reused otherwise: the full render is always
computed (it is the reference), and a miss tokenizes it whole.

It checks itself: at the first use with a tokenizer it runs a built-in conversation (system,
tools, reasoning, tool calls and results) both ways; then it audits its first hits and one hit in
`audit_every` (random) against the full encoding. Any difference turns it off for good: a
warning in the log, `enabled: false` and the reason in its `status()` (published as the
`prompt_cache` key of the engine's `/v1/stats` entry), and every later request is tokenized whole.
A hit that the audit checks returns the full encoding, so a mismatch is never served.

Process-wide: `configure(mb)` installs the cache (ServeState does when prompt_cache_mb > 0),
`active()` returns it (None when not configured). Memory is bounded by an approximate byte count
of the entries (text + ids), least recently used dropped first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import threading
from collections import OrderedDict
from typing import Callable

log = logging.getLogger("trnrt.serve.prompt_cache")

_ACTIVE: "PromptCache | None" = None
_ACTIVE_LOCK = threading.Lock()


def configure(mb: float, *, collector=None, **kw) -> "PromptCache | None":
    """Install a process-wide cache of `mb` MB (0: none). With the engine's StatsCollector, its
    status becomes the `prompt_cache` section of the engine entry in /v1/stats."""
    global _ACTIVE
    with _ACTIVE_LOCK:
        _ACTIVE = PromptCache(int(mb * (1 << 20)), **kw) if mb > 0 else None
        cache = _ACTIVE
    if collector is not None and hasattr(collector, "set_section"):
        collector.set_section("prompt_cache", cache.status if cache is not None else None)
    if cache is not None:
        log.info("prompt-token cache: %.0f MB, audits the first %d hits and 1 in %d", mb, cache.audit_first,
                 cache.audit_every)
    return cache


def active() -> "PromptCache | None":
    return _ACTIVE


def _h(*parts: bytes) -> bytes:
    m = hashlib.blake2b(digest_size=16)
    for p in parts:
        m.update(len(p).to_bytes(8, "little"))
        m.update(p)
    return m.digest()


def _js(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, default=repr, separators=(",", ":")).encode()


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (slice compares in C, halving the window)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _TokInfo:
    """What the cache needs from a tokenizer: its added tokens (text -> id) as one regex."""

    def __init__(self, tokenizer) -> None:
        added = dict(getattr(tokenizer, "added_tokens_encoder", {}) or {})
        self.added_ids = frozenset(added.values())
        alts = sorted(added, key=len, reverse=True)
        self.regex = re.compile("|".join(re.escape(a) for a in alts)) if alts else None
        template = getattr(tokenizer, "chat_template", None)
        self.key = _h(str(getattr(tokenizer, "name_or_path", "")).encode(), _js(sorted(added.items())),
                      _js(template), str(len(tokenizer)).encode() if hasattr(tokenizer, "__len__") else b"")


class _Entry:
    __slots__ = ("text", "ids", "marks", "size")

    def __init__(self, text: str, ids: list[int], marks: list[tuple[int, int, int]]) -> None:
        self.text, self.ids, self.marks = text, ids, marks
        self.size = len(text) + 36 * len(ids) + 80 * len(marks) + 200


def marks_of(info: _TokInfo, text: str, ids: list[int]) -> list[tuple[int, int, int]] | None:
    """(char start, char end, token index) of every added token in `text`/`ids`, or None when the
    texts' occurrences and the ids' do not line up one to one (then the entry is not reusable)."""
    if info.regex is None:
        return None
    spans = [(m.start(), m.end()) for m in info.regex.finditer(text)]
    positions = [i for i, t in enumerate(ids) if t in info.added_ids]
    if len(spans) != len(positions):
        return None
    return [(s, e, p) for (s, e), p in zip(spans, positions)]


# The self-check conversation: what chat clients send (system, tools, reasoning, tool calls with
# object and JSON-string arguments, tool results, unicode), one turn at a time.
_CHECK_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
_CHECK_TURNS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}],
    [{"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}],
    [{"role": "assistant", "content": "21 °C in Paris.", "reasoning_content": "Report it."},
     {"role": "user", "content": "And 北京 ? <b>bold</b>  two  spaces\n"}],
    [{"role": "assistant", "content": " 北京: 3 days ", "reasoning_content": ""},
     {"role": "user", "content": "thanks"}],
]


class PromptCache:
    """See the module docstring. Thread-safe; `encode` runs on the request threads."""

    def __init__(self, max_bytes: int, *, audit_every: int = 20, audit_first: int = 8,
                 rng: random.Random | None = None, self_check: bool = True) -> None:
        self.max_bytes = int(max_bytes)
        self.audit_every = max(1, int(audit_every))
        self.audit_first = max(0, int(audit_first))
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0
        self._tok: dict[int, tuple[object, _TokInfo]] = {}
        self._self_check = self_check
        self._checked: set[bytes] = set()  # tokenizer keys that passed the self-check
        self.enabled = True
        self.disabled_reason: str | None = None
        self.hits = self.misses = self.audits = self.mismatches = 0
        self.tokens_reused = 0

    # ---- public ---------------------------------------------------------------------------------

    def status(self) -> dict:
        """The stats flag and counters (JSON-able)."""
        with self._lock:
            return {"enabled": self.enabled, "disabled_reason": self.disabled_reason, "hits": self.hits,
                    "misses": self.misses, "audits": self.audits, "mismatches": self.mismatches,
                    "tokens_reused": self.tokens_reused, "entries": len(self._entries), "bytes": self._bytes,
                    "max_bytes": self.max_bytes}

    def encode(self, tokenizer, messages: list, context, text: str, full_encode: Callable[[], list[int]]) -> list[int]:
        """The ids of `text`, the full render of `messages` under `context` (tools, template kwargs,
        add_generation_prompt: anything else the render depends on). `full_encode()` tokenizes
        `text` whole (the reference; it also raises the route's 400s)."""
        if not self.enabled:
            return full_encode()
        try:
            info = self._info(tokenizer)
            if self._self_check and info.key not in self._checked and not self._run_self_check(tokenizer, info):
                return full_encode()
            keys = self._keys(info, messages, context)
        except Exception as e:  # unhashable odd input, a tokenizer without the views: no cache
            log.debug("prompt cache skipped: %s", e)
            return full_encode()
        try:
            ids = self._from_cache(tokenizer, info, keys, text)
        except Exception:  # a tail the tokenizer refuses: the full encoding raises the route's 400
            ids = None
        if ids is None:
            ids = full_encode()
            with self._lock:
                self.misses += 1
        elif self._should_audit():
            full = full_encode()
            with self._lock:
                self.audits += 1
            if full != ids:
                self.disable(f"audit: a hit differed from the full render at token "
                             f"{_first_diff(full, ids)} ({len(ids)} ids vs {len(full)})")
                return full
        self._store(info, keys[-1], text, ids)
        return ids

    def disable(self, reason: str) -> None:
        """Off for good: a log line and the stats flag; the entries are dropped."""
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self.disabled_reason = reason
            self.mismatches += 1
            self._entries.clear()
            self._bytes = 0
        log.warning("prompt-token cache turned off for good: %s", reason)

    # ---- internals ------------------------------------------------------------------------------

    def _info(self, tokenizer) -> _TokInfo:
        hit = self._tok.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        info = _TokInfo(tokenizer)
        with self._lock:
            self._tok[id(tokenizer)] = (tokenizer, info)
        return info

    def _keys(self, info: _TokInfo, messages: list, context) -> list[bytes]:
        """keys[j]: the hash of messages[:j+1] under the context; keys[-1] the whole list."""
        h = _h(info.key, _js(context))
        keys = []
        for m in messages:
            h = _h(h, _js(m))
            keys.append(h)
        return keys

    def _from_cache(self, tokenizer, info: _TokInfo, keys: list[bytes], text: str) -> list[int] | None:
        with self._lock:
            entry = None
            for k in reversed(keys):  # the longest prefix of the message list rendered before
                entry = self._entries.get(k)
                if entry is not None:
                    self._entries.move_to_end(k)
                    break
        if entry is None:
            return None
        if entry.text == text:
            ids = list(entry.ids)
            reused = len(ids)
        else:
            lcp = common_prefix_len(entry.text, text)
            cut = None
            for start, end, pos in reversed(entry.marks):
                if end <= lcp:  # the whole added token lies in the common text
                    cut = (start, pos)
                    break
            if cut is None:
                return None
            start, pos = cut
            ids = entry.ids[:pos] + tokenizer.encode(text[start:], add_special_tokens=False)
            reused = pos
        with self._lock:
            self.hits += 1
            self.tokens_reused += reused
        return ids

    def _should_audit(self) -> bool:
        with self._lock:
            first = self.hits <= self.audit_first
        return first or self._rng.random() < 1.0 / self.audit_every

    def _store(self, info: _TokInfo, key: bytes, text: str, ids: list[int]) -> None:
        marks = marks_of(info, text, ids)
        if marks is None:
            return
        entry = _Entry(text, list(ids), marks)
        if entry.size > self.max_bytes:
            return
        with self._lock:
            if not self.enabled:
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[key] = entry
            self._bytes += entry.size
            while self._bytes > self.max_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.size

    def _run_self_check(self, tokenizer, info: _TokInfo) -> bool:
        """The built-in conversation, one turn at a time, through a scratch cache: every turn's
        ids must equal the full encoding. False (and off for good) otherwise."""
        scratch = PromptCache(1 << 24, audit_every=1, audit_first=0, self_check=False)
        messages: list = []
        try:
            for turn in _CHECK_TURNS:
                messages = messages + turn
                for tools in (_CHECK_TOOLS, None):
                    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                         tokenize=False)
                    full = tokenizer.encode(text, add_special_tokens=False)
                    got = scratch.encode(tokenizer, messages, {"tools": tools}, text, lambda: list(full))
                    if got != full or not scratch.enabled:
                        self.disable(f"self-check: turn {len(messages)} differed from the full render")
                        return False
            if scratch.hits == 0:
                self.disable("self-check: the tokenizer's added tokens do not split the rendered turns "
                             "(nothing to reuse)")
                return False
        except Exception as e:
            self.disable(f"self-check: {type(e).__name__}: {e}")
            return False
        with self._lock:
            self._checked.add(info.key)
        return True


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
