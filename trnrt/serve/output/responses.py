"""The Responses API renderer: a `Response` object, or its SSE event stream, from one chat generation.

Built on the shared assembler (`ChatOutput` splits reasoning / text / GLM tool calls; `TokenCounter`
counts tokens). One `ResponseBuilder` turns those deltas into output items — `reasoning`
(`content: [reasoning_text]`, `summary: []`), `message` (one `output_text` part, `annotations: []`)
and one `function_call` per tool call — in generation order, and into the events of OpenAI's
stream (each with its `sequence_number`). `collect()` runs the very same builder and returns the
final object, so a streamed answer reassembles to exactly the non-streamed one.

Raw output text is fed in pieces cut before every `<`, so a piece holds at most one marker and
reasoning, tool calls and text come out in the order the model wrote them even when the engine
delivers the whole answer at once (a non-streamed request).
"""

from __future__ import annotations

import copy
import re
import time
import uuid
from typing import Callable, Iterator

from trnrt.engine.output.outputs import RequestOutput, TokenLogprob
from trnrt.serve.http import sse
from trnrt.serve.http.errors import APIError
from trnrt.serve.output.assembler import ChatOutput, TokenCounter, finish_of

_PIECES = re.compile(r"(?=<)")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def openai_error(e: APIError) -> APIError:
    """`e` in OpenAI's envelope (a system abort comes as SGLang's object envelope elsewhere)."""
    if type(e) is APIError:
        return e
    return APIError(e.status, e.message, e.param, e.type, e.code, e.headers)


def usage_of(counter: TokenCounter) -> dict:
    return {"input_tokens": counter.n_prompt,
            "input_tokens_details": {"cached_tokens": counter.num_cached, "cache_write_tokens": 0},
            "output_tokens": counter.num_output,
            "output_tokens_details": {"reasoning_tokens": counter.reasoning or 0},
            "total_tokens": counter.n_prompt + counter.num_output}


class ResponseBuilder:
    """Output items and stream events from ChatOutput deltas. `events` collects the SSE frames
    when `stream` (nothing is serialized otherwise)."""

    def __init__(self, out: ChatOutput, ti, *, parallel_tool_calls: bool = True, want_logprobs: bool = False,
                 n_top: int = 0, stream: bool = True, forced_reasoning: bool = False):
        self.out, self.ti = out, ti
        self.parallel = parallel_tool_calls
        self.want_lp, self.n_top = want_logprobs, n_top
        self.stream = stream
        self.items: list[dict] = []
        self.events: list[bytes] = []
        self.seq = 0
        self._cur: dict | None = None  # the open item
        self._part: dict | None = None  # its open content part
        self._call_index: int | None = None  # the tool-call index of an open function_call item
        self._calls: dict[int, dict] = {}  # tool-call index -> item
        self._dropped: set[int] = set()  # calls past the first when parallel_tool_calls is false
        self._ws = ""  # whitespace-only text held until it is followed by text
        # logprobs of the tokens that make the message text (not reasoning, markers, calls)
        markers = ti.marker_ids if ti is not None else {}
        self._mk = {markers.get(k): k for k in ("<think>", "</think>", "<tool_call>", "</tool_call>")
                    if markers.get(k) is not None}
        self._lp_state = "reasoning" if (out.reasoning is not None and forced_reasoning) else "content"
        self._lps: list[TokenLogprob] = []

    # --- events ---------------------------------------------------------------------------------
    def emit(self, typ: str, **fields) -> None:
        if self.stream:
            obj = {"type": typ, **fields, "sequence_number": self.seq}
            self.events.append(b"event: " + typ.encode() + b"\n" + sse.event(obj))
        self.seq += 1

    def take(self) -> list[bytes]:
        ev, self.events = self.events, []
        return ev

    @property
    def oi(self) -> int:
        return len(self.items) - 1

    def _open(self, item: dict) -> None:
        self.close()
        self.items.append(item)
        self._cur = item
        self.emit("response.output_item.added", output_index=self.oi, item=copy.deepcopy(item))

    def _open_part(self, part: dict) -> None:
        self._cur["content"].append(part)
        self._part = part
        self.emit("response.content_part.added", item_id=self._cur["id"], output_index=self.oi, content_index=0,
                  part=copy.deepcopy(part))

    def close(self, status: str = "completed") -> None:
        it = self._cur
        if it is None:
            return
        oi, iid = self.oi, it["id"]
        if it["type"] == "reasoning":
            self.emit("response.reasoning_text.done", item_id=iid, output_index=oi, content_index=0,
                      text=self._part["text"])
            self.emit("response.content_part.done", item_id=iid, output_index=oi, content_index=0, part=self._part)
        elif it["type"] == "message":
            self.emit("response.output_text.done", item_id=iid, output_index=oi, content_index=0,
                      text=self._part["text"], logprobs=self._delta_lps(self._part["logprobs"]))
            self.emit("response.content_part.done", item_id=iid, output_index=oi, content_index=0, part=self._part)
        else:
            call = self._tool(self._call_index)
            if call is not None and not call.complete:
                status = "incomplete"
            self.emit("response.function_call_arguments.done", item_id=iid, output_index=oi,
                      arguments=it["arguments"])
        it["status"] = status
        self.emit("response.output_item.done", output_index=oi, item=it)
        self._cur = self._part = self._call_index = None

    # --- deltas ---------------------------------------------------------------------------------
    def _tool(self, index):
        tools = self.out.tools
        if tools is None or index is None or index >= len(tools.calls):
            return None
        return tools.calls[index]

    def reasoning(self, text: str) -> None:
        if not text:
            return
        if self._cur is None or self._cur["type"] != "reasoning":
            self._open({"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"})
            self._open_part({"type": "reasoning_text", "text": ""})
        self._part["text"] += text
        self.emit("response.reasoning_text.delta", item_id=self._cur["id"], output_index=self.oi, content_index=0,
                  delta=text)

    def text(self, text: str) -> None:
        if not text:
            return
        if self._cur is None or self._cur["type"] != "message":
            text = self._ws + text
            if not text.strip():
                self._ws = text
                return
            self._ws = ""
            text = text.lstrip()
            self._open({"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []})
            self._open_part({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self._part["text"] += text
        lps = self._take_lps()
        self._part["logprobs"].extend(lps)
        self.emit("response.output_text.delta", item_id=self._cur["id"], output_index=self.oi, content_index=0,
                  delta=text, logprobs=self._delta_lps(lps))

    def tool_deltas(self, deltas: list[dict]) -> None:
        for d in deltas:
            idx = d["index"]
            if "id" in d:  # a new call
                if not self.parallel and self._calls:
                    self._dropped.add(idx)
                    continue
                self._ws = ""
                item = {"id": new_id("fc_"), "type": "function_call", "call_id": d["id"],
                        "name": d["function"]["name"], "arguments": "", "status": "in_progress"}
                self._open(item)
                self._calls[idx] = item
                self._call_index = idx
            if idx in self._dropped or idx not in self._calls:
                continue
            piece = d.get("function", {}).get("arguments") or ""
            if piece and self._call_index == idx:
                item = self._calls[idx]
                item["arguments"] += piece
                self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=self.oi,
                          delta=piece)

    def _apply(self, d: dict) -> None:
        self.reasoning(d.get("reasoning_content", ""))
        self.tool_deltas(d.get("tool_calls") or [])
        self.text(d.get("content", ""))

    def feed(self, o: RequestOutput) -> None:
        if self.want_lp and o.new_logprobs:
            self._sort_lps(o.new_logprobs)
        for piece in _PIECES.split(o.new_text):
            if piece:
                self._apply(self.out.feed(piece))

    def finish(self, status: str) -> None:
        self._apply(self.out.finish())
        if self._cur is not None and self._cur["type"] == "message" and self._lps:
            self._part["logprobs"].extend(self._take_lps())
        self.close("completed" if status == "completed" else "incomplete")

    # --- logprobs -------------------------------------------------------------------------------
    def _sort_lps(self, lps: list[TokenLogprob]) -> None:
        special = self.ti.special_tokens if self.ti is not None else set()
        for lp in lps:
            m = self._mk.get(lp.token_id)
            if m is not None:
                self._lp_state = {"<think>": "reasoning", "</think>": "content", "<tool_call>": "tool",
                                  "</tool_call>": "content"}[m]
                continue
            if self._lp_state == "content" and self.ti.piece(lp.token_id) not in special:
                self._lps.append(lp)

    def _take_lps(self) -> list[dict]:
        if not self.want_lp:
            return []
        lps, self._lps = self._lps, []
        out = []
        for lp in lps:
            tok = self.ti.piece(lp.token_id)
            out.append({"token": tok, "bytes": list(tok.encode("utf-8", "surrogatepass")), "logprob": lp.logprob,
                        "top_logprobs": [{"token": (t := self.ti.piece(tid)),
                                          "bytes": list(t.encode("utf-8", "surrogatepass")), "logprob": v}
                                         for tid, v in lp.top[:self.n_top]]})
        return out

    @staticmethod
    def _delta_lps(lps: list[dict]) -> list[dict]:
        return [{"token": lp["token"], "logprob": lp["logprob"],
                 "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}
                for lp in lps]


class ResponsesRenderer:
    """One /v1/responses answer. `base` holds the echoed request settings (everything but id,
    status, output, usage and timestamps); `on_update(response, final)` is called with the
    in-progress object once and the final one at the end (the response store)."""

    def __init__(self, response_id: str, model: str, ti, base: dict, out: ChatOutput, counter: TokenCounter, *,
                 parallel_tool_calls: bool = True, want_logprobs: bool = False, n_top: int = 0,
                 forced_reasoning: bool = False, on_update: Callable[[dict, bool], None] | None = None):
        self.id, self.model, self.ti, self.base = response_id, model, ti, base
        self.out, self.counter = out, counter
        self.created_at = int(time.time())
        self.on_update = on_update
        self._builder_kw = dict(parallel_tool_calls=parallel_tool_calls, want_logprobs=want_logprobs, n_top=n_top,
                                forced_reasoning=forced_reasoning)
        self.b: ResponseBuilder | None = None
        self.final: dict | None = None

    def response(self, status: str, output: list, usage: dict | None = None, incomplete: str | None = None,
                 error: dict | None = None) -> dict:
        r = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
             "completed_at": int(time.time()) if status not in ("in_progress", "queued") else None,
             "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
             "model": self.model, "output": output}
        r.update(self.base)
        r["usage"] = usage
        return r

    def _status(self, o: RequestOutput | None) -> tuple[str, str | None]:
        f = finish_of(o) if o is not None else None  # raises for engine errors and system aborts
        if f is None or f.reason == "abort":
            return "cancelled", None
        if f.reason == "length":
            return "incomplete", "max_output_tokens"
        return "completed", None

    def _run(self, outputs: Iterator[tuple[int, RequestOutput]], stream: bool) -> Iterator[list[bytes]]:
        b = self.b = ResponseBuilder(self.out, self.ti, stream=stream, **self._builder_kw)
        start = self.response("in_progress", [])
        if self.on_update:
            self.on_update(start, False)
        b.emit("response.created", response=start)
        b.emit("response.in_progress", response=start)
        yield b.take()
        last = None
        for _, o in outputs:
            self.counter.add(o)
            last = o
            if o.finished:
                self._status(o)  # an error ends the stream with response.failed (error_event)
            b.feed(o)
            yield b.take()
        status, reason = self._status(last)
        b.finish(status)
        self.final = self.response(status, b.items, usage_of(self.counter), reason)
        if self.on_update:
            self.on_update(self.final, True)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status,
                                                                                          "response.incomplete")
        b.emit(kind, response=self.final)
        yield b.take()

    def collect(self, outputs: Iterator[tuple[int, RequestOutput]]) -> dict:
        try:
            for _ in self._run(outputs, stream=False):
                pass
        except APIError as e:
            self._failed(e)
            raise openai_error(e)
        return self.final

    def sse(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[bytes]:
        try:
            for frames in self._run(outputs, stream=True):
                yield from frames
        finally:
            if self.final is None and self.on_update:  # the client left (or an error): not completed
                items = self.b.items if self.b is not None else []
                self.on_update(self.response("cancelled", items, usage_of(self.counter)), True)

    def _failed(self, e: APIError) -> dict:
        r = self.response("failed", self.b.items if self.b is not None else [], usage_of(self.counter),
                          error={"code": "server_error" if e.status >= 500 else "invalid_request",
                                 "message": e.message})
        self.final = r
        if self.on_update:
            self.on_update(r, True)
        return r

    def error_event(self, err: APIError) -> list[bytes]:
        """An error after the stream started: `response.failed` (same id), then the stream ends."""
        r = self._failed(err)
        b = self.b or ResponseBuilder(self.out, self.ti)
        b.stream = True
        b.emit("response.failed", response=r)
        return b.take()


__all__ = ["ResponseBuilder", "ResponsesRenderer", "usage_of", "new_id", "openai_error"]
