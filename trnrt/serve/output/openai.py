"""OpenAI renderers: chat.completion(.chunk) and text_completion bodies and SSE streams.

Built on the shared assembler (output/assembler.py). One renderer per HTTP request; it consumes
the (index, RequestOutput) stream that handlers/base.py drains from the engine.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Iterator

from trnrt.engine.output.outputs import RequestOutput, TokenLogprob
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


def stop_reason(creq, finish, matched):
    """vLLM's `stop_reason`: the stop string (or stop_regex pattern) or the request's own stop token
    id that ended the choice; null for EOS, length, tool calls and unfinished choices."""
    if finish != "stop" or matched is None:
        return None
    if isinstance(matched, str) or matched in creq.params.stop_token_ids:
        return matched
    return None


def token_label(ti, token_id: int, as_ids: bool = False) -> str:
    """A token as the logprobs output names it: its text, or vLLM's `token_id:<id>` with
    return_tokens_as_token_ids (a client then knows the exact token, whatever its text)."""
    return f"token_id:{token_id}" if as_ids else ti.piece(token_id)


def _utf8(s: str) -> list[int]:
    return list(s.encode("utf-8", "surrogatepass"))


def chat_logprobs(ti, lps: list[TokenLogprob], n_top: int, as_ids: bool = False) -> list[dict]:
    """Chat's logprobs `content` entries. With `as_ids` (return_tokens_as_token_ids) every `token`
    is `token_id:<id>`; as vLLM, an entry's `bytes` stay its token's text's UTF-8 while a top
    alternative's `bytes` are those of its `token` string."""
    out = []
    for lp in lps:
        out.append({"token": token_label(ti, lp.token_id, as_ids), "bytes": _utf8(ti.piece(lp.token_id)),
                    "logprob": lp.logprob,
                    "top_logprobs": [{"token": (t := token_label(ti, tid, as_ids)), "bytes": _utf8(t), "logprob": v}
                                     for tid, v in lp.top[:n_top]]})
    return out


def completion_logprobs(ti, lps: list[TokenLogprob], offset: int, prompt_ids: list[int] | None = None,
                        prompt_lps: list[TokenLogprob | None] | None = None, n_top: int = 0,
                        as_ids: bool = False) -> tuple[dict, int]:
    """The legacy logprobs object of generated tokens `lps`, text offsets from `offset`; with
    `prompt_lps` (echo with logprobs: the engine's entries for every prompt position) the prompt's
    tokens come first, the first one (nothing precedes it) with null token_logprob and top_logprobs,
    the others with their top `n_top` alternatives. With `as_ids` (return_tokens_as_token_ids)
    `tokens` and the `top_logprobs` keys are `token_id:<id>`; `text_offset` still counts the
    tokens' texts (offsets into `text`)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, e in zip(prompt_ids or [], prompt_lps or []):
        offsets.append(offset)
        offset += len(ti.piece(tid))
        tokens.append(token_label(ti, tid, as_ids))
        token_lps.append(None if e is None else e.logprob)
        tops.append(None if e is None else {token_label(ti, t, as_ids): v for t, v in e.top[:n_top]})
    for lp in lps:
        offsets.append(offset)
        offset += len(ti.piece(lp.token_id))
        tokens.append(token_label(ti, lp.token_id, as_ids))
        token_lps.append(lp.logprob)
        tops.append({token_label(ti, t, as_ids): v for t, v in lp.top})
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}, offset


def vllm_prompt_logprobs(ti, entries: list[TokenLogprob | None] | None, n_top: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position None (position 0: nothing precedes it) or
    {"<token id>": {"logprob", "rank", "decoded_token"}}: the prompt token with its rank (1 + the
    tokens more likely), then the top `n_top` alternatives ranked 1..n_top (the prompt token once)."""
    if entries is None:
        return None
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        top = e.top[:n_top]
        rank = e.rank
        if rank is None:  # no rank reported: the token's place among the top ones, if it is there
            rank = next((j + 1 for j, (t, _) in enumerate(top) if t == e.token_id), None)
        d = {str(e.token_id): {"logprob": e.logprob, "rank": rank, "decoded_token": ti.piece(e.token_id)}}
        for j, (t, v) in enumerate(top):
            d.setdefault(str(t), {"logprob": v, "rank": j + 1, "decoded_token": ti.piece(t)})
        out.append(d)
    return out


def openai_error_event(err: APIError) -> list[bytes]:
    """An error after the stream started: `data: {"error": {...}}` (SGLang's ErrorResponse inside
    `error` for a system abort), then [DONE]."""
    body = err.to_dict()
    if "error" not in body:
        body = {"error": body}
    return [sse.event(body), sse.DONE]


class _Choice:
    """The running state of one chat choice."""

    def __init__(self, out: ChatOutput, counter: TokenCounter):
        self.out, self.counter = out, counter
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.lps: list[TokenLogprob] = []
        self.pending_lps: list[TokenLogprob] = []
        self.ids: list[int] = []  # output token ids (return_token_ids)
        self.pending_ids: list[int] = []  # ids not yet sent in a streamed chunk
        self.last: RequestOutput | None = None
        self.prompt_lps: list[TokenLogprob | None] | None = None  # the engine's, from the first output


class ChatRenderer:
    """One chat request's response: `n` choices (`outs` / `counters`: one per choice, in index
    order). The prompt counts once in usage, however many choices share it."""

    def __init__(self, model: str, ti, creq, outs, counters, prompt_ids: list[int] | None = None):
        if isinstance(outs, ChatOutput):  # a single choice
            outs, counters = [outs], [counters]
        self.model, self.ti, self.creq = model, ti, creq
        self.prompt_ids = list(prompt_ids or [])  # for return_token_ids / return_prompt_token_ids
        self.choices = [_Choice(o, c) for o, c in zip(outs, counters)]
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())

    error_event = staticmethod(openai_error_event)

    @property
    def out(self) -> ChatOutput:  # the first choice's (single-choice callers)
        return self.choices[0].out

    @property
    def counter(self) -> TokenCounter:
        return self.choices[0].counter

    def _finish(self, o: RequestOutput, ch: "_Choice | None" = None) -> tuple[str, object]:
        ch = ch or self.choices[0]
        reason, matched = openai_finish(finish_of(o))
        if reason == "stop" and ch.out.tools is not None and ch.out.tools.has_complete_calls:
            return "tool_calls", None
        return reason, matched

    def _usage(self) -> dict:
        cs = [ch.counter for ch in self.choices]
        reasoning = [c.reasoning for c in cs]
        total_reasoning = None if all(r is None for r in reasoning) else sum(r or 0 for r in reasoning)
        return usage(cs[0].n_prompt, sum(c.num_output for c in cs), total_reasoning, cs[0].num_cached)

    def _logprobs(self, lps: list[TokenLogprob], n_top: int) -> dict:
        return {"content": chat_logprobs(self.ti, lps, n_top, self.creq.return_tokens_as_token_ids)}

    def _message(self, ch: "_Choice") -> dict:
        out = ch.out
        message: dict = {"role": "assistant", "content": "".join(ch.content), "reasoning_content": None}
        if out.reasoning is not None and "".join(ch.reasoning):
            message["reasoning_content"] = "".join(ch.reasoning)
        if out.tools is not None:
            calls = [c for c in out.tools.calls if c.complete]
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                message["content"] = message["content"].strip()
            elif out.tools.calls or "<tool_call>" in out.raw_content:
                # A marker but no complete call: the raw text is the answer.
                message["content"] = out.clean(out.raw_content)
        return message

    def collect(self, outputs: Iterator[tuple[int, RequestOutput]]) -> dict:
        for i, o in outputs:
            ch = self.choices[i]
            ch.counter.add(o)
            d = ch.out.feed(o.new_text)
            ch.reasoning.append(d.get("reasoning_content", ""))
            ch.content.append(d.get("content", ""))
            if o.new_logprobs:
                ch.lps.extend(o.new_logprobs)
            ch.ids.extend(o.new_token_ids)
            if o.prompt_logprobs is not None:
                ch.prompt_lps = o.prompt_logprobs
            ch.last = o
        choices = []
        for i, ch in enumerate(self.choices):
            finish, matched = self._finish(ch.last, ch)  # raises for errors and system aborts
            d = ch.out.finish()
            ch.reasoning.append(d.get("reasoning_content", ""))
            ch.content.append(d.get("content", ""))
            logprobs = None
            if self.creq.want_logprobs:
                logprobs = self._logprobs(ch.lps, self.creq.params.logprobs or 0)
            choices.append({"index": i, "message": self._message(ch), "logprobs": logprobs, "finish_reason": finish,
                            "matched_stop": matched, "stop_reason": stop_reason(self.creq, finish, matched)})
            if self.creq.return_token_ids:  # vLLM's token_ids, SGLang's response_token_ids
                choices[-1]["token_ids"] = choices[-1]["response_token_ids"] = list(ch.ids)
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage(), "metadata": {"weight_version": "default"}}
        if self.creq.return_token_ids or self.creq.return_prompt_token_ids:
            body["prompt_token_ids"] = list(self.prompt_ids)
        if self.creq.prompt_logprobs is not None:  # vLLM's: one list for the (shared) prompt
            first = next((ch.prompt_lps for ch in self.choices if ch.prompt_lps is not None), None)
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.ti, first, self.creq.prompt_logprobs)
        return body

    def _chunk(self, delta: dict, logprobs=None, finish=None, matched=None, index: int = 0,
               token_ids: list[int] | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                  "matched_stop": matched, "stop_reason": stop_reason(self.creq, finish, matched)}
        if self.creq.return_token_ids:  # the ids behind this chunk's delta
            choice["token_ids"] = list(token_ids or [])
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [choice]}
        if self.creq.continuous_usage:
            body["usage"] = self._usage()
        if not self._sent_prompt_ids and (self.creq.return_token_ids or self.creq.return_prompt_token_ids):
            body["prompt_token_ids"] = list(self.prompt_ids)  # the first chunk only (vLLM)
            self._sent_prompt_ids = True
        if not self._sent_prompt_lps and self.creq.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.ti, self._stream_prompt_lps,
                                                           self.creq.prompt_logprobs)  # the first chunk only
            self._sent_prompt_lps = True
        return sse.event(body)

    _sent_prompt_ids = False
    _sent_prompt_lps = False
    _stream_prompt_lps: list | None = None

    def sse(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[bytes]:
        want_lp = self.creq.want_logprobs
        n_top = self.creq.params.logprobs or 0
        if self.creq.prompt_logprobs is not None:
            # the first chunk carries the prompt's logprobs: every choice's first output has them
            # (the same prompt), so the first output of any choice gives them
            first = next(outputs, None)
            if first is not None:
                self._stream_prompt_lps = first[1].prompt_logprobs
                outputs = itertools.chain([first], outputs)
        for i in range(len(self.choices)):
            yield self._chunk({"role": "assistant", "content": ""}, index=i)
        for i, o in outputs:
            ch = self.choices[i]
            ch.counter.add(o)
            ch.last = o
            if o.finished:
                finish_of(o)  # an error or a system abort ends the stream with an error event
            d = ch.out.feed(o.new_text)
            if want_lp and o.new_logprobs:
                ch.pending_lps.extend(o.new_logprobs)
            ch.pending_ids.extend(o.new_token_ids)
            if d:
                lp = self._logprobs(ch.pending_lps, n_top) if want_lp else None
                ch.pending_lps = []
                ids, ch.pending_ids = ch.pending_ids, []
                yield self._chunk(d, lp, index=i, token_ids=ids)
            if o.finished:
                yield from self._end_choice(i, ch, want_lp, n_top)
        for i, ch in enumerate(self.choices):
            if ch.last is None or not ch.last.finished:  # (a stream that ended without its final output)
                yield from self._end_choice(i, ch, want_lp, n_top)
        if self.creq.include_usage:
            yield sse.event({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.model, "choices": [], "usage": self._usage()})
        yield sse.DONE

    def _end_choice(self, i: int, ch: "_Choice", want_lp: bool, n_top: int) -> Iterator[bytes]:
        d = ch.out.finish()
        lp = self._logprobs(ch.pending_lps, n_top) if (want_lp and ch.pending_lps) else None
        ch.pending_lps = []
        ids, ch.pending_ids = ch.pending_ids, []
        if d:
            yield self._chunk(d, lp, index=i, token_ids=ids)
            lp, ids = None, []
        finish, matched = self._finish(ch.last, ch)
        yield self._chunk({}, lp, finish, matched, index=i, token_ids=ids)


class CompletionRenderer:
    """One /v1/completions response: a choice per prompt."""

    def __init__(self, model: str, ti, creq, prompt_lens: list[int], echo_texts: list[str], n: int = 1,
                 prompt_ids: list[list[int]] | None = None):
        # one entry per choice (prompt p's choice j is index p * n + j); usage counts each prompt once
        self.model, self.ti, self.creq, self.n = model, ti, creq, n
        self.prompt_ids = prompt_ids or [[] for _ in prompt_lens]  # per choice (return_token_ids)
        self.echo_texts = echo_texts
        self.counters = [TokenCounter(k) for k in prompt_lens]
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())

    error_event = staticmethod(openai_error_event)

    def _usage(self) -> dict:
        cs = self.counters
        first = cs[::self.n]  # one choice per prompt: the prompt counts once
        return usage(sum(c.n_prompt for c in first), sum(c.num_output for c in cs), 0, sum(c.num_cached for c in first))

    def collect(self, outputs: Iterator[tuple[int, RequestOutput]]) -> dict:
        n = len(self.counters)
        texts = [self.echo_texts[i] if self.creq.echo else "" for i in range(n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        last: list[RequestOutput | None] = [None] * n
        ids: list[list[int]] = [[] for _ in range(n)]
        plps: list[list | None] = [None] * n  # the engine's prompt logprobs, from each first output
        for i, o in outputs:
            self.counters[i].add(o)
            texts[i] += o.new_text
            if o.new_logprobs:
                lps[i].extend(o.new_logprobs)
            ids[i].extend(o.new_token_ids)
            if o.prompt_logprobs is not None:
                plps[i] = o.prompt_logprobs
            last[i] = o
        choices = []
        for i in range(n):
            finish, matched = openai_finish(finish_of(last[i]))
            logprobs = None
            if self.creq.logprobs is not None:
                logprobs, _ = completion_logprobs(self.ti, lps[i], 0, *self._echo_prompt(i, plps[i]),
                                                  as_ids=self.creq.return_tokens_as_token_ids)
            choices.append({"index": i, "text": texts[i], "logprobs": logprobs, "finish_reason": finish,
                            "matched_stop": matched, "stop_reason": stop_reason(self.creq, finish, matched)})
            if self.creq.prompt_logprobs is not None:  # vLLM's, per choice
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(self.ti, plps[i], self.creq.prompt_logprobs)
            if self.creq.return_token_ids:  # vLLM's (and SGLang's) token ids per choice
                choices[-1]["prompt_token_ids"] = list(self.prompt_ids[i])
                choices[-1]["token_ids"] = ids[i]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage(), "metadata": {"weight_version": "default"}}

    def _echo_prompt(self, i: int, prompt_lps) -> tuple:
        """completion_logprobs' prompt arguments for choice i: the prompt's tokens lead the legacy
        logprobs object with echo (its top-`logprobs` alternatives); nothing otherwise."""
        if not self.creq.echo_logprobs or prompt_lps is None:
            return None, None, 0
        return self.prompt_ids[i], prompt_lps, self.creq.logprobs or 0

    def _chunk(self, i: int, text: str, logprobs=None, finish=None, matched=None,
               token_ids: list[int] | None = None, first: bool = False, prompt_lps=None) -> bytes:
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched,
                  "stop_reason": stop_reason(self.creq, finish, matched)}
        if self.creq.prompt_logprobs is not None and first:  # vLLM: on each choice's first chunk
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.ti, prompt_lps, self.creq.prompt_logprobs)
        if self.creq.return_token_ids:  # the prompt's ids on a choice's first chunk (vLLM), then deltas
            if first:
                choice["prompt_token_ids"] = list(self.prompt_ids[i])
            choice["token_ids"] = list(token_ids or [])
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.creq.continuous_usage:
            body["usage"] = self._usage()
        return sse.event(body)

    def sse(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[bytes]:
        n = len(self.counters)
        pending_echo = [self.echo_texts[i] if self.creq.echo else "" for i in range(n)]
        offsets = [0] * n
        started = [False] * n
        prompt_lps: list[list | None] = [None] * n
        pending_ids: list[list[int]] = [[] for _ in range(n)]
        for i, o in outputs:
            self.counters[i].add(o)
            finish, matched = openai_finish(finish_of(o)) if o.finished else (None, None)
            lp = None
            if o.prompt_logprobs is not None:
                prompt_lps[i] = o.prompt_logprobs  # the first output: out with the first chunk
            if self.creq.logprobs is not None:
                # the prompt's part (echo) rides on the chunk that carries the echoed text
                echo_part = self._echo_prompt(i, o.prompt_logprobs) if not started[i] else (None, None, 0)
                lp, offsets[i] = completion_logprobs(self.ti, o.new_logprobs or [], offsets[i], *echo_part,
                                                     as_ids=self.creq.return_tokens_as_token_ids)
            text = pending_echo[i] + o.new_text
            pending_echo[i] = ""
            pending_ids[i].extend(o.new_token_ids)
            if text or o.finished or (lp and lp["tokens"]) or (not started[i] and prompt_lps[i] is not None):
                yield self._chunk(i, text, lp, finish, matched, token_ids=pending_ids[i], first=not started[i],
                                  prompt_lps=prompt_lps[i])
                started[i], pending_ids[i] = True, []
        if self.creq.include_usage:
            yield sse.event({"id": self.id, "object": "text_completion", "created": self.created,
                             "model": self.model, "choices": [], "usage": self._usage()})
        yield sse.DONE
