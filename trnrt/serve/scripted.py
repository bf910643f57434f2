"""A scripted engine: the EngineClient contract without a model, for exact-output API tests.

It runs its own thread like the real engine, admits requests into a bounded number of slots,
allocates pages as sequences grow, and each step emits the next scripted token of every running
request. A script is a function prompt token ids -> output token ids. It honours max_new_tokens,
stop_token_ids, EOS (unless ignore_eos), stop strings (text held back while it could still be the
start of one), abort, and logprobs (deterministic fake values), and detokenizes incrementally with
the tokenizer. Pages and slots are accounted so leak tests mean something.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from typing import Callable

from trnrt.engine.client import ModelInfo
from trnrt.engine.outputs import RequestOutput, TokenLogprob
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError
from trnrt.stats.collector import StatsCollector

log = logging.getLogger("trnrt.serve.scripted")

Script = Callable[[list[int]], list[int]]


class ScriptedStream:
    """RequestStream over a queue.Queue of RequestOutput."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._q: queue.Queue[RequestOutput] = queue.Queue()

    def put(self, out: RequestOutput) -> None:
        self._q.put(out)

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        try:
            if timeout is not None and timeout <= 0:
                return self._q.get_nowait()
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def __iter__(self):
        while True:
            out = self._q.get()
            yield out
            if out.finished:
                return


class _Running:
    def __init__(self, req: GenerateRequest, stream: ScriptedStream, script_out: list[int]):
        self.req = req
        self.stream = stream
        self.script_out = script_out
        self.output_ids: list[int] = []
        self.text_ids: list[int] = []  # ids whose text is part of the output (stop tokens excluded)
        self.sent_text = ""
        self.pages = 0


def echo_script(prompt_ids: list[int]) -> list[int]:
    """Default script for `trnrt serve --scripted`: the last 16 prompt tokens, reversed."""
    return list(reversed(prompt_ids[-16:]))


class ScriptedEngine:
    """EngineClient replaying `script(prompt_ids)` per request.

    Args:
        tokenizer: a HF tokenizer (used only on the engine thread, for detokenization).
        script: prompt ids -> output ids. An exception inside it fails that request only.
        max_model_len, eos_token_ids, served_model_name: reported in `model_info`.
        num_pages, page_size, max_running_requests: the fake cache and slots.
        step_delay_s: sleep per decode step, to make streams last (disconnect tests).
    """

    def __init__(self, tokenizer, script: Script = echo_script, *, served_model_name: str = "trnrt-tiny",
                 model_path: str = "scripted", max_model_len: int = 512,
                 eos_token_ids: tuple[int, ...] | None = None, num_pages: int = 1024, page_size: int = 16,
                 max_running_requests: int = 64, step_delay_s: float = 0.0):
        self.tokenizer = tokenizer
        self.script = script
        if eos_token_ids is None:
            eos_token_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
        self.model_info = ModelInfo(model_path=model_path, served_model_name=served_model_name,
                                    vocab_size=len(tokenizer), max_model_len=max_model_len,
                                    eos_token_ids=tuple(eos_token_ids), backend="scripted")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_running = max_running_requests
        self.step_delay_s = step_delay_s
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[_Running] = []
        self._running: dict[str, _Running] = {}
        self._used_pages = 0
        self._lock = threading.Lock()
        # The /v1/stats document comes from trnrt.stats, as the real engine's does.
        self._stats = StatsCollector(engine_id="scripted-0")
        self._stats.set_engine_info(model_path, served_model_name=served_model_name, backend="scripted")
        self._publish_live()
        self.submitted: collections.deque[GenerateRequest] = collections.deque(maxlen=256)  # for tests
        self.paused = threading.Event()  # tests: while set, requests are admitted but not stepped
        self._accepting = True
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scripted-engine", daemon=True)
        self._thread.start()

    # --- EngineClient ----------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> ScriptedStream:
        if not self._accepting:
            raise RuntimeError("engine is shutting down")
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        vocab = self.model_info.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < vocab):
                raise InvalidRequestError(f"prompt contains an out-of-vocabulary token id {t!r}", field="prompt")
        request.sampling_params.validate(vocab)
        if len(ids) + request.sampling_params.max_new_tokens > self.model_info.max_model_len:
            raise InvalidRequestError("prompt plus max_new_tokens exceeds the context length", field="max_new_tokens")
        stream = ScriptedStream(request.request_id)
        self.submitted.append(request)
        self._inbox.put(("submit", request, stream))
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> dict:
        """The /v1/stats document (trnrt.stats schema): live gauges, counters, rates, latency."""
        return self._stats.snapshot()

    def _publish_live(self) -> None:
        with self._lock:
            live = dict(running=len(self._running), queued=len(self._waiting), pages_used=self._used_pages,
                        pages_total=self.num_pages, slots_used=len(self._running), slots_total=self.max_running,
                        tokens_in_flight=sum(len(r.req.prompt_token_ids) + len(r.output_ids)
                                             for r in self._running.values()))
        self._stats.set_live(**live)

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running and not self._waiting and self._inbox.empty():
                    break
            time.sleep(0.01)
        self._inbox.put(("stop",))
        self._thread.join(timeout=5)

    # --- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            idle = not self._running and not self._waiting
            try:
                msg = self._inbox.get() if idle else self._inbox.get_nowait()  # block only when idle
            except queue.Empty:
                msg = None
            while msg is not None:
                if msg[0] == "stop":
                    self._abort_all()
                    self._stopped.set()
                    return
                self._handle(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if self.paused.is_set():
                time.sleep(0.002)
                continue
            self._admit()
            self._step()
            if self.step_delay_s and self._running:
                time.sleep(self.step_delay_s)

    def _handle(self, msg) -> None:
        if msg[0] == "submit":
            _, req, stream = msg
            self._stats.on_request_arrived(req.request_id, len(req.prompt_token_ids))
            try:
                out_ids = list(self.script(list(req.prompt_token_ids)))
            except Exception as e:  # a script failure fails this request only
                stream.put(RequestOutput(req.request_id, finished=True,
                                         finish_reason=FinishReason("abort", message=str(e)), error=str(e),
                                         num_prompt_tokens=len(req.prompt_token_ids)))
                self._stats.on_request_finished(req.request_id, "error")
                return
            with self._lock:
                self._waiting.append(_Running(req, stream, out_ids))
            self._publish_live()
        elif msg[0] == "abort":
            rid = msg[1]
            with self._lock:
                r = self._running.get(rid) or next((w for w in self._waiting if w.req.request_id == rid), None)
            if r is not None:
                self._finish(r, FinishReason("abort", message="aborted"), [], "", None)

    def _pages_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.page_size)

    def _admit(self) -> None:
        with self._lock:
            while self._waiting and len(self._running) < self.max_running:
                r = self._waiting[0]
                need = self._pages_for(len(r.req.prompt_token_ids) + 1)
                if self._used_pages + need > self.num_pages:
                    break
                self._waiting.pop(0)
                r.pages = need
                self._used_pages += need
                self._running[r.req.request_id] = r
                self._stats.on_request_scheduled(r.req.request_id)

    def _step(self) -> None:
        for r in list(self._running.values()):
            try:
                self._step_one(r)
            except Exception as e:  # never let one request kill the engine thread
                log.exception("scripted request %s failed", r.req.request_id)
                self._finish(r, FinishReason("abort", message=str(e)), [], "", None, error=str(e))
        if self._running:
            self._publish_live()

    def _step_one(self, r: _Running) -> None:
        sp = r.req.sampling_params
        if len(r.output_ids) >= sp.max_new_tokens:
            self._finish(r, FinishReason("length"), [], self._flush_text(r), None)
            return
        i = len(r.output_ids)
        if i >= len(r.script_out):  # script exhausted: a stop without a matched token
            self._finish(r, FinishReason("stop"), [], self._flush_text(r), None)
            return
        tok = r.script_out[i]
        r.output_ids.append(tok)
        self._stats.on_tokens(r.req.request_id, 1)
        with self._lock:
            need = self._pages_for(len(r.req.prompt_token_ids) + len(r.output_ids) + 1)
            if need > r.pages:
                self._used_pages += need - r.pages
                r.pages = need
        lps = [self._logprob(tok, i, sp.logprobs)] if sp.logprobs is not None else None
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.model_info.eos_token_ids):
            self._finish(r, FinishReason("stop", matched=tok), [tok], self._flush_text(r), lps)
            return
        r.text_ids.append(tok)
        full = self.tokenizer.decode(r.text_ids, skip_special_tokens=sp.skip_special_tokens)
        if full.endswith("\ufffd"):
            full = full[:-1]  # an incomplete UTF-8 character: wait for the next token
        # Stop strings: search only where a new match can start.
        for s in sp.stop:
            start = max(0, len(r.sent_text) - len(s))
            j = full.find(s, start)
            if j >= 0:
                delta = full[len(r.sent_text):j] if j >= len(r.sent_text) else ""
                r.sent_text = full[:j]
                self._finish(r, FinishReason("stop", matched=s), [tok], delta, lps)
                return
        keep = 0
        for s in sp.stop:
            for n in range(min(len(s) - 1, len(full)), keep, -1):
                if full.endswith(s[:n]):
                    keep = n
                    break
        visible = full[: len(full) - keep]
        delta = visible[len(r.sent_text):] if len(visible) > len(r.sent_text) else ""
        r.sent_text += delta
        finished = len(r.output_ids) >= sp.max_new_tokens
        if finished:
            delta += self._flush_text(r)
            self._finish(r, FinishReason("length"), [tok], delta, lps)
            return
        r.stream.put(RequestOutput(r.req.request_id, new_token_ids=[tok], new_text=delta, new_logprobs=lps,
                                   num_prompt_tokens=len(r.req.prompt_token_ids),
                                   num_output_tokens=len(r.output_ids)))

    def _flush_text(self, r: _Running) -> str:
        full = self.tokenizer.decode(r.text_ids, skip_special_tokens=r.req.sampling_params.skip_special_tokens)
        delta = full[len(r.sent_text):]
        r.sent_text = full
        return delta

    def _logprob(self, tok: int, i: int, n: int) -> TokenLogprob:
        lp = -0.05 - 0.1 * (i % 7)
        top = [(tok, lp)] + [((tok + k) % self.model_info.vocab_size, lp - 0.5 * k) for k in range(1, n)]
        return TokenLogprob(token_id=tok, logprob=lp, top=top[:n])

    def _finish(self, r: _Running, reason: FinishReason, ids: list[int], text: str, lps, error: str | None = None):
        with self._lock:
            if self._running.pop(r.req.request_id, None) is not None:
                self._used_pages -= r.pages
                r.pages = 0
            elif r in self._waiting:
                self._waiting.remove(r)
            else:
                return  # already finished
        self._stats.on_request_finished(r.req.request_id, "error" if error else reason.type)
        self._publish_live()
        r.stream.put(RequestOutput(r.req.request_id, new_token_ids=ids, new_text=text, new_logprobs=lps,
                                   finished=True, finish_reason=reason,
                                   num_prompt_tokens=len(r.req.prompt_token_ids),
                                   num_output_tokens=len(r.output_ids), error=error))

    def _abort_all(self) -> None:
        with self._lock:
            everyone = list(self._running.values()) + list(self._waiting)
        for r in everyone:
            self._finish(r, FinishReason("abort", message="engine shut down"), [], "", None)
