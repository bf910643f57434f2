"""A bounded, thread-safe in-memory store for `/v1/responses` (`trnrt serve --enable-response-store`).

SGLang and vLLM keep stored responses in a plain dict that grows without bound; this store is
bounded twice: by size (the JSON size of what an entry holds, `max_bytes` in all) and by age
(`ttl_s` since the entry was last written). Writing past the size bound evicts the least recently
used entries (a `get` counts as a use); an entry larger than the whole bound is not kept. Expired
entries are dropped lazily (on any access) — nothing runs in the background.

An entry holds the Response object as the client sees it, the conversation it continues
(`history`: chat messages, what `previous_response_id` resumes from) and, while its request is
still running, a cancel hook. Pure Python.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class StoredResponse:
    """One stored response. `history` is None while the response is in progress."""

    response: dict
    history: list | None = None
    cancel: Callable[[], None] | None = None
    size: int = 0
    written_at: float = 0.0
    cancel_requested: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def in_progress(self) -> bool:
        return self.response.get("status") in ("in_progress", "queued")


def entry_size(response: dict, history: list | None) -> int:
    """The bytes an entry is charged: its JSON text (a fair proxy for the Python objects)."""
    try:
        return len(json.dumps(response, ensure_ascii=False, default=str)) + \
            len(json.dumps(history or [], ensure_ascii=False, default=str)) + 64
    except (TypeError, ValueError, RecursionError):
        return 1 << 62  # unmeasurable: never kept


class ResponseStore:
    """Bounded LRU of `StoredResponse` by id, with a TTL. Every method is thread-safe."""

    def __init__(self, max_bytes: int, ttl_s: float | None, clock: Callable[[], float] = time.monotonic):
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError("ttl_s must be > 0 (or None: no expiry)")
        self.max_bytes = int(max_bytes)
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest use first
        self._bytes = 0
        self.evicted = 0  # entries dropped for size
        self.expired = 0  # entries dropped for age

    # --- internals (lock held) ---------------------------------------------------------------
    def _expire(self, now: float) -> None:
        if self.ttl_s is None:
            return
        dead = [k for k, e in self._entries.items() if now - e.written_at > self.ttl_s]
        for k in dead:
            self._bytes -= self._entries.pop(k).size
            self.expired += 1

    def _drop(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._bytes -= e.size

    # --- API ---------------------------------------------------------------------------------
    def put(self, response_id: str, response: dict, history: list | None = None,
            cancel: Callable[[], None] | None = None) -> bool:
        """Insert or replace an entry (it becomes the most recently used). False when the entry
        alone is larger than the store (it is then not kept, and an older version is dropped)."""
        size = entry_size(response, history)
        with self._lock:
            now = self._clock()
            self._expire(now)
            old = self._entries.get(response_id)
            cancel_requested = old.cancel_requested if old is not None else False
            self._drop(response_id)
            if size > self.max_bytes:
                return False
            while self._entries and self._bytes + size > self.max_bytes:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.size
                self.evicted += 1
            self._entries[response_id] = StoredResponse(response, history, cancel, size, now, cancel_requested)
            self._bytes += size
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (marked as used), or None when unknown, evicted or expired."""
        with self._lock:
            self._expire(self._clock())
            e = self._entries.get(response_id)
            if e is not None:
                self._entries.move_to_end(response_id)
            return e

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire(self._clock())
            found = response_id in self._entries
            self._drop(response_id)
            return found

    def request_cancel(self, response_id: str) -> StoredResponse | None:
        """Mark an in-progress entry cancelled and run its cancel hook (outside the lock).
        Returns the entry (None when unknown); the caller checks `in_progress` first."""
        with self._lock:
            self._expire(self._clock())
            e = self._entries.get(response_id)
            if e is None:
                return None
            hook = None
            if e.in_progress and not e.cancel_requested:
                e.cancel_requested = True
                hook = e.cancel
        if hook is not None:
            hook()
        return e

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._entries)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return self._bytes


__all__ = ["ResponseStore", "StoredResponse", "entry_size"]
