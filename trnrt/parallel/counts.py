"""Counts of the collectives a ParallelContext issued (calls, bytes and wall seconds per kind), for stats."""

from __future__ import annotations

import threading


class CollectiveCounts:
    """Calls, bytes (input size) and seconds (issue to wait, eager calls) per collective kind;
    thread-safe, cheap to snapshot. `totals()` is what a per-step delta reads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._n = 0
        self._s = 0.0

    def record(self, kind: str, nbytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            self._calls[kind] = self._calls.get(kind, 0) + 1
            self._bytes[kind] = self._bytes.get(kind, 0) + nbytes
            self._seconds[kind] = self._seconds.get(kind, 0.0) + seconds
            self._n += 1
            self._s += seconds

    def snapshot(self) -> dict[str, dict]:
        """{'calls': {kind: n}, 'bytes': {kind: n}, 'seconds': {kind: s}} (copies)."""
        with self._lock:
            return {"calls": dict(self._calls), "bytes": dict(self._bytes), "seconds": dict(self._seconds)}

    def total_calls(self) -> int:
        with self._lock:
            return self._n

    def totals(self) -> tuple[int, float]:
        """(calls, seconds) over every kind since the start (or the last reset)."""
        with self._lock:
            return self._n, self._s

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._bytes.clear()
            self._seconds.clear()
            self._n = 0
            self._s = 0.0
