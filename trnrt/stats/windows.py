"""Bounded-memory building blocks for stats: time-bucketed counters and latency sample windows.

Both structures are sized once, at construction, from a time horizon and a cap, so memory stays the
same whatever the traffic. Neither is thread-safe on its own; `StatsCollector` guards them.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable, Sequence


class BucketedCounter:
    """A counter kept in fixed-width time buckets over a horizon, for rates over sliding windows.

    Bucket `i` holds what was added during [i*bucket_s, (i+1)*bucket_s). The buckets live in a ring
    of `ceil(horizon_s / bucket_s)` slots tagged with their bucket index, so a slot left over from an
    earlier lap is recognised as stale and never counted: no background task has to clear it.
    """

    def __init__(self, horizon_s: float = 900.0, bucket_s: float = 1.0) -> None:
        if bucket_s <= 0 or horizon_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= horizon_s")
        self.bucket_s = float(bucket_s)
        self.horizon_s = float(horizon_s)
        self._n = int(math.ceil(horizon_s / bucket_s))
        self._idx = [-1] * self._n  # bucket index held by each ring slot (-1: never used)
        self._val = [0.0] * self._n
        self.total = 0.0  # since construction; never decays

    def _bucket(self, t: float) -> int:
        return int(math.floor(t / self.bucket_s))

    def add(self, value: float, now: float) -> None:
        """Add `value` at time `now` (seconds on the collector's clock)."""
        b = self._bucket(now)
        slot = b % self._n
        if self._idx[slot] != b:
            self._idx[slot] = b
            self._val[slot] = 0.0
        self._val[slot] += value
        self.total += value

    def sum_window(self, window_s: float, now: float) -> tuple[float, float]:
        """(sum, covered_s) over the last `window_s` seconds ending at `now`.

        The window is whole buckets: the current one and the `window_s / bucket_s - 1` before it, so
        `covered_s` (from the start of the oldest bucket to `now`) lies in (window_s - bucket_s,
        window_s]. Dividing by it rather than by `window_s` keeps the rate unbiased.
        """
        k = max(1, int(round(window_s / self.bucket_s)))
        k = min(k, self._n)
        cur = self._bucket(now)
        lo = cur - k + 1
        s = 0.0
        for slot in range(self._n):
            b = self._idx[slot]
            if lo <= b <= cur:
                s += self._val[slot]
        return s, now - lo * self.bucket_s

    def rate(self, window_s: float, now: float, elapsed_s: float) -> float:
        """Mean rate per second over the last `window_s` seconds, or over `elapsed_s` if that is shorter.

        `elapsed_s` is the time since counting began: a collector up for 10 s reports its 1-minute
        rate over those 10 s instead of diluting it by 50 s it never saw.
        """
        s, covered = self.sum_window(window_s, now)
        denom = min(covered, elapsed_s)
        return s / denom if denom > 0 else 0.0


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of already sorted values, linear interpolation; None if empty.

    Linear interpolation between closest ranks (numpy's default), so p50 of [1, 2] is 1.5.
    """
    n = len(sorted_values)
    if n == 0:
        return None
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * (q / 100.0)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac)


class LatencyWindow:
    """Recent latency samples: the last `window_s` seconds, at most `max_samples` of them.

    A ring buffer of (time, value) pairs. Under heavy traffic the cap wins and the percentiles
    describe the most recent `max_samples` observations (a shorter span than `window_s`); the
    snapshot reports `count` so a reader can tell. Cumulative `count` and `sum` since start are
    kept separately (Prometheus summaries need them).
    """

    def __init__(self, window_s: float = 60.0, max_samples: int = 2048) -> None:
        if window_s <= 0 or max_samples <= 0:
            raise ValueError("window_s and max_samples must be positive")
        self.window_s = float(window_s)
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.total_count = 0
        self.total_sum = 0.0

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, value))
        self.total_count += 1
        self.total_sum += value

    def recent(self, now: float) -> list[float]:
        """Values observed in (now - window_s, now], oldest first (a copy, safe to sort)."""
        cutoff = now - self.window_s
        return [v for (t, v) in self._samples if t > cutoff]


def summarize(values: Iterable[float], quantiles: Sequence[int] = (50, 90, 99), scale: float = 1.0) -> dict:
    """{"p50": ..., "p90": ..., "p99": ..., "count": n, "mean": ...} of `values` times `scale`.

    Percentiles are None when there are no samples (JSON null), never 0, so "no data" is not read
    as "instant".
    """
    vals = sorted(v * scale for v in values)
    out: dict = {f"p{q}": percentile(vals, q) for q in quantiles}
    out["count"] = len(vals)
    out["mean"] = (sum(vals) / len(vals)) if vals else None
    return out
