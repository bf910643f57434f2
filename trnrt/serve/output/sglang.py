"""SGLang's `/generate` renderer: `{"text", "output_ids", "meta_info"}` objects and SSE streams.

Non-streamed: one object, or a list for a batch (in prompt order). Streamed (SGLang's default):
every chunk holds the *cumulative* `text`, `output_ids` and logprob arrays of its item plus the
current `meta_info` (`finish_reason` null until the last chunk; a batch adds `index`), then
`data: [DONE]` — what `bench_serving --backend sglang` parses. With the server's
`--incremental-streaming-output`, chunks carry deltas instead.

`meta_info.finish_reason`: `{"type": "stop", "matched": <token id | stop string>}`,
`{"type": "length", "length": <completion tokens>}`, `{"type": "abort", "message": ...}` (with
`status_code` for system aborts). Logprobs are SGLang's tuples `[logprob, token_id, text | null]`.
With `logprob_start_len` k >= 0 (and return_logprob), `input_token_logprobs` / `input_top_logprobs`
cover prompt positions k .. P-1 (position 0's logprob null: nothing precedes it), so
`prompt_tokens == k + len(input_token_logprobs)`; a cumulative stream repeats them on every chunk,
an incremental one sends them on the first chunk only (later chunks: `[]`).
"""

from __future__ import annotations

import time
from typing import Iterator

from trnrt.engine.output.outputs import RequestOutput, TokenLogprob
from trnrt.serve.http import sse
from trnrt.serve.http.errors import APIError, SGLangObjectError
from trnrt.serve.output.assembler import TokenCounter
from trnrt.serve.output.assembler import system_error as _system_abort


def finish_reason_json(o: RequestOutput) -> dict | None:
    fr = o.finish_reason
    if not o.finished or fr is None:
        return None
    if fr.type == "length":
        return {"type": "length", "length": o.num_output_tokens}
    if fr.type == "abort":
        d = {"type": "abort", "message": fr.message or "Aborted"}
        status = getattr(fr, "status_code", None)
        if status is not None or o.error:
            d["status_code"] = status if status is not None else 500
            d["err_type"] = "internal_error" if o.error else None
        return d
    return {"type": "stop", "matched": fr.matched}


def system_error(o: RequestOutput) -> APIError | None:
    """The HTTP error a non-streamed finish stands for: an engine error (500) or a system abort
    with a status; None for normal finishes and client/admin aborts (HTTP 200, type abort)."""
    fr = o.finish_reason
    if fr is None or fr.type != "abort":
        return None
    if o.error:
        return SGLangObjectError(500, f"The request failed in the engine: {o.error}")
    return _system_abort(o)


class _Item:
    """Accumulated state of one batch item."""

    def __init__(self, rid: str, n_prompt: int, prompt_ids: list[int]):
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.counter = TokenCounter(n_prompt)
        self.text = ""
        self.ids: list[int] = []
        self.lps: list[TokenLogprob] = []
        self.prompt_lps: list[TokenLogprob | None] | None = None  # the engine's, from the first output
        self.last: RequestOutput | None = None
        self.sent_ts: float | None = None


class GenerateRenderer:
    """One /generate HTTP request (one item or a batch)."""

    def __init__(self, ti, greq, engine_reqs, t_start: float, incremental: bool = False,
                 cache_details: bool = False):
        self.ti, self.greq = ti, greq
        self.cache_details = cache_details  # meta_info.cached_tokens_details (hierarchical cache on)
        self.items = [_Item(r.request_id, len(r.prompt_token_ids), r.prompt_token_ids) for r in engine_reqs]
        self.t_start = t_start  # monotonic, when the HTTP request arrived (for e2e_latency)
        self.incremental = incremental

    def error_event(self, err: APIError) -> list[bytes]:
        # SGLang: errors after the stream started are an error object, then [DONE].
        return [sse.event({"error": {"message": err.message, "type": err.type or "invalid_request_error",
                                     "code": err.status, "retryable": err.status >= 500}}), sse.DONE]

    def _add(self, i: int, o: RequestOutput) -> None:
        it = self.items[i]
        it.counter.add(o)
        it.text += o.new_text
        it.ids.extend(o.new_token_ids)
        if o.new_logprobs:
            it.lps.extend(o.new_logprobs)
        if o.prompt_logprobs is not None:
            it.prompt_lps = o.prompt_logprobs
        it.last = o

    def _lp_tuple(self, token_id: int, logprob: float) -> list:
        return [logprob, token_id, self._text(token_id)]

    def _logprob_fields(self, i: int, lps: list[TokenLogprob], with_input: bool) -> dict:
        item = self.greq.items[i]
        it = self.items[i]
        n_top = item.top_logprobs_num
        inputs = (it.prompt_lps or []) if (with_input and item.input_logprobs) else []
        # prompt position p's entry; position 0 (None from the engine) has a null logprob
        first = max(item.logprob_start_len, 0)
        in_ids = [it.prompt_ids[first + j] if e is None else e.token_id for j, e in enumerate(inputs)]
        d = {"input_token_logprobs": [[None if e is None else e.logprob, t, self._text(t)]
                                      for t, e in zip(in_ids, inputs)],
             "output_token_logprobs": [self._lp_tuple(lp.token_id, lp.logprob) for lp in lps],
             "output_token_logprobs_length": len(it.lps)}
        if n_top > 0:
            d["input_top_logprobs"] = [None if e is None else [self._lp_tuple(t, v) for t, v in e.top[:n_top]]
                                       for e in inputs]
            d["output_top_logprobs"] = [[self._lp_tuple(t, v) for t, v in lp.top[:n_top]] for lp in lps]
        return d

    def _text(self, token_id: int) -> str | None:
        return self.ti.piece(token_id) if self.greq.return_text_in_logprobs else None

    def _object(self, i: int, text: str, ids: list[int], lps: list[TokenLogprob], with_input: bool = True) -> dict:
        it = self.items[i]
        o = it.last
        c = it.counter
        meta = {"id": it.rid, "finish_reason": finish_reason_json(o) if o is not None else None,
                "prompt_tokens": c.n_prompt, "weight_version": "default", "num_retractions": 0,
                "reasoning_tokens": 0, "completion_tokens": c.num_output, "cached_tokens": c.num_cached}
        if self.cache_details:  # SGLang: per tier, with the hierarchical cache
            host = min(c.num_cached_host, c.num_cached)
            meta["cached_tokens_details"] = {"device": c.num_cached - host, "host": host}
        if self.greq.items[i].return_logprob:
            meta.update(self._logprob_fields(i, lps, with_input))
        if o is not None and o.finished:
            meta["e2e_latency"] = round(time.monotonic() - self.t_start, 6)
        if it.sent_ts is None:
            it.sent_ts = time.time()
            meta["response_sent_to_client_ts"] = it.sent_ts
        d = {"text": text, "output_ids": ids, "meta_info": meta}
        if self.greq.return_prompt_token_ids:
            d["prompt_token_ids"] = list(it.prompt_ids)
        return d

    def collect(self, outputs: Iterator[tuple[int, RequestOutput]]):
        for i, o in outputs:
            self._add(i, o)
        for it in self.items:
            err = system_error(it.last)
            if err is not None:
                raise err
        objs = [self._object(i, it.text, it.ids, it.lps) for i, it in enumerate(self.items)]
        return objs if self.greq.is_batch else objs[0]

    def sse(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[bytes]:
        for i, o in outputs:
            self._add(i, o)
            it = self.items[i]
            if self.incremental:  # deltas: the prompt's logprobs come with the first output only
                n_lp = len(o.new_logprobs or [])
                obj = self._object(i, o.new_text, list(o.new_token_ids), it.lps[len(it.lps) - n_lp:],
                                   with_input=o.prompt_logprobs is not None)
            else:
                obj = self._object(i, it.text, list(it.ids), it.lps)
            if self.greq.is_batch:
                obj["index"] = i
            yield sse.event(obj)
        yield sse.DONE
