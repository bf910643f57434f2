"""The engine thread: its loop (drain the inbox, step, deliver, sleep while idle), the inbox
dispatch, the shutdown clean-up, and one step (schedule -> runner.execute -> update -> emit).

EngineLoopMixin is one of the mixins of trnrt.engine.core.engine.Engine; everything here runs on
the engine thread (`thread`), the only owner of engine state. It reads and writes the scheduler,
the cache ops of the runner, `_inbox`, `_stop`, `_wake`, `_warmed`, `warmup_s`, `num_steps`,
`_cache_poisoned`, `num_forced_think_ends`, the per-request maps (`_streams`, `_grammars`,
`_penalties`, `_thinking`, `_prompt_lps`) and `_gen_rate` / `stats_collector`; outputs go out
through the output processor (`_emit`, `_finish_stream`, `_update_live`, `_flush_turn`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time

from trnrt.engine.core.admin import SHUTDOWN_MESSAGE, SHUTDOWN_STATUS_CODE
from trnrt.engine.core.client import FLUSH_BUSY_MESSAGE, FLUSH_TIMEOUT_MESSAGE, FlushResult
from trnrt.engine.core.messages import AbortMatchingMsg, AbortMsg, FlushCacheMsg, LoadQueryMsg, SubmitMsg
from trnrt.engine.output.outputs import RequestOutput, RowInput, RunnerOutput, SchedulerOutput, TokenLogprob
from trnrt.engine.request import FinishReason
from trnrt.engine.runner.threads import apply_torch_threads

log = logging.getLogger(__name__)


class EngineLoopMixin:
    """Engine's thread: the loop, the inbox dispatch and the step."""

    def _run(self) -> None:
        # torch's thread count is per Python thread once it has run torch work: set the engine
        # thread's own (trnrt.engine.runner.threads; a no-op without torch for the scripted runner).
        try:
            apply_torch_threads(getattr(self.runner, "torch_threads", None))
            # ModelRunner: the whole thread in inference mode (the runner then skips entering it
            # every step). The scripted runner needs nothing (and no torch).
            enter = getattr(self.runner, "thread_context", None)
            with enter() if enter is not None else contextlib.nullcontext():
                try:
                    self._warm_up()
                    self._loop()
                finally:
                    self._close()
        finally:
            self._warmed.set()  # whatever happened, nobody waits for a warm-up that will not come

    def _warm_up(self) -> None:
        """The runner's warm-up (every compiled graph called on padding rows, at the engine
        thread's torch threads), before the first step; a failure is logged, never fatal (the
        graphs then do their first-call work on requests, as before)."""
        warm = getattr(self.runner, "warm_up", None)
        try:
            if warm is not None and getattr(self.runner, "compiled", None):
                t0 = time.monotonic()
                times = warm()
                self.warmup_s = time.monotonic() - t0
                log.info("warm-up: %d compiled graphs called in %.2f s", len(times), self.warmup_s)
        except Exception:  # noqa: BLE001 - a warm-up is an optimisation
            log.warning("warm-up of the compiled graphs failed; serving without it", exc_info=True)
        finally:
            self._warmed.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                self._check_pending_flush()
                if not self.scheduler.has_unfinished_requests():
                    self._update_live()
                    self._flush_turn()
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self.step()
                self._check_pending_flush()
                self._flush_turn()
            except Exception:  # never let the engine thread die; fail what was in flight
                log.exception("engine step failed; aborting in-flight requests")
                for rid in list(self._streams):
                    self._abort(rid, "internal engine error", finish_type="error")
                self._flush_turn()

    def _flush_turn(self) -> None:
        self._deliver_finished()
        if self.flush_outputs is not None:
            self.flush_outputs()

    def _close(self) -> None:
        """The loop ended (shutdown): end every stream still open and answer every question still
        in the inbox, so no client thread waits forever on a stopped engine."""
        try:
            self._accepting = False
            for rid in list(self._streams):
                self._abort(rid, SHUTDOWN_MESSAGE, status_code=SHUTDOWN_STATUS_CODE)
            while True:
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, SubmitMsg):
                    reason = FinishReason("abort", message=SHUTDOWN_MESSAGE, status_code=SHUTDOWN_STATUS_CODE)
                    for request, stream in zip(msg.requests, msg.streams):
                        self._finish_stream(request.request_id, stream, RequestOutput(
                            request.request_id, finished=True, finish_reason=reason,
                            num_prompt_tokens=len(request.prompt_token_ids)))
                elif isinstance(msg, AbortMatchingMsg) and msg.reply is not None:
                    msg.reply.set([])
                elif isinstance(msg, FlushCacheMsg):
                    msg.reply.set(FlushResult(False, FLUSH_BUSY_MESSAGE))
                elif isinstance(msg, LoadQueryMsg):
                    msg.reply.set(self._compute_load())
            if self._pending_flush is not None:
                self._pending_flush.reply.set(FlushResult(False, FLUSH_TIMEOUT_MESSAGE))
                self._pending_flush = None
            self._update_live()
            self._flush_turn()
        except Exception:  # best effort at exit
            log.exception("engine shutdown cleanup failed")
        close = getattr(self.runner, "close", None)  # the tensor-parallel ranks stop with the engine thread
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("closing the runner failed")

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, SubmitMsg):
            for request, stream in zip(msg.requests, msg.streams):
                try:
                    self._add(request, stream)
                except Exception as e:  # one bad request must not strand the rest of its batch
                    log.exception("could not add request %s", request.request_id)
                    message = f"internal engine error: {type(e).__name__}: {e}"
                    if request.request_id in self._streams:
                        self._abort(request.request_id, message, finish_type="error")
                    else:  # failed before it was tracked
                        self.scheduler.abort(request.request_id, message)
                        self._finish_stream(request.request_id, stream, RequestOutput(
                            request.request_id, finished=True, error=message,
                            finish_reason=FinishReason("abort", message=message)))
        elif isinstance(msg, AbortMsg):
            self._abort(msg.request_id, msg.message)
        elif isinstance(msg, AbortMatchingMsg):
            self._on_abort_matching(msg)
        elif isinstance(msg, FlushCacheMsg):
            self._on_flush(msg)
        elif isinstance(msg, LoadQueryMsg):
            if msg.reply.claim():
                msg.reply.set(self._compute_load())
        else:
            log.error("engine inbox: unknown message %r", msg)

    # -- steps ------------------------------------------------------------------------------------

    def step(self) -> None:
        """One scheduler step: schedule, run the model, emit outputs."""
        sched_out = self.scheduler.schedule()
        self.num_steps += 1
        if sched_out.is_empty:
            if sched_out.cache_ops:  # tier copies queued by the last update (write-through)
                self._apply_cache_ops(sched_out.cache_ops)
            self._update_live()
            return
        # What runs now (admissions, pages just allocated) is the load for the whole step: publish
        # it before a step that may take long, for the router polling load().
        self._publish_load()
        for s in sched_out.scheduled:
            if s.is_prefill:  # only a prefill chunk can be a request's first service (queue time)
                self.stats_collector.on_request_scheduled(s.request_id)
        for rid in sched_out.preempted_request_ids:
            self.stats_collector.on_request_preempted(rid)
        runner_out = self._execute(sched_out)
        now = time.monotonic()
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        if self._cache_poisoned:
            self._cache_poisoned = False
            log.error("prefix cache copy failed: dropping every cached prefix no request is using")
            self.prefix_cache.invalidate()
        produced = [(u.request_id, len(u.new_token_ids)) for u in updates if u.error is None and u.new_token_ids]
        self.stats_collector.on_tokens_many(produced, now=now)
        if produced:
            self._gen_rate.add(sum(n for _, n in produced), now)
        for u in updates:
            self._emit(u, now)
        # The load is published before the next step (or when the engine goes idle): once per
        # step is enough, and it walks every live request.
        self._update_live(publish_load=False)

    def _execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        if sched_out.cache_ops and not self._apply_cache_ops(sched_out.cache_ops):
            self._cache_poisoned = True  # invalidated after this step's requests are released
            msg = "prefix cache copy failed"
            return RunnerOutput(sampled_token_ids=[None] * len(sched_out.scheduled), logprobs=None,
                                failed={s.request_id: msg for s in sched_out.scheduled})
        rows = []
        for s in sched_out.scheduled:
            sp = s.sampling_params
            rows.append(RowInput(
                token_ids=s.token_ids, start_pos=s.num_computed_tokens, block_ids=s.block_table, slot_id=s.slot_id,
                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed or 0,
                num_logprobs=sp.logprobs, request_id=s.request_id, do_sample=s.do_sample,
                token_bitmask=self._grammar_mask(s.request_id) if s.do_sample and self._grammars else None,
                penalties=self._penalties.get(s.request_id) if s.do_sample and self._penalties else None,
                speculative=s.speculative, spec_decode=s.speculative and not s.is_prefill,
                num_lookahead=s.num_lookahead, next_token_id=s.next_token_id,
            ))
            if self._prompt_lps and s.is_prefill:
                col = self._prompt_lps.get(s.request_id)
                if col is not None:
                    rows[-1].prompt_next_ids = col.next_ids(s.num_computed_tokens, len(s.token_ids))
                    rows[-1].num_prompt_logprobs = col.num_top
        try:
            results = self.runner.execute(rows)
        except Exception as e:  # the step failed: fail the requests in it, keep serving the rest
            log.exception("model step failed")
            msg = f"model step failed: {type(e).__name__}: {e}"
            return RunnerOutput(sampled_token_ids=[None] * len(rows), logprobs=None,
                                failed={s.request_id: msg for s in sched_out.scheduled})
        if sched_out.snapshot_ops and not self._apply_cache_ops(sched_out.snapshot_ops):
            # a checkpoint that may be wrong must not be cached: fail the rows that took one
            snap = {s.request_id for s in sched_out.scheduled
                    if s.request_id in self.scheduler._pending_snapshots}
            for rid in snap:
                self.scheduler._drop_snapshot(rid)
        # A runner may fail single rows (RowResult.error): those requests finish with the error.
        failed = {s.request_id: r.error for s, r in zip(sched_out.scheduled, results)
                  if getattr(r, "error", None) is not None}
        if self._prompt_lps:
            for s, row, r in zip(sched_out.scheduled, rows, results):
                if row.prompt_next_ids is not None and s.request_id not in failed:
                    if r.prompt_logprobs is None or len(r.prompt_logprobs) != len(row.token_ids):
                        failed[s.request_id] = "the model runner returned no prompt logprobs"
                    else:
                        self._prompt_lps[s.request_id].record(s.num_computed_tokens, r.prompt_logprobs)
        sampled = [r.token_id if s.do_sample else None for s, r in zip(sched_out.scheduled, results)]
        logprobs = [r.logprob if s.do_sample else None for s, r in zip(sched_out.scheduled, results)]
        if self._thinking:
            self._force_think_ends(sched_out.scheduled, sampled, logprobs)
        extra = None
        if self.scheduler_config.num_speculative_tokens:
            extra = [list(getattr(r, "extra_token_ids", ())) if s.do_sample else []
                     for s, r in zip(sched_out.scheduled, results)]
            if self.spec_policy is not None:
                self._judge_speculation(sched_out.scheduled, results)
            spec = getattr(self.runner, "last_spec", None)
            if spec is not None and spec.num_verifies:
                self.stats_collector.on_spec_step(spec.num_verifies, spec.num_draft_tokens, spec.num_accepted_tokens,
                                                  spec.accepted_per_position)
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, failed=failed, extra_token_ids=extra)

    def _force_think_ends(self, scheduled, sampled: list, logprobs: list) -> None:
        """Thinking budgets: a row whose request spent its budget while reasoning gets `</think>`
        instead of the sampled token, with logprob 0.0 (a point mass; see thinking_budget)."""
        for i, s in enumerate(scheduled):
            state = self._thinking.get(s.request_id)
            if state is None or sampled[i] is None:
                continue
            forced = state.forced_token()
            if forced is None:
                continue
            self.num_forced_think_ends += 1
            sampled[i] = forced
            if logprobs[i] is not None:
                logprobs[i] = TokenLogprob(token_id=forced, logprob=0.0, top=[(forced, 0.0)])

    def _grammar_mask(self, rid: str):
        """The packed next-token mask of a request with a grammar (None: none, or not applying yet)."""
        state = self._grammars.get(rid)
        return None if state is None else state.next_mask()

    def _apply_cache_ops(self, ops) -> bool:
        """Run the prefix cache's state copies on the runner. False (logged) if they failed."""
        apply = getattr(self.runner, "apply_cache_ops", None)
        if apply is None:
            return True
        try:
            apply(ops)
            return True
        except Exception:
            log.exception("prefix cache copy failed")
            return False
