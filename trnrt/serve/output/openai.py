"""OpenAI renderers: chat.completion(.chunk) and text_completion bodies and SSE streams.

Built on the shared assembler (output/assembler.py). One renderer per HTTP request; it consumes
the (index, RequestOutput) stream that handlers/base.py drains from the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator

from trnrt.engine.outputs import RequestOutput, TokenLogprob
from trnrt.serve.http import sse
from trnrt.serve.http.errors import APIError
from trnrt.serve.output.assembler import ChatOutput, Finish, TokenCounter, finish_of, usage


def openai_finish(f: Finish) -> tuple[str, object]:
    """OpenAI finish_reason and SGLang's matched_stop."""
    if f.reason == "length":
        return "length", None
    if f.reason == "abort":
        return "abort", None
    return "stop", f.matched


def chat_logprobs(ti, lps: list[TokenLogprob], n_top: int) -> list[dict]:
    out = []
    for lp in lps:
        tok = ti.piece(lp.token_id)
        out.append({"token": tok, "bytes": list(tok.encode("utf-8", "surrogatepass")), "logprob": lp.logprob,
                    "top_logprobs": [{"token": (t := ti.piece(tid)), "bytes": list(t.encode("utf-8", "surrogatepass")),
                                      "logprob": v}
                                     for tid, v in lp.top[:n_top]]})
    return out


def completion_logprobs(ti, lps: list[TokenLogprob], offset: int) -> tuple[dict, int]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tok = ti.piece(lp.token_id)
        offsets.append(offset)
        offset += len(tok)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({ti.piece(t): v for t, v in lp.top})
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}, offset


def openai_error_event(err: APIError) -> list[bytes]:
    """An error after the stream started: `data: {"error": {...}}` (SGLang's ErrorResponse inside
    `error` for a system abort), then [DONE]."""
    body = err.to_dict()
    if "error" not in body:
        body = {"error": body}
    return [sse.event(body), sse.DONE]


class ChatRenderer:
    """One chat request's response (a single choice)."""

    def __init__(self, model: str, ti, creq, out: ChatOutput, counter: TokenCounter):
        self.model, self.ti, self.creq, self.out, self.counter = model, ti, creq, out, counter
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())

    error_event = staticmethod(openai_error_event)

    def _finish(self, o: RequestOutput) -> tuple[str, object]:
        reason, matched = openai_finish(finish_of(o))
        if reason == "stop" and self.out.tools is not None and self.out.tools.has_complete_calls:
            return "tool_calls", None
        return reason, matched

    def _usage(self) -> dict:
        c = self.counter
        return usage(c.n_prompt, c.num_output, c.reasoning, c.num_cached)

    def collect(self, outputs: Iterator[tuple[int, RequestOutput]]) -> dict:
        reasoning, content, lps = [], [], []
        last = None
        for _, o in outputs:
            self.counter.add(o)
            d = self.out.feed(o.new_text)
            reasoning.append(d.get("reasoning_content", ""))
            content.append(d.get("content", ""))
            if o.new_logprobs:
                lps.extend(o.new_logprobs)
            last = o
        finish, matched = self._finish(last)  # raises for errors and system aborts
        d = self.out.finish()
        reasoning.append(d.get("reasoning_content", ""))
        content.append(d.get("content", ""))
        message: dict = {"role": "assistant", "content": "".join(content), "reasoning_content": None}
        if self.out.reasoning is not None and "".join(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        if self.out.tools is not None:
            calls = [c for c in self.out.tools.calls if c.complete]
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                message["content"] = message["content"].strip()
            elif self.out.tools.calls or "<tool_call>" in self.out.raw_content:
                # A marker but no complete call: the raw text is the answer.
                message["content"] = self.out.clean(self.out.raw_content)
        logprobs = None
        if self.creq.want_logprobs:
            logprobs = {"content": chat_logprobs(self.ti, lps, self.creq.params.logprobs or 0)}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish,
                             "matched_stop": matched}],
                "usage": self._usage(), "metadata": {"weight_version": "default"}}

    def _chunk(self, delta: dict, logprobs=None, finish=None, matched=None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched}
        return sse.event({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                          "model": self.model, "choices": [choice]})

    def sse(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[bytes]:
        want_lp = self.creq.want_logprobs
        n_top = self.creq.params.logprobs or 0
        yield self._chunk({"role": "assistant", "content": ""})
        pending_lps: list[TokenLogprob] = []
        last = None
        for _, o in outputs:
            self.counter.add(o)
            last = o
            if o.finished:
                finish_of(o)  # an error or a system abort ends the stream with an error event
            d = self.out.feed(o.new_text)
            if want_lp and o.new_logprobs:
                pending_lps.extend(o.new_logprobs)
            if d:
                lp = {"content": chat_logprobs(self.ti, pending_lps, n_top)} if want_lp else None
                pending_lps = []
                yield self._chunk(d, lp)
        d = self.out.finish()
        lp = {"content": chat_logprobs(self.ti, pending_lps, n_top)} if (want_lp and pending_lps) else None
        if d:
            yield self._chunk(d, lp)
            lp = None
        finish, matched = self._finish(last)
        yield self._chunk({}, lp, finish, matched)
        if self.creq.include_usage:
            yield sse.event({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.model, "choices": [], "usage": self._usage()})
        yield sse.DONE


class CompletionRenderer:
    """One /v1/completions response: a choice per prompt."""

    def __init__(self, model: str, ti, creq, prompt_lens: list[int], echo_texts: list[str]):
        self.model, self.ti, self.creq = model, ti, creq
        self.echo_texts = echo_texts
        self.counters = [TokenCounter(n) for n in prompt_lens]
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())

    error_event = staticmethod(openai_error_event)

    def _usage(self) -> dict:
        cs = self.counters
        return usage(sum(c.n_prompt for c in cs), sum(c.num_output for c in cs), 0, sum(c.num_cached for c in cs))

    def collect(self, outputs: Iterator[tuple[int, RequestOutput]]) -> dict:
        n = len(self.counters)
        texts = [self.echo_texts[i] if self.creq.echo else "" for i in range(n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        last: list[RequestOutput | None] = [None] * n
        for i, o in outputs:
            self.counters[i].add(o)
            texts[i] += o.new_text
            if o.new_logprobs:
                lps[i].extend(o.new_logprobs)
            last[i] = o
        choices = []
        for i in range(n):
            finish, matched = openai_finish(finish_of(last[i]))
            logprobs = None
            if self.creq.logprobs is not None:
                logprobs, _ = completion_logprobs(self.ti, lps[i], 0)
            choices.append({"index": i, "text": texts[i], "logprobs": logprobs, "finish_reason": finish,
                            "matched_stop": matched})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage(), "metadata": {"weight_version": "default"}}

    def _chunk(self, i: int, text: str, logprobs=None, finish=None, matched=None) -> bytes:
        return sse.event({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                          "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                       "matched_stop": matched}]})

    def sse(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[bytes]:
        n = len(self.counters)
        pending_echo = [self.echo_texts[i] if self.creq.echo else "" for i in range(n)]
        offsets = [0] * n
        for i, o in outputs:
            self.counters[i].add(o)
            finish, matched = openai_finish(finish_of(o)) if o.finished else (None, None)
            lp = None
            if self.creq.logprobs is not None:
                lp, offsets[i] = completion_logprobs(self.ti, o.new_logprobs or [], offsets[i])
            text = pending_echo[i] + o.new_text
            pending_echo[i] = ""
            if text or o.finished or (lp and lp["tokens"]):
                yield self._chunk(i, text, lp, finish, matched)
        if self.creq.include_usage:
            yield sse.event({"id": self.id, "object": "text_completion", "created": self.created,
                             "model": self.model, "choices": [], "usage": self._usage()})
        yield sse.DONE
