"""OutputStream: the per-request queue the engine thread fills and a client thread drains. Pure Python."""

from __future__ import annotations

import queue
from typing import Iterator

from trnrt.engine.outputs import RequestOutput


class OutputStream:
    """Incremental outputs of one request (implements trnrt.engine.client.RequestStream)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        # SimpleQueue (C, lock-free put): the engine thread puts one output per request per step.
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        """Called by the engine thread only."""
        self._queue.put(output)

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """Next output, or None if none arrived within `timeout` seconds."""
        try:
            out = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if out.finished:
            self.finished = True
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.get()
            assert out is not None
            yield out
            if out.finished:
                return
