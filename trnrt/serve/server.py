"""Run the app on waitress, with graceful shutdown on SIGINT/SIGTERM.

Thread sizing: one streaming response holds one waitress worker for its whole life, so the pool
is the HTTP layer's admission limit (max_concurrent_requests) plus headroom for /health,
/v1/stats and /v1/models, which must never wait behind streams. `channel_request_lookahead=1`
keeps sockets readable during a request so `waitress.client_disconnected` sees a client leave.

Shutdown: the first signal stops admission (new requests get 503, /health 503), drains the engine
for up to `drain_timeout_s` (it aborts what is left), waits for the responses to finish writing,
then leaves waitress' loop; the process exits 0. A second signal skips the drain.
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
import time

from waitress.server import create_server

from trnrt.serve.http.state import get_state

log = logging.getLogger("trnrt.serve")

CONTROL_HEADROOM_THREADS = 8


def thread_count(max_concurrent_requests: int, threads: int | None = None) -> int:
    """Waitress worker threads: explicit, or admission limit + headroom for control routes."""
    return threads if threads else max_concurrent_requests + CONTROL_HEADROOM_THREADS


def make_server(app, host: str = "127.0.0.1", port: int = 30000, threads: int | None = None, **adj):
    """A waitress server for `app` (not started). `port=0` picks a free port (`.effective_port`)."""
    state = get_state(app)
    n = thread_count(state.settings.max_concurrent_requests, threads)
    opts = dict(
        threads=n,
        channel_request_lookahead=1,
        connection_limit=max(100, n + 64),
        # select() cannot watch fds above 1024; poll() can (a large connection_limit needs it).
        asyncore_use_poll=True,
        max_request_body_size=state.settings.max_request_bytes + 1024,
        ident="trnrt",
    )
    opts.update(adj)
    return create_server(app, host=host, port=port, **opts)


class GracefulShutdown:
    """Signal handling for a waitress server running in the main thread."""

    def __init__(self, server, app, engine, drain_timeout_s: float = 30.0):
        self.server = server
        self.state = get_state(app)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self._started = False
        self._done = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self._done.is_set():
            raise SystemExit(0)  # leaves waitress' loop (run() catches SystemExit)
        if self._started:
            log.warning("second signal: aborting in-flight requests")
            self.drain_timeout_s = 0.0
            raise SystemExit(0)
        self._started = True
        log.info("shutting down: no new requests; draining for up to %.0f s", self.drain_timeout_s)
        self.state.shutting_down.set()
        threading.Thread(target=self._drain, name="trnrt-drain", daemon=True).start()

    def _drain(self) -> None:
        try:
            self.engine.shutdown(self.drain_timeout_s)
            # Let the workers write the final chunks of the streams that just finished.
            self.state.wait_idle(5.0)
            time.sleep(0.2)
        finally:
            self._done.set()
            _thread.interrupt_main(signal.SIGINT)


def run(app, engine, host: str = "127.0.0.1", port: int = 30000, threads: int | None = None,
        drain_timeout_s: float = 30.0, on_ready=None) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status (0).

    `on_ready(url)` is called once the socket listens (the CLI logs the URL there).
    """
    server = make_server(app, host=host, port=port, threads=threads)
    shutdown = GracefulShutdown(server, app, engine, drain_timeout_s)
    shutdown.install()
    url = f"http://{host}:{server.effective_port}"
    if on_ready is not None:
        on_ready(url)
    try:
        server.run()
    finally:
        try:
            engine.shutdown(0.0)
        except Exception:  # already stopped
            log.debug("engine shutdown after serve loop", exc_info=True)
        server.close()
    return 0
