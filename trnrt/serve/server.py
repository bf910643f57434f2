"""Run the app on waitress, with graceful shutdown on SIGINT/SIGTERM.

Thread sizing: one streaming response holds one waitress worker for its whole life, so the pool
is the HTTP layer's admission limit (max_concurrent_requests) plus headroom for /health,
/v1/stats and /v1/models, which must never wait behind streams. `channel_request_lookahead=1`
keeps sockets readable during a request so `waitress.client_disconnected` sees a client leave.

Connections: idle connections hold no thread, only a socket, so the connection limit is large
(`connection_limit`, default max(1024, 4 x threads), with poll()) and idle ones are closed after
`channel_timeout`; one client address may hold at most `max_connections_per_client` of them (an
extra one gets a 429 and is closed), so a client that opens hundreds of idle connections cannot
keep /health or anyone else out. Waitress' own protocol errors (a body over the limit, a header
too large, a malformed request line) are answered in the JSON error envelope, not as plain text.

Shutdown: the first signal stops admission (new requests get 503, /health 503), drains the engine
for up to `drain_timeout_s` (it aborts what is left), waits for the responses to finish writing,
then leaves waitress' loop; the process exits 0. A request still being parsed or tokenized when the
signal came gets its 503. A second signal aborts everything in flight at once and exits.
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
import time

import json
import resource

from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import create_server
from waitress.task import ErrorTask

from trnrt.serve.http.errors import error_body
from trnrt.serve.http.state import get_state

log = logging.getLogger("trnrt.serve")

CONTROL_HEADROOM_THREADS = 8
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 512
CHANNEL_TIMEOUT_S = 60  # idle keep-alive connections are closed after this (waitress default 120)


class JSONErrorTask(ErrorTask):
    """Waitress' protocol errors (413, 431, 400 on a malformed request) in the JSON envelope."""

    def execute(self):
        e = self.request.error
        status = f"{e.code} {e.reason}"
        body = json.dumps(error_body(e.code, f"{e.reason}: {str(e.body).strip()}")).encode()
        self.status = status
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class _ClientCounts:
    """Open connections per client address (the waitress main loop is one thread: no lock)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.counts: dict[str, int] = {}

    def add(self, host: str) -> bool:
        n = self.counts.get(host, 0)
        if n >= self.cap:
            return False
        self.counts[host] = n + 1
        return True

    def remove(self, host: str) -> None:
        n = self.counts.get(host, 0) - 1
        if n > 0:
            self.counts[host] = n
        else:
            self.counts.pop(host, None)


_TOO_MANY = json.dumps(error_body(429, "Too many open connections from this client.", type_="rate_limit_error"))
_TOO_MANY_RESPONSE = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(_TOO_MANY)}\r\nConnection: close\r\n\r\n{_TOO_MANY}").encode()


def _channel_class(counts: _ClientCounts):
    class TrnrtChannel(HTTPChannel):
        error_task_class = JSONErrorTask

        def __init__(self, server, sock, addr, adj, map=None):
            self._client = addr[0] if isinstance(addr, tuple) and addr else str(addr)
            self._counted = False
            super().__init__(server, sock, addr, adj, map=map)
            self._counted = True

        def del_channel(self, map=None):
            if self._counted:
                self._counted = False
                counts.remove(self._client)
            super().del_channel(map)

    return TrnrtChannel


def _raise_fd_limit(want: int) -> None:
    """Raise the soft open-file limit towards `want` (a connection is a file descriptor)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        log.debug("could not raise RLIMIT_NOFILE", exc_info=True)


def thread_count(max_concurrent_requests: int, threads: int | None = None) -> int:
    """Waitress worker threads: explicit, or admission limit + headroom for control routes."""
    return threads if threads else max_concurrent_requests + CONTROL_HEADROOM_THREADS


def make_server(app, host: str = "127.0.0.1", port: int = 30000, threads: int | None = None,
                max_connections_per_client: int | None = None, **adj):
    """A waitress server for `app` (not started). `port=0` picks a free port (`.effective_port`)."""
    state = get_state(app)
    n = thread_count(state.settings.max_concurrent_requests, threads)
    opts = dict(
        threads=n,
        channel_request_lookahead=1,
        connection_limit=max(1024, 4 * n),
        channel_timeout=CHANNEL_TIMEOUT_S,
        # select() cannot watch fds above 1024; poll() can (a large connection_limit needs it).
        asyncore_use_poll=True,
        max_request_body_size=state.settings.max_request_bytes + 1024,
        ident="trnrt",
    )
    opts.update(adj)
    _raise_fd_limit(opts["connection_limit"] + n + 64)
    server = create_server(app, host=host, port=port, **opts)
    cap = max_connections_per_client or min(DEFAULT_MAX_CONNECTIONS_PER_CLIENT, opts["connection_limit"] // 2)
    counts = _ClientCounts(max(1, cap))
    server.channel_class = _channel_class(counts)
    server.client_counts = counts
    def handle_accept():
        # Over the per-client cap: answer 429 and close before a channel is made.
        try:
            v = server.accept()
        except OSError:
            return
        if v is None:
            return
        conn, addr = v
        host = addr[0] if isinstance(addr, tuple) and addr else str(addr)
        if not counts.add(host):
            try:
                conn.setblocking(False)
                conn.send(_TOO_MANY_RESPONSE)
            except OSError:
                pass
            conn.close()
            return
        try:
            server.set_socket_options(conn)
            server.channel_class(server, conn, server.fix_addr(addr), server.adj, map=server._map)
        except Exception:
            counts.remove(host)
            conn.close()
            raise

    server.handle_accept = handle_accept
    return server


def start_in_thread(server, name: str = "trnrt-waitress") -> threading.Thread:
    """Run `server`'s loop in a daemon thread (tests, embedding); stop it with `stop_in_thread`."""
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    return thread


def stop_in_thread(server, thread: threading.Thread | None, timeout: float = 5.0) -> None:
    """Stop a server started by `start_in_thread`: worker threads first, then the loop, then its fds.

    waitress' own `close()` shuts the loop's wake-up pipe while the worker threads and the loop
    thread still run. A worker that finishes a response afterwards pulls the trigger
    (`os.write(fd, b"x")`) on a closed fd number which the process may have reused meanwhile, for
    example for a socket that another server just accepted: that client then reads `xHTTP/1.1 ...`.
    So: stop the workers, let the loop close every channel itself (an empty map ends the loop),
    join it, and only then is nothing left that could write to the old fds.
    """
    server.task_dispatcher.shutdown(cancel_pending=True, timeout=timeout)
    if thread is not None and thread.is_alive():
        server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
        thread.join(timeout)
        if thread.is_alive():
            log.warning("waitress loop thread %s did not stop within %.0f s", thread.name, timeout)
            return  # closing the fds under a live loop is what this function avoids
    server.close()


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
            # Abort everything now (the streams end with an error event at once), give the workers
            # a moment to write those, then leave the loop.
            threading.Thread(target=self.engine.shutdown, args=(0.0,), name="trnrt-abort", daemon=True).start()
            self.state.wait_idle(2.0)
            raise SystemExit(0)
        self._started = True
        log.info("shutting down: no new requests; draining for up to %.0f s", self.drain_timeout_s)
        self.state.shutting_down.set()
        threading.Thread(target=self._drain, name="trnrt-drain", daemon=True).start()

    def _drain(self) -> None:
        try:
            self.engine.shutdown(self.drain_timeout_s)
            # Let the workers write the final chunks of the streams that just finished, and answer
            # (503) the requests that were still being parsed or tokenized when the signal came.
            self.state.wait_idle(5.0)
            self.state.wait_http_idle(5.0)
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
