"""Output fan-out: a step's updates become RequestOutputs on the requests' streams (incremental
detokenization, stop strings, grammar ends), finished requests are released, and the live stats and
the EngineLoad other threads read are published.

OutputProcessorMixin is one of the mixins of trnrt.engine.core.engine.Engine. Engine thread: reads
and writes `_streams`, `_detoks`, `_finished_out`, the per-request maps (`_grammars`,
`_penalties`, `_thinking`, `_prompt_lps`), the scheduler (`finish_request`) and `stats_collector`;
calls `runner.release` and `spec_policy.forget` for a finished request. For other threads it
writes `_live_ids` (under `_live_lock`) and `_load` (one reference assignment), and `_gen_rate`
(a TokenRate, locked) is read by `load()`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from trnrt.engine.core.client import EngineLoad
from trnrt.engine.output.outputs import RequestOutput
from trnrt.engine.output.stop import StopChecker, is_token_stop
from trnrt.engine.output.stream import OutputStream
from trnrt.engine.request import FinishReason

log = logging.getLogger(__name__)

GEN_THROUGHPUT_WINDOW_S = 60.0  # load().gen_throughput: output tok/s over the last minute (stats' "1m" rate)


class TokenRate:
    """Output tokens per second over the last `window_s` seconds, in 1 s buckets. The engine
    thread adds, any thread reads. (Reading the stats collector's windows instead would build its
    whole snapshot, ~2 ms with full latency windows, on every load() poll.)"""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self._buckets: collections.deque[list[int]] = collections.deque()  # [second, tokens]

    def add(self, n: int, now: float) -> None:
        sec = int(now)
        with self._lock:
            b = self._buckets
            if b and b[-1][0] == sec:
                b[-1][1] += n
            else:
                b.append([sec, n])
            while b[0][0] <= sec - self.window_s:
                b.popleft()

    def rate(self) -> float:
        now = self._clock()
        with self._lock:
            total = sum(n for sec, n in self._buckets if sec > now - self.window_s)
        span = min(self.window_s, now - self._start)
        return total / span if span > 0 else 0.0



class OutputProcessorMixin:
    """Engine's output fan-out and published state."""

    # -- outputs (engine thread) ------------------------------------------------------------------

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
            self.stats_collector.on_request_finished(rid, "error")
            self._finish_stream(rid, stream, RequestOutput(
                rid, new_text=text, finished=True, finish_reason=FinishReason("abort", message=u.error),
                error=u.error, num_prompt_tokens=u.seq.num_prompt_tokens, num_output_tokens=u.seq.num_output_tokens))
            return
        if self._penalties or self._thinking:
            self._advance_states(rid, u.new_token_ids)
        text = detok.step(u.new_token_ids, exclude_last=is_token_stop(u.finish_reason))
        reason = StopChecker.merge(u.finish_reason, detok.matched_stop)
        if reason is None and self._grammars:
            reason = self._grammar_advance(rid, u.new_token_ids)
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
            num_cached_tokens=seq.num_cached_tokens, num_cached_tokens_host=seq.num_cached_tokens_host,
        )
        if self._prompt_lps:
            col = self._prompt_lps.pop(rid, None)
            if col is not None:  # the first output after the prompt: every position was scored
                col.delivered = True
                out.prompt_logprobs = col.entries()
        if reason is None:
            stream.put(out)
            return
        self._streams.pop(rid, None)
        self._detoks.pop(rid, None)
        self.stats_collector.on_request_finished(rid, reason.type, num_cached_tokens=seq.num_cached_tokens)
        self._finish_stream(rid, stream, out)

    def _grammar_advance(self, rid: str, token_ids: list[int]) -> FinishReason | None:
        """Accept a request's new tokens in its matcher and fill the next mask; a "stop" when the
        grammar cannot go on (a dead end: no token allowed; or a token it rejects) instead of
        sampling from an all -inf row next step."""
        state = self._grammars.get(rid)
        if state is None:
            return None
        for t in token_ids:
            if not state.accept(t):
                log.warning("request %s: the grammar rejected sampled token %d; ending it", rid, t)
                return FinishReason("stop")
        state.next_mask()
        return FinishReason("stop") if state.dead else None

    def _advance_states(self, rid: str, token_ids: list[int]) -> None:
        """Count a request's new tokens in its penalty state and thinking budget."""
        p = self._penalties.get(rid)
        if p is not None:
            p.add(token_ids)
        t = self._thinking.get(rid)
        if t is not None:
            t.advance(token_ids)

    def _finish_stream(self, rid: str, stream: OutputStream, output: RequestOutput) -> None:
        """Put a request's finished output on its stream; every finish goes through here.

        The id leaves the live set first: a client that reads the finish and resubmits the same
        id at once must be accepted. The runner forgets the request too.
        """
        with self._live_lock:
            self._live_ids.discard(rid)
        self._release_runner(rid)
        # Delivered once the live stats no longer count it (`_update_live`): a client that reads
        # the finish and then /v1/stats sees the request gone and its pages free.
        self._finished_out.append((stream, output))

    def _deliver_finished(self) -> None:
        """Engine thread: put the finished outputs held by `_finish_stream` on their streams."""
        done, self._finished_out = self._finished_out, []
        for stream, output in done:
            stream.put(output)

    def _release_runner(self, rid: str) -> None:
        if self.spec_policy is not None:
            self.spec_policy.forget(rid)
        self._grammars.pop(rid, None)
        self._prompt_lps.pop(rid, None)
        self._penalties.pop(rid, None)
        self._thinking.pop(rid, None)
        release = getattr(self.runner, "release", None)
        if release is not None:
            release([rid])

    # -- published state (read by any thread) -----------------------------------------------------

    def _update_live(self, publish_load: bool = True) -> None:
        c = self.cache
        tokens_in_flight = sum(s.num_tokens for s in self.scheduler.running)
        self.stats_collector.set_live(
            running=self.scheduler.num_running, queued=self.scheduler.num_waiting,
            pages_used=self._used_pages(), pages_total=c.num_usable_blocks,
            slots_used=c.num_used_slots, slots_total=c.num_usable_slots, tokens_in_flight=tokens_in_flight,
        )
        if publish_load:
            self._publish_load()
        self._deliver_finished()

    def _publish_load(self) -> None:
        # One reference assignment: a reader on another thread sees the old or the new load, whole.
        self._load = self._compute_load()

    def _compute_load(self) -> EngineLoad:
        """Engine thread: the EngineLoad of this moment (gen_throughput and num_pending_reqs are
        filled in by `load()` on the reading thread)."""
        c, s = self.cache, self.scheduler
        page = c.block_size
        used_pages = self._used_pages()
        used_tokens = used_pages * page
        max_tokens = c.num_usable_blocks * page
        spec = self.stats_collector.spec_summary()
        return EngineLoad(
            num_running_reqs=s.num_running,
            num_waiting_reqs=s.num_waiting,
            num_used_tokens=used_tokens,
            num_total_tokens=sum(seq.num_tokens for seq in s.requests.values()),
            # what the waiting requests must prefill: their prompts (prompt + output once preempted)
            num_waiting_uncached_tokens=sum(seq.num_tokens for seq in s.waiting),
            max_total_num_tokens=max_tokens,
            max_running_requests=self.scheduler_config.max_num_seqs,
            token_usage=used_tokens / max_tokens if max_tokens else 0.0,
            num_used_pages=used_pages,
            num_total_pages=c.num_usable_blocks,
            num_used_slots=c.num_used_slots,
            num_total_slots=c.num_usable_slots,
            page_size=page,
            spec_accept_length=spec["avg_accept_length"],
            spec_accept_rate=spec["accept_rate"],
            **self._prefix_cache_load(),
        )

    def _used_pages(self) -> int:
        """Pages in use by requests. Cached pages no request holds are free for the asking (evicted
        on demand), so they count as free, as in SGLang's token usage; the cache's own gauges
        (num_cached_pages, num_evictable_pages) report them."""
        pc = self.prefix_cache
        return self.cache.num_used_blocks - (pc.evictable_pages() if pc is not None else 0)

    def _prefix_cache_load(self) -> dict:
        pc = self.prefix_cache
        if pc is None:
            return {}
        hp, hc = pc.host_pages, pc.host_checkpoints
        return dict(
            prefix_cache=True, cache_hit_rate=self.scheduler.cache_hit_rate,
            num_cached_pages=pc.num_device_pages(), num_evictable_pages=pc.evictable_pages(),
            num_used_checkpoints=pc.checkpoints.num_used, num_total_checkpoints=pc.checkpoints.size,
            num_host_used_pages=hp.num_used if hp else 0, num_host_total_pages=hp.size if hp else 0,
            num_host_used_checkpoints=hc.num_used if hc else 0, num_host_total_checkpoints=hc.size if hc else 0,
        )
