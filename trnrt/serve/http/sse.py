"""Server-sent events framing and the bridge from engine streams to a WSGI body.

Falcon's WSGI side has no SSE helper, so framing is written here. `drain_streams` is the one place
where a waitress worker waits on the engine: it polls for a client disconnect between outputs
(`waitress.client_disconnected`, which needs channel_request_lookahead >= 1), and its caller aborts
in `finally`, so a client that leaves frees its pages and slot promptly.
"""

from __future__ import annotations

import json
import queue
import time
from typing import Callable, Iterator, Sequence

from trnrt.engine.output.outputs import RequestOutput

DONE = b"data: [DONE]\n\n"


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event(obj) -> bytes:
    """One `data: {json}` event."""
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


class StreamBody:
    """A WSGI body iterator whose close() always runs `on_close`.

    A generator's `finally` does not run when it is closed before its first `next()` (waitress
    closes the body of a client that left before the first write), so the abort and the release
    of the admission slot hang off close() as well. `on_close` must be idempotent.
    """

    def __init__(self, gen, on_close):
        self._gen = gen
        self._on_close = on_close

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        return next(self._gen)

    def close(self) -> None:
        try:
            self._gen.close()
        finally:
            self._on_close()


class ClientGone(Exception):
    """The client closed the connection; the request must be aborted."""


def drain_streams(streams: Sequence, client_gone: Callable[[], bool], poll_s: float = 0.05
                  ) -> Iterator[tuple[int, RequestOutput]]:
    """Yield (stream index, output) from several engine streams until all have finished.

    Raises ClientGone when `client_gone()` turns true while waiting. One stream waits with
    `poll_s` timeouts; several are polled round-robin (n > 1 prompts on /v1/completions).
    """
    active = list(range(len(streams)))
    last_check = time.monotonic()
    while active:
        got = False
        timeout = poll_s if len(active) == 1 else 0.0
        for i in list(active):
            # One output per stream per round, so the disconnect check below runs even while
            # outputs keep arriving.
            try:
                out = streams[i].get(timeout=timeout)
            except queue.Empty:
                out = None
            if out is None:
                continue
            got = True
            yield i, out
            if out.finished:
                active.remove(i)
        now = time.monotonic()
        # Check when idle, and now and then while outputs flow (a non-streamed body writes
        # nothing until the end, so no failed write would tell us).
        if not got or now - last_check > 0.25:
            last_check = now
            if client_gone():
                raise ClientGone()
        if not got and len(active) > 1:
            time.sleep(0.005)
