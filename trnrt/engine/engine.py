"""Engine: one thread owns the scheduler, the model runner, detokenizers and stats.

Request flow (DESIGN.md): a client thread calls `submit()` (validation happens there and raises
InvalidRequestError naming the field) -> the engine thread takes submissions and aborts from its
inbox -> `scheduler.schedule()` -> `runner.execute()` (model + sampler per bucket) ->
`scheduler.update_from_output()` -> incremental detokenization and stop strings -> a
RequestOutput on each request's OutputStream -> stats. Only the engine thread touches scheduler,
cache and runner state, so none of them needs a lock.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

from trnrt.config import EngineConfig
from trnrt.engine.cache_manager import CacheManager
from trnrt.engine.client import ModelInfo
from trnrt.engine.detokenizer import IncrementalDetokenizer
from trnrt.engine.model_runner import ModelRunner, RowInput
from trnrt.engine.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError
from trnrt.engine.scheduler import Scheduler, SchedulerConfig
from trnrt.engine.stop import StopChecker, is_token_stop
from trnrt.engine.stream import OutputStream

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1
DEFAULT_SERVED_MODEL_NAME = "glm-5.3-flash-tiny"


class EngineDeadError(RuntimeError):
    """The engine is shutting down or its thread died; no new requests are accepted."""


def read_eos_token_ids(model_dir: Path, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list), else the tokenizer's eos token."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids = [eos]
        elif isinstance(eos, list):
            ids = [int(t) for t in eos]
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = [int(tokenizer.eos_token_id)]
    return tuple(dict.fromkeys(ids))


def fast_decoder(tokenizer):
    """The object the detokenizers call `decode(ids, skip_special_tokens=...)` on: the Rust
    `tokenizers.Tokenizer` behind a transformers fast tokenizer when that gives the same text (no
    clean-up of tokenization spaces), else the tokenizer itself. The transformers wrapper checks
    every id in Python on each call: ~4x the cost of the decode, and two decodes per token per
    request (measured: 1.6 ms of a 1.65 ms batch-8 engine step with an instant model)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return tokenizer


class Engine:
    """A running engine (implements trnrt.engine.client.EngineClient).

    Build it with `Engine.from_model_dir(...)`; `submit()`, `abort()`, `stats()` and `shutdown()`
    are thread-safe.
    """

    def __init__(self, runner: ModelRunner, tokenizer, model_info: ModelInfo, engine_config: EngineConfig,
                 scheduler_config: SchedulerConfig, *, start: bool = True, stream_interval: int = 1):
        from trnrt.stats import StatsCollector  # pure Python

        if not isinstance(stream_interval, int) or isinstance(stream_interval, bool) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval

        self.runner = runner
        self.tokenizer = tokenizer
        self._decoder = fast_decoder(tokenizer)
        self.model_info = model_info
        self.engine_config = engine_config
        self.scheduler_config = scheduler_config
        self.cache = CacheManager(engine_config.num_blocks, engine_config.block_size, engine_config.num_slots)
        self.scheduler = Scheduler(scheduler_config, self.cache, eos_token_ids=model_info.eos_token_ids)
        self.stats_collector = StatsCollector()
        self.stats_collector.set_engine_info(
            model_info.model_path, preset=model_info.preset, backend=model_info.backend,
            compiled=model_info.compiled, served_model_name=model_info.served_model_name,
        )
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, OutputStream] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._sent_tokens: dict[str, int] = {}
        self._accepting = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.num_steps = 0
        self.thread = threading.Thread(target=self._run, name="trnrt-engine", daemon=True)
        if start:
            self.thread.start()

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | os.PathLike | None = None,
        *,
        engine_config: EngineConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        served_model_name: str | None = None,
        device: str = "cpu",
        compiled_loader=None,
        compiled_backend: str = "cpu",
        preset: str | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        start: bool = True,
        stream_interval: int = 1,
    ) -> "Engine":
        """Load the checkpoint (None: the embedded tiny model) and start the engine thread.

        `preset` (a presets/*.toml name or path) gives the EngineConfig when `engine_config` is not
        passed. `max_running_requests` (SGLang's flag) sizes the slot pool and max_num_seqs;
        `context_length` caps max_model_len.

        compiled_loader(model, state, engine_config) -> {GraphSpec: callable} runs compiled graphs
        (the CLI passes trnrt.compile.load_compiled; the engine layer never imports compile). The
        cache sizes and max_model_len are graph inputs then, so they stay the preset's:
        max_running_requests only caps max_num_seqs at the preset's slots, and context_length only
        caps the scheduler's max_model_len.

        stream_interval (SGLang's --stream-interval): a streamed request (GenerateRequest.stream)
        gets an output every `stream_interval` tokens (merged), and its final one; a non-streamed
        request gets its final output only.
        """
        import torch
        from transformers import AutoTokenizer

        from trnrt.models.glm5_next.state import ModelState
        from trnrt.models.glm5_next.weights import load_model
        from trnrt.models.paths import resolve_model_dir

        path = resolve_model_dir(model_dir)
        if engine_config is None:
            from trnrt.config.presets import load_preset

            engine_config = load_preset(preset or "default")
        ecfg = engine_config
        if context_length is not None and compiled_loader is None:
            ecfg = ecfg.replace(max_model_len=context_length)
        if max_running_requests is not None and compiled_loader is not None:
            if max_running_requests > ecfg.num_slots - 1:
                log.warning("compiled graphs hold %d slots: running at most %d requests, not %d",
                            ecfg.num_slots - 1, ecfg.num_slots - 1, max_running_requests)
                max_running_requests = ecfg.num_slots - 1
        elif max_running_requests is not None:
            blocks_per_seq = ecfg.max_blocks_per_seq
            ecfg = ecfg.replace(
                num_slots=max_running_requests + 1,
                # enough pages for every running request at a quarter of the context, and at
                # least one full-length request (preemption always makes progress)
                num_blocks=max(ecfg.num_blocks, blocks_per_seq * max(1, max_running_requests // 4) + 1,
                               blocks_per_seq + 1),
            )
        dtype = getattr(torch, ecfg.dtype)
        model = load_model(path, dtype=dtype, device=device)
        mcfg = model.config
        max_model_len = min(ecfg.max_model_len, ecfg.max_blocks_per_seq * ecfg.block_size)
        if context_length is not None:
            max_model_len = min(max_model_len, context_length)
        scfg = scheduler_config or SchedulerConfig(
            max_num_seqs=max_running_requests or min(ecfg.max_decode_batch, ecfg.num_slots - 1),
            max_num_batched_tokens=max(ecfg.max_prefill_tokens, ecfg.max_decode_batch),
            max_model_len=max_model_len,
            max_prefill_chunk_tokens=ecfg.max_prefill_tokens,
        )
        if scfg.max_num_seqs > ecfg.num_slots - 1:
            raise ValueError(f"max_num_seqs {scfg.max_num_seqs} exceeds the {ecfg.num_slots - 1} usable slots")
        state = ModelState.allocate(mcfg, ecfg.num_blocks, ecfg.block_size, ecfg.num_slots, dtype, device)
        compiled = compiled_loader(model, state, ecfg) if compiled_loader is not None else None
        runner = ModelRunner(model, state, ecfg, mcfg.vocab_size, compiled=compiled)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if served_model_name is None:
            from trnrt.models.tiny import default_model_dir

            # SGLang and vLLM name a model after the --model string; the embedded checkpoint
            # gets a stable name instead of its content-hashed cache directory.
            is_default = model_dir is None or path.resolve() == default_model_dir().resolve()
            served_model_name = DEFAULT_SERVED_MODEL_NAME if is_default else str(model_dir)
        info = ModelInfo(
            model_path=str(path),
            served_model_name=served_model_name,
            vocab_size=mcfg.vocab_size,
            max_model_len=scfg.max_model_len,
            eos_token_ids=read_eos_token_ids(path, tokenizer),
            preset=ecfg.preset,
            backend=compiled_backend if compiled else "eager",
            compiled=bool(compiled),
        )
        return cls(runner, tokenizer, info, ecfg, scfg, start=start, stream_interval=stream_interval)

    # -- client API (any thread) -----------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> OutputStream:
        """Queue a request. Raises InvalidRequestError naming the field if it can never run."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[GenerateRequest]) -> list[OutputStream]:
        """Validate every request first, then queue them together (one inbox item, so the engine
        thread admits them in the same step). Nothing is queued if any request is invalid."""
        for request in requests:
            self._prepare(request)
        # A non-streamed request's client waits for the final output only: not waking it every
        # step keeps its thread off the GIL while the engine runs (trnrt.engine.stream).
        streams = [OutputStream(r.request_id, self.stream_interval if r.stream else 0) for r in requests]
        self._inbox.put(("add_many", list(zip(requests, streams)), None))
        self._wake.set()
        return streams

    def _prepare(self, request: GenerateRequest) -> None:
        if not self._accepting or not self.thread.is_alive():
            raise EngineDeadError("the engine is not accepting requests (shutting down)")
        vocab = self.model_info.vocab_size
        for t in request.prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < vocab):
                raise InvalidRequestError(
                    f"prompt_token_ids contains {t!r}, outside the vocabulary [0, {vocab})", field="prompt_token_ids"
                )
        request.sampling_params.validate(vocab_size=vocab)
        self.scheduler.validate_request(request)  # reads only immutable config
        if request.sampling_params.seed is None:
            # Unseeded requests still get a per-request seed: the in-graph sampler keys its noise
            # on (seed, position), so even random sampling is independent of batch composition.
            request.sampling_params = request.sampling_params.clone(seed=int.from_bytes(os.urandom(8), "little") & _SEED_MASK)
        if request.arrival_time_s is None:
            request.arrival_time_s = time.monotonic()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    def stats(self) -> dict:
        return self.stats_collector.snapshot()

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting, let in-flight requests run up to drain_timeout_s, abort the rest, join."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, drain_timeout_s)
        while time.monotonic() < deadline and (self._streams or not self._inbox.empty()) and self.thread.is_alive():
            time.sleep(0.01)
        self._inbox.put(("abort_all", "server shutting down", None))
        self._wake.set()
        t_end = time.monotonic() + 10
        while self._streams and self.thread.is_alive() and time.monotonic() < t_end:
            time.sleep(0.005)
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        import torch

        # The whole thread in inference mode (the runner then skips entering it every step).
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                if not self.scheduler.has_unfinished_requests():
                    self._update_live()
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self.step()
            except Exception:  # never let the engine thread die; fail what was in flight
                log.exception("engine step failed; aborting in-flight requests")
                for rid in list(self._streams):
                    self._abort(rid, "internal engine error", finish_type="error")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add_many":
                for request, req_stream in payload:
                    self._add(request, req_stream)
            elif kind == "abort":
                self._abort(payload, "aborted by client")
            elif kind == "abort_all":
                for rid in list(self._streams):
                    self._abort(rid, payload)

    def _add(self, request: GenerateRequest, stream: OutputStream) -> None:
        rid = request.request_id
        try:
            seq = self.scheduler.add_request(request)
        except InvalidRequestError as e:
            stream.put(RequestOutput(rid, finished=True, finish_reason=FinishReason("abort", message=str(e)), error=str(e)))
            return
        # Stamp the arrival at submit() (arrival_time_s, time.monotonic like the collector's clock),
        # not now: a request submitted mid-step waited in the inbox, and TTFT/queue/E2E include that.
        self.stats_collector.on_request_arrived(rid, len(request.prompt_token_ids), now=request.arrival_time_s)
        if seq.is_finished:  # max_new_tokens == 0
            stream.put(RequestOutput(rid, finished=True, finish_reason=seq.finish_reason,
                                     num_prompt_tokens=seq.num_prompt_tokens))
            self.stats_collector.on_request_finished(rid, seq.finish_reason.type)
            return
        sp = request.sampling_params
        self._streams[rid] = stream
        self._detoks[rid] = IncrementalDetokenizer(
            self._decoder, request.prompt_token_ids, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
            # nobody reads a non-streamed request's text before it ends: decode it once, at the end
            deferred=not request.stream and not any(sp.stop),
        )

    def _abort(self, rid: str, message: str, finish_type: str = "abort") -> None:
        seq = self.scheduler.abort(rid, message)
        stream = self._streams.pop(rid, None)
        detok = self._detoks.pop(rid, None)
        if stream is None:
            return
        # a deferred detokenizer has emitted nothing yet: the text so far goes with the abort
        text = detok.flush() if detok is not None and detok.deferred else ""
        n_out = seq.num_output_tokens if seq is not None else 0
        n_prompt = seq.num_prompt_tokens if seq is not None else 0
        stream.put(RequestOutput(
            rid, new_text=text, finished=True, finish_reason=FinishReason("abort", message=message),
            num_prompt_tokens=n_prompt, num_output_tokens=n_out,
            error=message if finish_type == "error" else None,
        ))
        self.stats_collector.on_request_finished(rid, finish_type)

    def step(self) -> None:
        """One scheduler step: schedule, run the model, emit outputs."""
        sched_out = self.scheduler.schedule()
        self.num_steps += 1
        if sched_out.is_empty:
            self._update_live()
            return
        for s in sched_out.scheduled:
            if s.is_prefill:  # only a prefill chunk can be a request's first service (queue time)
                self.stats_collector.on_request_scheduled(s.request_id)
        for rid in sched_out.preempted_request_ids:
            self.stats_collector.on_request_preempted(rid)
        runner_out = self._execute(sched_out)
        now = time.monotonic()
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        self.stats_collector.on_tokens_many(
            [(u.request_id, len(u.new_token_ids)) for u in updates if u.error is None and u.new_token_ids], now=now)
        for u in updates:
            self._emit(u, now)
        self._update_live()

    def _execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        rows = []
        for s in sched_out.scheduled:
            sp = s.sampling_params
            rows.append(RowInput(
                token_ids=s.token_ids, start_pos=s.num_computed_tokens, block_ids=s.block_table, slot_id=s.slot_id,
                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed or 0,
                num_logprobs=sp.logprobs,
            ))
        try:
            results = self.runner.execute(rows)
        except Exception as e:  # the step failed: fail the requests in it, keep serving the rest
            log.exception("model step failed")
            msg = f"model step failed: {type(e).__name__}: {e}"
            return RunnerOutput(sampled_token_ids=[None] * len(rows), logprobs=None,
                                failed={s.request_id: msg for s in sched_out.scheduled})
        sampled = [r.token_id if s.do_sample else None for s, r in zip(sched_out.scheduled, results)]
        logprobs = [r.logprob if s.do_sample else None for s, r in zip(sched_out.scheduled, results)]
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _emit(self, u, now: float) -> None:
        rid = u.request_id
        stream = self._streams.get(rid)
        detok = self._detoks.get(rid)
        if stream is None or detok is None:
            return
        if u.error is not None:
            self._streams.pop(rid, None)
            self._detoks.pop(rid, None)
            text = detok.flush() if detok.deferred else ""
            stream.put(RequestOutput(rid, new_text=text, finished=True,
                                     finish_reason=FinishReason("abort", message=u.error),
                                     error=u.error, num_prompt_tokens=u.seq.num_prompt_tokens,
                                     num_output_tokens=u.seq.num_output_tokens))
            self.stats_collector.on_request_finished(rid, "error")
            return
        text = detok.step(u.new_token_ids, exclude_last=is_token_stop(u.finish_reason))
        reason = StopChecker.merge(u.finish_reason, detok.matched_stop)
        if reason is not None and not u.finished:  # a stop string ended a live request
            self.scheduler.finish_request(rid, reason)
        if reason is not None:
            text += detok.flush()
        seq = u.seq
        out = RequestOutput(
            rid, new_token_ids=list(u.new_token_ids), new_text=text,
            new_logprobs=list(u.new_logprobs) if seq.sampling_params.logprobs is not None else None,
            finished=reason is not None, finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
        )
        stream.put(out)
        if reason is not None:
            self._streams.pop(rid, None)
            self._detoks.pop(rid, None)
            self.stats_collector.on_request_finished(rid, reason.type)

    def _update_live(self) -> None:
        c = self.cache
        tokens_in_flight = sum(s.num_tokens for s in self.scheduler.running)
        self.stats_collector.set_live(
            running=self.scheduler.num_running, queued=self.scheduler.num_waiting,
            pages_used=c.num_used_blocks, pages_total=c.num_usable_blocks,
            slots_used=c.num_used_slots, slots_total=c.num_usable_slots, tokens_in_flight=tokens_in_flight,
        )
