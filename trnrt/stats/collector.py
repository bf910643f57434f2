"""`StatsCollector`: the engine thread reports events, server threads read snapshots.

Producer side (engine thread, cheap calls: one uncontended lock and a few dict operations each)::

    stats = StatsCollector(engine_id="engine-0")
    stats.set_engine_info(model="glm-5.3-flash", preset="default", backend="cpu", compiled=False)
    stats.on_request_arrived(rid, num_prompt_tokens)      # admitted into the waiting queue
    stats.on_request_scheduled(rid)                        # first time it gets a slot: queue time
    stats.on_tokens(rid, n)                                # n new output tokens: TTFT, then ITL
    stats.on_request_finished(rid, "stop", num_cached_tokens=k)
    stats.set_live(running=..., queued=..., pages_used=..., ...)   # once per step
    stats.set_speculative("NEXTN", 3)                      # once at start (None: off, the default)
    stats.on_spec_step(num_verifies, num_draft_tokens, num_accepted_tokens, accepted_per_position)

Consumer side (any thread): `snapshot()` returns the /v1/stats document (trnrt.stats.schema).

Memory is bounded whatever the traffic: rates live in fixed rings of 1-second buckets over 15
minutes, latency samples in fixed-size ring buffers, and per-request bookkeeping only for requests
in flight (capped, oldest dropped, in case the engine ever forgets to report a finish).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from trnrt.stats.schema import (
    FINISH_TYPES,
    LATENCY_KEYS,
    LIVE_KEYS,
    QUANTILES,
    RATE_WINDOWS,
    SPEC_WINDOWS,
    EngineStats,
    hit_rate,
    merge_snapshots,
    spec_ratios,
    speculative_section,
)
from trnrt.stats.windows import BucketedCounter, LatencyWindow, summarize

log = logging.getLogger("trnrt.stats")


class _Req:
    """Per-request timestamps, kept only while the request is in flight."""

    __slots__ = ("arrived", "scheduled", "first_token", "first_n", "last_token", "prompt_tokens", "generated")

    def __init__(self, arrived: float, prompt_tokens: int) -> None:
        self.arrived = arrived
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.first_n = 0  # tokens in the first report
        self.last_token: float | None = None  # None until the first token: the TTFT/ITL switch
        self.prompt_tokens = prompt_tokens
        self.generated = 0


class StatsCollector:
    """Thread-safe stats for one engine: live state, counters, windowed rates, latency percentiles.

    Args:
        clock: monotonic seconds; every duration and window uses it. Tests pass a fake.
        wall_clock: unix seconds, only for `time_s` and `started_at_s` in the snapshot.
        engine_id: the row key in `engines` (a router gives each engine a distinct one).
        latency_window_s / latency_max_samples: percentiles cover the last `latency_window_s`
            seconds, at most `latency_max_samples` observations per metric (the cap keeps memory
            bounded; under heavy load it shortens the span).
        bucket_s: width of the rate buckets (1 s: a 1-minute rate is exact to within a bucket).
        max_tracked_requests: cap on in-flight bookkeeping; the oldest entry is dropped beyond it.
        recent_requests: how many finished requests `recent_requests` keeps (numbers only: token
            counts, times and the finish reason; never ids or text), newest last.

    Every producer method accepts `now` (seconds on `clock`), so the engine can stamp a whole step
    with one reading; it defaults to `clock()`.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall_clock: Callable[[], float] = time.time,
        engine_id: str = "engine-0",
        latency_window_s: float = 60.0,
        latency_max_samples: int = 2048,
        bucket_s: float = 1.0,
        max_tracked_requests: int = 65536,
        recent_requests: int = 20,
    ) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self.engine_id = engine_id
        self._lock = threading.Lock()
        self._start = clock()
        self._started_at_wall = wall_clock()
        self._max_tracked = max_tracked_requests
        self.dropped_requests = 0  # in-flight entries evicted by the cap (a bug upstream if > 0)

        horizon = max(w for w in RATE_WINDOWS.values() if w is not None)
        self._arrived = BucketedCounter(horizon, bucket_s)
        self._finished = BucketedCounter(horizon, bucket_s)
        self._prompt = BucketedCounter(horizon, bucket_s)
        self._generated = BucketedCounter(horizon, bucket_s)
        self._finish_counts = {t: 0 for t in FINISH_TYPES}
        self._cached_tokens = 0
        self._finished_prompt_tokens = 0
        self._preemptions = 0
        self._lat = {k: LatencyWindow(latency_window_s, latency_max_samples) for k in LATENCY_KEYS}
        self._reqs: dict[str, _Req] = {}
        self._live = {k: 0 for k in LIVE_KEYS}
        self._recent: deque[dict] = deque(maxlen=recent_requests)
        self._listeners: list[Callable[[dict], None]] = []
        self._sections: dict[str, Callable[[], object]] = {}
        self._info: dict = {"model": "", "served_model_name": "", "preset": "", "backend": "",
                            "compiled": False, "version": _version()}
        # Speculative decoding (set_speculative / on_spec_step); off until set_speculative.
        self._horizon, self._bucket_s = horizon, bucket_s
        self._spec_algorithm: str | None = None
        self._spec_num_steps = 0
        self._spec_ignored_warned = False
        self._spec_reset()

    def _spec_reset(self) -> None:
        # (Re)create the speculative counters: verifies, draft tokens, accepted tokens, per position.
        self._spec_verifies = BucketedCounter(self._horizon, self._bucket_s)
        self._spec_drafts = BucketedCounter(self._horizon, self._bucket_s)
        self._spec_accepted = BucketedCounter(self._horizon, self._bucket_s)
        self._spec_per_pos = [0] * self._spec_num_steps

    # ---- producer API (engine thread) -------------------------------------------------------

    def set_engine_info(
        self,
        model: str,
        *,
        preset: str = "default",
        backend: str = "cpu",
        compiled: bool = False,
        version: str | None = None,
        served_model_name: str | None = None,
        **extra: object,
    ) -> None:
        """Static facts about the engine, shown in the dashboard header. Call once at start-up.

        `extra` (JSON-able values) lands in `info["extra"]`, e.g. tp=8 or the bucket list.
        """
        info = {
            "model": model,
            "served_model_name": served_model_name or model,
            "preset": preset,
            "backend": backend,
            "compiled": bool(compiled),
            "version": version or _version(),
        }
        if extra:
            info["extra"] = dict(extra)
        with self._lock:
            self._info = info

    def set_live(self, now: float | None = None, **live: int) -> None:
        """Update the live gauges; keys not given keep their last value.

        Keys: running, queued, pages_used, pages_total, slots_used, slots_total, tokens_in_flight
        (tokens held in the KV cache by running requests). An unknown key raises TypeError so a
        typo fails in tests instead of vanishing from the dashboard. `now` is accepted for symmetry.
        """
        unknown = set(live) - set(LIVE_KEYS)
        if unknown:
            raise TypeError(f"set_live: unknown keys {sorted(unknown)}; known: {list(LIVE_KEYS)}")
        with self._lock:
            for k, v in live.items():
                self._live[k] = int(v)

    def set_speculative(self, algorithm: str | None, num_steps: int = 0) -> None:
        """Speculative decoding's configuration; the engine calls it once at start.

        `algorithm`: e.g. "NEXTN" (MTP drafts), or None for off (the default: the `speculative`
        section then reports `enabled: false` with zeros and nulls, /metrics has no spec series and
        /server_info's `avg_spec_accept_length` is null). `num_steps`: drafts proposed per verify,
        the length of `accepted_per_position` (0 when off). Calling it again starts the
        speculative counters from zero (a new configuration's numbers never mix with the old).
        Raises ValueError on an empty algorithm or a negative or non-integer `num_steps`.
        """
        if algorithm is not None and (not isinstance(algorithm, str) or not algorithm):
            raise ValueError(f"algorithm must be a non-empty string or None, got {algorithm!r}")
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 0:
            raise ValueError(f"num_steps must be an integer >= 0, got {num_steps!r}")
        with self._lock:
            self._spec_algorithm = algorithm
            self._spec_num_steps = num_steps if algorithm is not None else 0
            self._spec_reset()

    def on_spec_step(
        self,
        num_verifies: int,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        accepted_per_position: list[int] | None = None,
        now: float | None = None,
    ) -> None:
        """One engine step verified drafts: `num_verifies` sequences, `num_draft_tokens` drafts
        proposed over them, `num_accepted_tokens` of those accepted; `accepted_per_position[j]`:
        how many sequences accepted draft j+1 (at most `num_steps` entries; shorter is padded with
        zeros). Call it once per such step, from the engine thread.

        Cheap: one lock and three bucket adds (plus one per position). Ignored while speculative
        decoding is off (`set_speculative` not called, or called with None; a warning is logged
        once). Raises ValueError when `accepted_per_position` is longer than `num_steps` (a
        programming error, caught by tests).
        """
        now = self._clock() if now is None else now
        with self._lock:
            if self._spec_algorithm is None:
                warn, self._spec_ignored_warned = not self._spec_ignored_warned, True
            else:
                warn = False
                per_pos = self._spec_per_pos
                if accepted_per_position:
                    if len(accepted_per_position) > len(per_pos):
                        raise ValueError(f"accepted_per_position has {len(accepted_per_position)} entries; "
                                         f"num_steps is {len(per_pos)}")
                    for j, v in enumerate(accepted_per_position):
                        per_pos[j] += v
                self._spec_verifies.add(num_verifies, now)
                self._spec_drafts.add(num_draft_tokens, now)
                self._spec_accepted.add(num_accepted_tokens, now)
        if warn:
            log.warning("stats: on_spec_step while speculative decoding is off (set_speculative not called); ignored")

    def on_request_arrived(self, rid: str, num_prompt_tokens: int, now: float | None = None) -> None:
        """A request entered the engine's waiting queue. Starts its queue time, TTFT and E2E clocks."""
        now = self._clock() if now is None else now
        with self._lock:
            self._arrived.add(1, now)
            self._prompt.add(num_prompt_tokens, now)
            self._reqs[rid] = _Req(now, num_prompt_tokens)
            if len(self._reqs) > self._max_tracked:
                # Never grow without bound, even if finishes go missing: drop the oldest entry.
                del self._reqs[next(iter(self._reqs))]
                self.dropped_requests += 1

    def on_request_scheduled(self, rid: str, now: float | None = None) -> None:
        """The request was scheduled (got a slot). The first call records its queue time; later
        calls (after a preemption) do not, so queue time means time to first service."""
        now = self._clock() if now is None else now
        with self._lock:
            req = self._reqs.get(rid)
            if req is not None and req.scheduled is None:
                req.scheduled = now
                self._lat["queue_ms"].add(now - req.arrived, now)

    def on_request_preempted(self, rid: str, now: float | None = None) -> None:
        """The request lost its slot and went back to the queue (counted; timings continue)."""
        with self._lock:
            self._preemptions += 1

    def on_tokens(self, rid: str, n: int = 1, now: float | None = None) -> None:
        """`n` output tokens were produced for `rid` in one step.

        The first call records TTFT (arrival to first token). Each later call records one
        inter-token latency sample: the gap since the previous call divided by `n` (a speculative
        step that yields several tokens spreads its gap over them).
        """
        if n > 0:
            self.on_tokens_many([(rid, n)], now)

    def on_tokens_many(self, items: list[tuple[str, int]], now: float | None = None) -> None:
        """`on_tokens(rid, n, now)` for each (rid, n) of one step, under one lock acquisition."""
        now = self._clock() if now is None else now
        with self._lock:
            total = 0
            for rid, n in items:
                if n <= 0:
                    continue
                total += n
                req = self._reqs.get(rid)
                if req is None:  # unknown (arrived before this collector, or dropped): count only
                    continue
                if req.last_token is None:
                    req.first_token, req.first_n = now, n
                    self._lat["ttft_ms"].add(now - req.arrived, now)
                else:
                    self._lat["itl_ms"].add((now - req.last_token) / n, now)
                req.last_token = now
                req.generated += n
            if total:
                self._generated.add(total, now)

    def on_request_finished(
        self,
        rid: str,
        finish_type: str,
        num_cached_tokens: int = 0,
        now: float | None = None,
    ) -> None:
        """The request ended. `finish_type`: "stop" | "length" | "abort" (client or admin abort) |
        "error" (failed inside the engine). `num_cached_tokens`: prompt tokens served from the
        prefix cache. E2E latency is recorded for "stop" and "length" only, so aborts and errors
        do not skew it. Raises ValueError on an unknown finish type (a programming error)."""
        if finish_type not in self._finish_counts:
            raise ValueError(f"finish_type must be one of {FINISH_TYPES}, got {finish_type!r}")
        now = self._clock() if now is None else now
        with self._lock:
            self._finished.add(1, now)
            self._finish_counts[finish_type] += 1
            self._cached_tokens += num_cached_tokens
            req = self._reqs.pop(rid, None)
            if req is not None:
                self._finished_prompt_tokens += req.prompt_tokens
                if finish_type in ("stop", "length"):
                    self._lat["e2e_ms"].add(now - req.arrived, now)
            record = _finish_record(req, finish_type, num_cached_tokens, now, self._wall_clock())
            self._recent.append(record)
            listeners = list(self._listeners)
        if listeners:
            full = {"request_id": rid, "engine": self.engine_id, **record}
            for fn in listeners:
                try:
                    fn(dict(full))
                except Exception:  # a listener must never break the engine thread
                    log.exception("stats finish listener failed")

    def add_finish_listener(self, fn: Callable[[dict], None]) -> None:
        """Call `fn(record)` for every finished request, on the thread that reports the finish
        (the engine thread: `fn` must be quick and must not block). The record is one
        `recent_requests` entry plus `request_id` and `engine`; exceptions are logged, not raised.
        """
        with self._lock:
            self._listeners.append(fn)

    def remove_finish_listener(self, fn: Callable[[dict], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def set_section(self, name: str, provider: Callable[[], object] | None) -> None:
        """An extra key of this engine's entry, `provider()` called at each snapshot (outside the
        lock; JSON-able result). For state that lives next to the engine, e.g. the server's
        prompt-token cache flag. None removes it. Core keys cannot be replaced."""
        if name in _CORE_KEYS:
            raise ValueError(f"{name!r} is a core key of the engine entry")
        with self._lock:
            if provider is None:
                self._sections.pop(name, None)
            else:
                self._sections[name] = provider

    # ---- consumer API (any thread) ------------------------------------------------------------

    def engine_snapshot(self, now: float | None = None) -> EngineStats:
        """This engine's entry of `engines` (a router collects these from each engine)."""
        now = self._clock() if now is None else now
        with self._lock:
            elapsed = now - self._start
            rates = {}
            for key, window in RATE_WINDOWS.items():
                if window is None:
                    rate = (lambda c: c.total / elapsed if elapsed > 0 else 0.0)  # noqa: E731
                else:
                    rate = (lambda c, w=window: c.rate(w, now, elapsed))  # noqa: E731
                rates[key] = {
                    "requests_arrived_per_s": rate(self._arrived),
                    "requests_finished_per_s": rate(self._finished),
                    "prompt_tokens_per_s": rate(self._prompt),
                    "generation_tokens_per_s": rate(self._generated),
                }
            counters = {
                "requests_arrived": int(self._arrived.total),
                "requests_finished": dict(self._finish_counts),
                "requests_finished_total": sum(self._finish_counts.values()),
                "prompt_tokens": int(self._prompt.total),
                "finished_prompt_tokens": self._finished_prompt_tokens,
                "cached_tokens": self._cached_tokens,
                "generation_tokens": int(self._generated.total),
                "errors": self._finish_counts["error"],
                "aborts": self._finish_counts["abort"],
                "preemptions": self._preemptions,
            }
            # Copy the raw samples under the lock; sort outside it so the engine thread never
            # waits on a percentile computation.
            recent = {k: w.recent(now) for k, w in self._lat.items()}
            totals = {k: (w.total_count, w.total_sum) for k, w in self._lat.items()}
            window_s = self._lat["ttft_ms"].window_s
            live = dict(self._live)
            info = dict(self._info)
            recent_requests = list(self._recent)
            sections = dict(self._sections)
            speculative = self._speculative(now)
        latency: dict = {"window_s": window_s}
        for k in LATENCY_KEYS:
            # Stored in seconds, reported in milliseconds; cumulative sums stay in seconds for
            # Prometheus (its convention), under "total_count" / "total_sum_s".
            latency[k] = summarize(recent[k], QUANTILES, scale=1000.0)
            latency[k]["total_count"], latency[k]["total_sum_s"] = totals[k]
        info["started_at_s"] = self._started_at_wall
        info["uptime_s"] = elapsed
        entry: dict = {
            "id": self.engine_id,
            "state": "ok",
            "info": info,
            "live": live,
            "counters": counters,
            "rates": rates,
            "latency": latency,
            "prefix_hit_rate": hit_rate(counters),
            "recent_requests": recent_requests,
            "speculative": speculative,
        }
        for name, provider in sections.items():
            try:
                entry[name] = provider()
            except Exception as e:  # a broken provider must not break /v1/stats
                entry[name] = {"error": f"{type(e).__name__}: {e}"}
        return entry  # type: ignore[return-value]

    def snapshot(self, now: float | None = None) -> dict:
        """The full /v1/stats document for a server with this one engine (JSON-able)."""
        return merge_snapshots([self.engine_snapshot(now)], time_s=self._wall_clock())

    def spec_summary(self) -> dict:
        """{"enabled", "avg_accept_length", "accept_rate"} since start, cheap enough for every
        step (no windows): what the engine publishes in its load (/server_info, /v1/loads). The
        ratios are None while off or before the first verify."""
        with self._lock:
            on = self._spec_algorithm is not None
            v, d, a = self._spec_verifies.total, self._spec_drafts.total, self._spec_accepted.total
        r = spec_ratios(int(v), int(d), int(a))  # all 0 while off
        return {"enabled": on, "avg_accept_length": r["avg_accept_length"], "accept_rate": r["accept_rate"]}

    def _speculative(self, now: float) -> dict:
        # Under self._lock. The windows cost a pass over each ring: only when it is on.
        counters = (("num_verifies", self._spec_verifies), ("num_draft_tokens", self._spec_drafts),
                    ("num_accepted_tokens", self._spec_accepted))
        totals = {k: int(c.total) for k, c in counters}
        windows = None
        if self._spec_algorithm is not None:
            windows = {w: {k: int(c.sum_window(RATE_WINDOWS[w], now)[0]) for k, c in counters}
                       for w in SPEC_WINDOWS}
        return speculative_section(self._spec_algorithm, self._spec_num_steps, totals, self._spec_per_pos, windows)


_CORE_KEYS = frozenset({"id", "state", "info", "live", "counters", "rates", "latency", "prefix_hit_rate",
                        "recent_requests", "speculative"})


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 3)


def _finish_record(req: _Req | None, finish_type: str, cached: int, now: float, wall: float) -> dict:
    """One `recent_requests` entry: numbers only (no id, no text). Times in ms; None when unknown
    (a request that never got a token has no TTFT; ITL needs two token reports)."""
    rec: dict = {"finished_at_s": round(wall, 3), "finish_reason": finish_type, "prompt_tokens": 0,
                 "output_tokens": 0, "cached_tokens": cached, "queue_ms": None, "ttft_ms": None,
                 "itl_ms": None, "e2e_ms": None}
    if req is None:
        return rec
    rec["prompt_tokens"] = req.prompt_tokens
    rec["output_tokens"] = req.generated
    if req.scheduled is not None:
        rec["queue_ms"] = _ms(req.scheduled - req.arrived)
    if req.first_token is not None:
        rec["ttft_ms"] = _ms(req.first_token - req.arrived)
        later = req.generated - req.first_n
        if later > 0 and req.last_token is not None:
            # mean inter-token latency: the time after the first token report over the tokens after it
            rec["itl_ms"] = _ms((req.last_token - req.first_token) / later)
    rec["e2e_ms"] = _ms(now - req.arrived)
    return rec


def _version() -> str:
    # Read the installed version directly: importing the `trnrt` root package would, to the import
    # linter, make stats depend on everything the root package can load lazily (the engine).
    from importlib import metadata

    try:
        return metadata.version("trnrt")
    except metadata.PackageNotFoundError:  # a source tree without install, as trnrt/__init__ does
        return "0.0.0+src"
