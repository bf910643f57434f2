"""The admin calls of an engine (abort, abort by prefix / all, flush cache, load, server info,
stats, shutdown), the inbox plumbing they and `submit` post through, and their handlers on the
engine thread.

AdminMixin is one of the mixins of trnrt.engine.core.engine.Engine.

Any thread (the client calls, `_post`, `_ask`): reads the immutable configs (`engine_config`,
`scheduler_config`, `model_info`, `prefix_cache_config`, `speculative_config`, `stream_interval`,
`startup_time_s`), `thread`, `_live_ids` (under `_live_lock`), the published `_load` and
`_gen_rate`, `stats_collector`; writes `_inbox` / `_wake` (a message for the engine thread),
`_accepting` and `_stop` (shutdown). A synchronous call waits on the message's Reply.

Engine thread (`_abort`, `_on_abort_matching`, `_on_flush`, `_check_pending_flush`,
`_flush_caches`): the scheduler, `_streams`, `_detoks`, `_pending_flush`, `cache`, the runner's
`flush_cache`, and outputs through the output processor (`_finish_stream`, `_update_live`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

from trnrt.engine.cache.cache_manager import CacheIntegrityError
from trnrt.engine.core.client import (
    ABORT_WAITING_MESSAGE,
    FLUSH_BUSY_MESSAGE,
    FLUSH_IN_PROGRESS_MESSAGE,
    FLUSH_OK_MESSAGE,
    FLUSH_TIMEOUT_MESSAGE,
    EngineLoad,
    FlushResult,
)
from trnrt.engine.core.messages import AbortMatchingMsg, AbortMsg, FlushCacheMsg, LoadQueryMsg, Reply
from trnrt.engine.output.outputs import RequestOutput
from trnrt.engine.output.sequence import SequenceStatus
from trnrt.engine.request import FinishReason

log = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "server shutting down"
SHUTDOWN_STATUS_CODE = 503  # SGLang: a system abort carries an HTTP status (service unavailable)
# How long a synchronous call waits for the engine thread beyond its own timeout: the thread
# handles the inbox between steps, so one step (a long prefill on a big model) can delay it.
_REPLY_GRACE_S = 5.0


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value



class AdminMixin:
    """Engine's admin calls (any thread), the inbox plumbing, and their engine-thread handlers."""

    # -- client API (any thread) -----------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Abort one request by id (queued or running; a no-op otherwise). Asynchronous."""
        self._post(AbortMsg(request_id))

    def abort_requests(self, prefix: str = "", *, abort_all: bool = False, message: str = "Aborted",
                       timeout_s: float = 5.0) -> list[str]:
        """Abort every queued or running request whose id starts with `prefix`, or all with
        `abort_all` (SGLang's /abort_request); returns the aborted ids. See EngineClient."""
        if not abort_all and not prefix:
            return []  # SGLang: an empty rid without abort_all aborts nothing
        msg = AbortMatchingMsg(prefix=prefix, abort_all=abort_all, message=message,
                               waiting_message=ABORT_WAITING_MESSAGE, reply=Reply())
        return self._ask(msg, msg.reply, timeout_s, default=[])

    def flush_cache(self, timeout_s: float = 0.0) -> FlushResult:
        """Empty the caches if the engine is idle (SGLang's /flush_cache); see EngineClient.

        The caches today: the cache manager's free lists (reset to their initial order) and any
        per-request runner state; the prefix cache will join them.
        """
        timeout_s = max(0.0, float(timeout_s))
        if timeout_s == 0.0 and not self.is_idle():
            return FlushResult(False, FLUSH_BUSY_MESSAGE)  # refused without waiting for a step
        if not self.thread.is_alive():
            return FlushResult(False, FLUSH_BUSY_MESSAGE)
        msg = FlushCacheMsg(deadline=time.monotonic() + timeout_s if timeout_s else None)
        if threading.current_thread() is self.thread:
            self._on_flush(msg)
            self._check_pending_flush()
            return msg.reply.value or FlushResult(False, FLUSH_BUSY_MESSAGE)
        self._post(msg)
        # The engine thread answers a deferred flush at its deadline, between steps; if a step is
        # still running then, answer for it (the first answer wins, and the engine thread does not
        # flush once the reply is answered). An immediate flush waits for the engine thread to
        # take the message (it was idle a moment ago, but a step may have started since).
        if not msg.reply.wait(timeout_s + 0.25 if timeout_s else _REPLY_GRACE_S):
            msg.reply.set(FlushResult(False, FLUSH_TIMEOUT_MESSAGE if timeout_s else FLUSH_BUSY_MESSAGE))
        return msg.reply.value

    def load(self, *, fresh: bool = False, timeout_s: float = 1.0) -> EngineLoad:
        """The engine's load, as published after the last step (never waits for the engine thread).

        fresh=True asks the engine thread instead (after every earlier message: e.g. counts a
        request submitted just before), waiting up to `timeout_s`, else the published load.
        """
        base = self._load
        if fresh:
            msg = LoadQueryMsg()
            base = self._ask(msg, msg.reply, timeout_s, default=None) or self._load
        with self._live_lock:
            pending = len(self._live_ids)
        return base.replace(num_pending_reqs=pending, gen_throughput=self._gen_rate.rate())

    def server_info(self) -> dict:
        """The resolved settings (pure data from the immutable config; callable from any thread):
        SGLang's /server_info names at the top level, the full configs under `engine_config` and
        `scheduler_config`."""
        ecfg, scfg, info, cache = self.engine_config, self.scheduler_config, self.model_info, self.cache
        ecfg_d = {f.name: _jsonable(getattr(ecfg, f.name)) for f in dataclasses.fields(ecfg)}
        ecfg_d["compiler_args"] = {b: json.loads(a) for b, a in ecfg.compiler_args}
        return {
            "model_path": info.model_path,
            "served_model_name": info.served_model_name,
            "preset": info.preset,
            "backend": info.backend,
            "compiled": info.compiled,
            "vocab_size": info.vocab_size,
            "eos_token_ids": list(info.eos_token_ids),
            "context_length": scfg.max_model_len,
            "max_req_input_len": scfg.max_model_len - 1,
            "max_total_num_tokens": cache.num_usable_blocks * cache.block_size,
            "page_size": cache.block_size,
            "max_running_requests": scfg.max_num_seqs,
            "max_prefill_tokens": scfg.max_num_batched_tokens,
            "chunked_prefill_size": scfg.max_prefill_tokens if scfg.chunked_prefill else -1,
            "stream_interval": self.stream_interval,
            "startup_time": self.startup_time_s,
            "engine_config": ecfg_d,
            "scheduler_config": {f.name: _jsonable(getattr(scfg, f.name)) for f in dataclasses.fields(scfg)},
            "disable_radix_cache": self.prefix_cache is None,
            "prefix_cache": self._prefix_cache_info(),
            # SGLang's names (None: off); speculative requests bypass the prefix cache
            **self._speculative_info(),
        }

    def _speculative_info(self) -> dict:
        spec = self.speculative_config
        if spec is None:
            return {"speculative_algorithm": None, "speculative_num_steps": None, "speculative_eagle_topk": None,
                    "speculative_num_draft_tokens": None, "speculative_min_accept_length": None}
        return {"speculative_algorithm": spec.algorithm, "speculative_num_steps": spec.num_steps,
                "speculative_eagle_topk": 1, "speculative_num_draft_tokens": spec.num_draft_tokens,
                "speculative_min_accept_length": spec.min_accept_length}

    def _prefix_cache_info(self) -> dict | None:
        pcc = self.prefix_cache_config
        if self.prefix_cache is None or pcc is None:
            return None
        d = {f.name: _jsonable(getattr(pcc, f.name)) for f in dataclasses.fields(pcc)}
        d["checkpoint_interval"] = self.scheduler.checkpoint_interval
        d["num_checkpoints"] = self.prefix_cache.checkpoints.size
        return d

    def is_idle(self) -> bool:
        """Nothing queued, running, or submitted and not yet taken from the inbox."""
        with self._live_lock:
            return not self._live_ids

    def stats(self) -> dict:
        """The /v1/stats document (trnrt.stats schema)."""
        return self.stats_collector.snapshot()

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting, let in-flight requests run up to drain_timeout_s, abort the rest
        ("server shutting down", status 503), join the engine thread."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, drain_timeout_s)
        while time.monotonic() < deadline and not self.is_idle() and self.thread.is_alive():
            time.sleep(0.01)
        if self.thread.is_alive():
            msg = AbortMatchingMsg(abort_all=True, message=SHUTDOWN_MESSAGE, status_code=SHUTDOWN_STATUS_CODE,
                                   reply=Reply())
            self._ask(msg, msg.reply, 10.0, default=[])
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)

    # -- inbox plumbing (client side) -------------------------------------------------------------

    def _post(self, msg) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _ask(self, msg, reply: Reply, timeout_s: float, default):
        """Post `msg` and wait up to timeout_s for the engine thread's answer. If it did not take
        the message in time, withdraw it (so it has no effect) and return `default`."""
        if threading.current_thread() is self.thread:
            self._handle(msg)  # called from the engine thread itself (a hook): answer inline
            return reply.value if reply.value is not None else default
        if not self.thread.is_alive():
            return default
        self._post(msg)
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not reply.wait(0.05):
            if time.monotonic() >= deadline or not self.thread.is_alive():
                if reply.cancel():
                    log.warning("engine thread did not take %s within %.1f s", type(msg).__name__, timeout_s)
                    return default
                # Claimed: the engine thread is acting on it right now; the answer is moments away.
                reply.wait(_REPLY_GRACE_S)
                break
        return reply.value if reply.value is not None else default

    # -- aborts (engine thread) -------------------------------------------------------------------

    def _abort(self, rid: str, message: str, finish_type: str = "abort", status_code: int | None = None) -> None:
        seq = self.scheduler.abort(rid, message)
        stream = self._streams.pop(rid, None)
        detok = self._detoks.pop(rid, None)
        if stream is None:
            if seq is not None:
                self._release_runner(rid)
            return
        # a deferred detokenizer has emitted nothing yet: the text so far goes with the abort
        text = detok.flush() if detok is not None and detok.deferred else ""
        n_out = seq.num_output_tokens if seq is not None else 0
        n_prompt = seq.num_prompt_tokens if seq is not None else 0
        self.stats_collector.on_request_finished(rid, finish_type)
        self._finish_stream(rid, stream, RequestOutput(
            rid, new_text=text, finished=True,
            finish_reason=FinishReason("abort", message=message, status_code=status_code),
            num_prompt_tokens=n_prompt, num_output_tokens=n_out,
            error=message if finish_type == "error" else None,
        ))

    def _on_abort_matching(self, msg: AbortMatchingMsg) -> None:
        if msg.reply is not None and not msg.reply.claim():
            return  # the caller gave up before the engine got here: abort nothing
        aborted = []
        for rid in list(self._streams):
            if not msg.matches(rid):
                continue
            seq = self.scheduler.get_sequence(rid)
            waiting = seq is None or seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            text = msg.waiting_message if waiting and msg.waiting_message is not None else msg.message
            self._abort(rid, text, status_code=msg.status_code)
            aborted.append(rid)
        if aborted:
            self._update_live()
        if msg.reply is not None:
            msg.reply.set(aborted)

    # -- flush ------------------------------------------------------------------------------------

    def _is_idle_here(self) -> bool:
        """Engine thread: nothing in the scheduler and nothing submitted still to come."""
        return not self.scheduler.has_unfinished_requests() and not self._streams and self.is_idle()

    def _on_flush(self, msg: FlushCacheMsg) -> None:
        if not msg.reply.claim():
            return
        if self._is_idle_here():
            msg.reply.set(self._flush_caches())
        elif msg.deadline is None:
            msg.reply.set(FlushResult(False, FLUSH_BUSY_MESSAGE))
        elif self._pending_flush is not None and not self._pending_flush.reply.done:
            msg.reply.set(FlushResult(False, FLUSH_IN_PROGRESS_MESSAGE))
        else:
            # SGLang does not pause admission while a flush waits: it runs when the work drains.
            self._pending_flush = msg

    def _check_pending_flush(self) -> None:
        msg = self._pending_flush
        if msg is None:
            return
        if msg.reply.done:  # the caller gave up and answered itself
            self._pending_flush = None
        elif self._is_idle_here():
            self._pending_flush = None
            msg.reply.set(self._flush_caches())
        elif time.monotonic() >= msg.deadline:
            self._pending_flush = None
            msg.reply.set(FlushResult(False, FLUSH_TIMEOUT_MESSAGE))

    def _flush_caches(self) -> FlushResult:
        """Engine thread, idle: empty every cache (today the allocator's free lists and the runner's
        per-request state; the prefix cache joins here). Cumulative stats counters are not reset:
        Prometheus counters only go up."""
        try:
            self.scheduler.flush_prefix_cache()
            self.cache.reset()
        except CacheIntegrityError:  # a page or slot still held at idle: a leak, not a cache
            log.exception("cache flush refused: the allocator's books do not balance at idle")
            return FlushResult(False, FLUSH_BUSY_MESSAGE)
        flush = getattr(self.runner, "flush_cache", None)
        if flush is not None:
            flush()
        self._update_live()
        log.info("cache flushed")
        return FlushResult(True, FLUSH_OK_MESSAGE)
