"""Counts of the collectives a ParallelContext issued (calls and bytes per kind), for stats."""

from __future__ import annotations

import threading


class CollectiveCounts:
    """Calls and bytes (input size) per collective kind; thread-safe, cheap to snapshot."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def record(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._calls[kind] = self._calls.get(kind, 0) + 1
            self._bytes[kind] = self._bytes.get(kind, 0) + nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{'calls': {kind: n}, 'bytes': {kind: n}} (copies)."""
        with self._lock:
            return {"calls": dict(self._calls), "bytes": dict(self._bytes)}

    def total_calls(self) -> int:
        with self._lock:
            return sum(self._calls.values())

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._bytes.clear()
