"""Anthropic renderer: the Message object and its SSE stream, from one event sequence.

The renderer turns engine outputs into Anthropic's stream events (`message_start`,
`content_block_start` / `content_block_delta` / `content_block_stop`, `message_delta`,
`message_stop`, `ping`); the non-streamed Message is those same events folded the way the
official client's `MessageStream` folds them, so `messages.stream().get_final_message()` equals
`messages.create()` by construction.

Blocks, in output order: `thinking` (the GLM reasoning, with an opaque `signature`: a hash of
its text), `text` (the text outside tool calls; blocks never start or end with whitespace) and
`tool_use` (one per complete GLM tool call, its JSON `input` sent as one `input_json_delta` once
the call has parsed; a call cut off by max_tokens is dropped; with
`tool_choice.disable_parallel_tool_use` only the first call is returned). The same GLM parsers as the chat
route split the output (output/reasoning.py, output/tool_calls.py). Pure Python.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import time
import uuid
from typing import Iterator

from trnrt.engine.output.outputs import RequestOutput
from trnrt.serve.http import sse
from trnrt.serve.http.errors import AnthropicError, APIError
from trnrt.serve.output.assembler import TokenCounter, finish_of
from trnrt.serve.output.reasoning import ReasoningParser
from trnrt.serve.output.tool_calls import TOOL_END, TOOL_START, ToolCallParser

PING_INTERVAL_S = 15.0  # a `ping` when nothing was written for this long (e.g. omitted thinking)
_MARKERS = re.compile("(" + re.escape(TOOL_START) + "|" + re.escape(TOOL_END) + ")")


def frame(obj: dict) -> bytes:
    """One SSE frame with Anthropic's mandatory `event:` line (the client skips frames without one)."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + sse.dumps(obj).encode("utf-8") + b"\n\n"


def anthropic_error_event(err: APIError) -> list[bytes]:
    """An error after the stream started: `event: error` with Anthropic's envelope (the client raises it)."""
    return [frame(AnthropicError.of(err).to_dict())]


def signature_of(thinking: str) -> str:
    """An opaque, non-empty signature for a thinking block (never checked on input)."""
    return "trnrt-" + hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def fold(events: Iterator[dict]) -> dict:
    """The Message that a stream of events describes (what the official client accumulates)."""
    msg: dict | None = None
    partial: dict[int, str] = {}
    for ev in events:
        t = ev["type"]
        if t == "message_start":
            msg = copy.deepcopy(ev["message"])
        elif t == "content_block_start":
            msg["content"].append(dict(ev["content_block"]))
        elif t == "content_block_delta":
            block, d = msg["content"][ev["index"]], ev["delta"]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                block["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                partial[ev["index"]] = partial.get(ev["index"], "") + d["partial_json"]
        elif t == "content_block_stop":
            if ev["index"] in partial:
                msg["content"][ev["index"]]["input"] = json.loads(partial.pop(ev["index"]))
        elif t == "message_delta":
            msg.update(ev["delta"])
            msg["usage"].update(ev["usage"])
    return msg


class MessagesRenderer:
    """One /v1/messages response (streamed or not)."""

    def __init__(self, model: str, ti, mreq, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 counter: TokenCounter):
        self.model, self.ti, self.mreq = model, ti, mreq
        self.reasoning, self.tools, self.counter = reasoning, tools, counter
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.strip_special = mreq.user_skip_special_tokens
        self.omit_thinking = mreq.thinking_display == "omitted"
        self._index = -1
        self._open: str | None = None  # the kind of the open block: "thinking" | "text" | None
        self._thinking: list[str] = []
        self._ws = ""  # trailing whitespace of the open text block, held until more text follows
        self._emitted = 0  # tool_use blocks sent
        self._seen = 0  # complete tool calls handled (sent, or dropped after the first one)
        self.single_call = mreq.single_tool_call  # tool_choice.disable_parallel_tool_use

    error_event = staticmethod(anthropic_error_event)

    # --- the two shapes ----------------------------------------------------------------------
    def collect(self, outputs: Iterator[tuple[int, RequestOutput]]) -> dict:
        return fold(self.events(outputs))

    def sse(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[bytes]:
        last = time.monotonic()
        for ev in self.events(outputs):
            now = time.monotonic()
            if now - last > PING_INTERVAL_S:
                yield frame({"type": "ping"})
            last = now
            yield frame(ev)

    # --- the events --------------------------------------------------------------------------
    def events(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[dict]:
        started, last = False, None
        for _, o in outputs:
            self.counter.add(o)
            last = o
            if o.finished:
                finish_of(o)  # an engine error or a system abort: raised (a 5xx, or an error event)
            if not started:
                started = True
                yield self._message_start()
                yield {"type": "ping"}
            yield from self._feed(o.new_text)
        if not started:
            yield self._message_start()
        yield from self._finish_parsers()
        yield from self._close()
        stop_reason, stop_sequence = self._stop(last)
        yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": self._usage()}
        yield {"type": "message_stop"}

    def _usage(self) -> dict:
        """Anthropic's usage: input_tokens are the prompt tokens not read from the prefix cache
        (input + cache_read = the prompt, as count_tokens counts it)."""
        c = self.counter
        cached = min(c.num_cached, c.n_prompt)
        return {"input_tokens": c.n_prompt - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": c.num_output}

    def _message_start(self) -> dict:
        return {"type": "message_start",
                "message": {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                            "stop_reason": None, "stop_sequence": None, "usage": self._usage()}}

    def _stop(self, last: RequestOutput | None) -> tuple[str, str | None]:
        f = finish_of(last) if last is not None else None
        if f is not None and f.reason == "length":
            return "max_tokens", None
        if self._emitted:
            return "tool_use", None
        if f is not None and f.reason == "stop" and isinstance(f.matched, str):
            return "stop_sequence", f.matched
        return "end_turn", None  # EOS, a stop token, or an abort by a client or an admin

    def _clean(self, text: str) -> str:
        return self.ti.strip_special(text) if (self.strip_special and text) else text

    # --- blocks ------------------------------------------------------------------------------
    def _open_block(self, kind: str, block: dict) -> Iterator[dict]:
        yield from self._close()
        self._index += 1
        self._open = kind
        yield {"type": "content_block_start", "index": self._index, "content_block": block}

    def _close(self) -> Iterator[dict]:
        if self._open is None:
            return
        if self._open == "thinking":
            yield self._delta({"type": "signature_delta", "signature": signature_of("".join(self._thinking))})
            self._thinking = []
        self._ws = ""  # a text block does not end with whitespace
        self._open = None
        yield {"type": "content_block_stop", "index": self._index}

    def _delta(self, d: dict) -> dict:
        return {"type": "content_block_delta", "index": self._index, "delta": d}

    def _reasoning_text(self, r: str) -> Iterator[dict]:
        r = self._clean(r)
        if not r:
            return
        if self._open != "thinking":
            yield from self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        self._thinking.append(r)
        if not self.omit_thinking:
            yield self._delta({"type": "thinking_delta", "thinking": r})

    def _text(self, t: str) -> Iterator[dict]:
        t = self._clean(t)
        if self._open != "text":
            t = t.lstrip()
            if not t:
                return
            yield from self._open_block("text", {"type": "text", "text": ""})
        body = t.rstrip()
        if body:
            yield self._delta({"type": "text_delta", "text": self._ws + body})
            self._ws = ""
        self._ws += t[len(body):]

    def _new_calls(self) -> Iterator[dict]:
        calls = self.tools.calls
        while self._seen < len(calls) and calls[self._seen].complete:
            c = calls[self._seen]
            self._seen += 1
            if self.single_call and self._emitted:
                continue  # disable_parallel_tool_use: only the first call is returned
            self._emitted += 1
            tid = "toolu_" + c.id.removeprefix("call_")
            yield from self._open_block("tool_use", {"type": "tool_use", "id": tid, "name": c.name, "input": {}})
            yield self._delta({"type": "input_json_delta", "partial_json": c.arguments})
            yield from self._close()

    def _content(self, c: str) -> Iterator[dict]:
        if self.tools is None:
            yield from self._text(c)
            return
        # One marker per feed at most, so the order of text and calls survives a merged output:
        # the feed that completes a call releases only text that follows it.
        for piece in _MARKERS.split(c):
            if not piece:
                continue
            before = self._emitted_ready()
            ev = self.tools.feed(piece)
            if self._emitted_ready() > before:
                yield from self._new_calls()
            yield from self._text(ev.content)

    def _emitted_ready(self) -> int:
        return sum(1 for c in self.tools.calls if c.complete)

    def _feed(self, text: str) -> Iterator[dict]:
        r, c = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        yield from self._reasoning_text(r)
        if c:
            yield from self._content(c)

    def _finish_parsers(self) -> Iterator[dict]:
        r, c = self.reasoning.flush() if self.reasoning is not None else ("", "")
        yield from self._reasoning_text(r)
        if c:
            yield from self._content(c)
        if self.tools is not None:
            ev = self.tools.finish()  # an unterminated call stays incomplete (dropped)
            yield from self._new_calls()
            yield from self._text(ev.content)
