"""MPEngineClient: an EngineClient whose engine runs in its own process (trnrt.engine.core.core_proc).

Why: in one process the HTTP threads (chat rendering, tokenization, JSON and SSE writes) and the
engine thread share one GIL, so each slows the other (docs/PERFORMANCE.md, "the single
process"). Here the engine core owns a process, and its steps never wait for HTTP work; this
process keeps the tokenizers, the routes and one reader thread that hands each output to the
request's stream. Pure Python (no torch is imported in this process by this module).

Semantics are the in-process Engine's (trnrt.engine.core.client.EngineClient):
- `submit_many` is synchronous: it returns once the engine validated and queued the batch, raising
  the engine's own exception (InvalidRequestError with its `field`, EngineDeadError) otherwise.
- `load()` answers from the last load the engine published with its outputs (never waits);
  `is_idle()` from this side's open streams (removed when the final output arrives, as the
  engine removes its live ids).
- If the engine process dies, every open stream ends with an error output, pending calls raise
  EngineDeadError, and so does every later submit; `alive` turns False (/health reports it).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import time
from typing import Callable

from trnrt.engine.core.client import EngineDeadError, EngineLoad, FlushResult, FLUSH_BUSY_MESSAGE, FLUSH_TIMEOUT_MESSAGE
from trnrt.engine.core.ipc import unpack_exception
from trnrt.engine.output.outputs import RequestOutput
from trnrt.engine.request import FinishReason, GenerateRequest, check_new_request_ids
from trnrt.engine.output.stream import OutputStream

log = logging.getLogger("trnrt.engine.core.mp_client")

ENGINE_DIED_MESSAGE = "the engine process exited"
_SUBMIT_TIMEOUT_S = 120.0  # a grammar compile happens inside submit
_CALL_MARGIN_S = 5.0


class EngineProcessError(RuntimeError):
    """The engine process could not start (its own error is the message)."""


class _Pending:
    __slots__ = ("event", "value")

    def __init__(self):
        self.event = threading.Event()
        self.value = None

    def set(self, value) -> None:
        self.value = value
        self.event.set()


class _CollectorProxy:
    """The part of trnrt.stats.StatsCollector the serve layer uses next to the engine: extra
    /v1/stats sections (computed here, in the HTTP process) and finish listeners (the engine
    process forwards its finish records once one is added)."""

    def __init__(self, client: "MPEngineClient"):
        self._client = client
        self._sections: dict[str, Callable[[], object]] = {}
        self._listeners: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()

    def set_section(self, name: str, provider: Callable[[], object] | None) -> None:
        with self._lock:
            if provider is None:
                self._sections.pop(name, None)
            else:
                self._sections[name] = provider

    def add_finish_listener(self, fn: Callable[[dict], None]) -> None:
        with self._lock:
            first = not self._listeners
            self._listeners.append(fn)
        if first:
            self._client._send(("finish_records",))

    def sections(self) -> dict:
        with self._lock:
            return dict(self._sections)

    def on_record(self, rec: dict) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(rec)
            except Exception:
                log.exception("finish listener failed")


class MPEngineClient:
    """Start `factory(*factory_args)` (a picklable, module-level callable returning an Engine) in a
    spawned process and serve the EngineClient protocol from here. Raises what the factory raised
    (its own type: a bad checkpoint's ValueError stays a ValueError) if the engine cannot start."""

    submitted = None  # the in-process Engine's submit log does not cross the process boundary

    def __init__(self, factory: Callable, factory_args: tuple = (), *, startup_timeout_s: float | None = None,
                 log_level: int | None = None):
        from trnrt.engine.core.core_proc import run_engine_core

        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads
        req_r, self._conn_w = ctx.Pipe(duplex=False)
        self._conn_r, out_w = ctx.Pipe(duplex=False)
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        # daemon: ended with this process even if shutdown() never ran; the core's pipe EOF
        # handling ends it when this process dies without running atexit handlers.
        self._proc = ctx.Process(target=run_engine_core, args=(req_r, out_w, factory, tuple(factory_args), level),
                                 name="trnrt-engine-core", daemon=True)
        self._proc.start()
        req_r.close()
        out_w.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, OutputStream] = {}
        self._calls: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._load = EngineLoad()
        self._dead: str | None = None
        self._closing = False
        self.stats_collector = _CollectorProxy(self)
        info = self._wait_ready(startup_timeout_s)
        self.model_info = info["model_info"]
        self.startup_time_s = info.get("startup_time_s")
        self.prompt_logprobs = info.get("prompt_logprobs", False)
        self.penalties = info.get("penalties", False)
        self.stream_interval = info.get("stream_interval", 1)
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read, name="trnrt-core-reader", daemon=True)
        self._reader.start()

    # -- start and the reader thread ---------------------------------------------------------------

    def _wait_ready(self, timeout_s: float | None) -> dict:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._conn_r.poll(0.2):
                try:
                    msg = self._conn_r.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg[0] == "ready":
                    return msg[1]
                self._proc.join(10)
                if msg is not None and msg[0] == "failed":
                    raise unpack_exception(msg[1])
                raise EngineProcessError(f"the engine process exited during start-up (exit code {self._proc.exitcode})")
            if not self._proc.is_alive():
                raise EngineProcessError(f"the engine process exited during start-up (exit code {self._proc.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                self._proc.kill()
                raise EngineProcessError(f"the engine process did not start within {timeout_s:.0f} s")

    def _read(self) -> None:
        conn = self._conn_r
        streams = self._streams
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "out":
                _, items, load = msg
                if load is not None:
                    self._load = load
                for rid, output in items:
                    stream = streams.get(rid)
                    if stream is None:
                        continue
                    if output.finished:
                        with self._lock:
                            streams.pop(rid, None)  # before the put: the id may be reused at once
                    stream.put(output)
            elif kind == "reply":
                pending = self._calls.pop(msg[1], None)
                if pending is not None:
                    pending.set((msg[2], msg[3]))
            elif kind == "record":
                self.stats_collector.on_record(msg[1])
        self._on_exit()

    def _on_exit(self) -> None:
        """The engine process is gone (shutdown, or it died): end what is still open."""
        self._proc.join(5)
        code = self._proc.exitcode
        message = ENGINE_DIED_MESSAGE if self._closing else f"{ENGINE_DIED_MESSAGE} (exit code {code})"
        self._dead = message
        if not self._closing:
            log.error("%s; failing the requests in flight", message)
        with self._lock:
            streams, self._streams = dict(self._streams), {}
            calls, self._calls = dict(self._calls), {}
        for rid, stream in streams.items():
            stream.put(RequestOutput(rid, finished=True, error=message,
                                     finish_reason=FinishReason("abort", message=message, status_code=503)))
        for pending in calls.values():
            pending.set((False, None, EngineDeadError(message)))

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def _send(self, msg) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            with self._send_lock:
                self._conn_w.send(msg)
        except (OSError, EOFError, BrokenPipeError) as e:
            raise EngineDeadError(f"{ENGINE_DIED_MESSAGE}: {e}") from None

    def _rpc(self, kind: str, payload: tuple, timeout_s: float | None):
        """Send one message that wants a reply; wait for it. Returns (True, value); raises the
        engine's exception; (False, None) when no reply came within timeout_s."""
        cid = next(self._ids)
        pending = _Pending()
        with self._lock:
            self._calls[cid] = pending
        try:
            self._send((kind, cid, *payload))
        except BaseException:
            self._calls.pop(cid, None)
            raise
        if not pending.event.wait(timeout_s):
            self._calls.pop(cid, None)
            return False, None
        ok, value, *dead = pending.value
        if dead:
            raise dead[0]
        if not ok:
            raise unpack_exception(value)
        return True, value

    def _call(self, method: str, *args, wait_s: float | None, default=None, **kwargs):
        """engine.method(*args, **kwargs) over there; `default` when no answer came within wait_s."""
        got, value = self._rpc("call", (method, args, kwargs), wait_s)
        return value if got else default

    # -- EngineClient -----------------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> OutputStream:
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[GenerateRequest]) -> list[OutputStream]:
        if self._closing or self._dead is not None:
            raise EngineDeadError(self._dead or "the engine is not accepting requests (shutting down)")
        ids = [r.request_id for r in requests]
        streams = [OutputStream(rid, 1) for rid in ids]  # the engine side already merges per interval
        with self._lock:
            check_new_request_ids(ids, self._streams)
            # Registered before sending: the first outputs may arrive before the submit's reply.
            self._streams.update(zip(ids, streams))
        try:
            got, _ = self._rpc("submit", (list(requests),), _SUBMIT_TIMEOUT_S)
            if not got:
                raise EngineDeadError("the engine did not take the request in time")
        except BaseException:
            with self._lock:
                for rid, stream in zip(ids, streams):
                    if self._streams.get(rid) is stream:
                        del self._streams[rid]
            raise
        return streams

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except RuntimeError:
            pass  # no engine: nothing to abort (its streams were ended when it exited)

    def abort_requests(self, prefix: str = "", *, abort_all: bool = False, message: str = "Aborted",
                       timeout_s: float = 5.0) -> list[str]:
        if not abort_all and not prefix:
            return []
        if self._dead is not None:
            return []
        try:
            return self._call("abort_requests", prefix, abort_all=abort_all, message=message, timeout_s=timeout_s,
                              wait_s=timeout_s + _CALL_MARGIN_S, default=[])
        except RuntimeError:
            return []

    def flush_cache(self, timeout_s: float = 0.0) -> FlushResult:
        timeout_s = max(0.0, float(timeout_s))
        if self._dead is not None or (timeout_s == 0.0 and not self.is_idle()):
            return FlushResult(False, FLUSH_BUSY_MESSAGE)
        default = FlushResult(False, FLUSH_TIMEOUT_MESSAGE if timeout_s else FLUSH_BUSY_MESSAGE)
        try:
            return self._call("flush_cache", timeout_s, wait_s=timeout_s + _CALL_MARGIN_S + 5.0, default=default)
        except RuntimeError:
            return default

    def load(self, *, fresh: bool = False, timeout_s: float = 1.0) -> EngineLoad:
        base = self._load
        if fresh and self._dead is None:
            try:
                base = self._call("load", fresh=True, timeout_s=timeout_s, wait_s=timeout_s + _CALL_MARGIN_S) or base
            except RuntimeError:
                pass
        return base.replace(num_pending_reqs=len(self._streams))

    def server_info(self) -> dict:
        return self._call("server_info", wait_s=_CALL_MARGIN_S + 25.0, default={}) or {}

    def is_idle(self) -> bool:
        return not self._streams

    def stats(self) -> dict:
        snap = self._call("stats", wait_s=_CALL_MARGIN_S + 25.0, default=None)
        if snap is None:
            raise TimeoutError("the engine process did not answer /v1/stats in time")
        sections = self.stats_collector.sections()
        if sections:
            for entry in snap.get("engines", []):
                for name, provider in sections.items():
                    try:
                        entry[name] = provider()
                    except Exception as e:  # as StatsCollector: a broken provider never breaks stats
                        entry[name] = {"error": f"{type(e).__name__}: {e}"}
        return snap

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting, let the engine drain for up to drain_timeout_s (it aborts the rest), then
        end the engine process. Safe to call again, from any thread (a second call with 0 aborts
        what the first one is still draining)."""
        first = not self._closing
        self._closing = True
        if self._dead is None:
            try:
                self._call("shutdown", max(0.0, drain_timeout_s), wait_s=drain_timeout_s + 30.0)
            except RuntimeError:
                pass
        if not first:
            return
        try:
            self._send(("exit",))
        except RuntimeError:
            pass
        self._proc.join(15)
        if self._proc.is_alive():
            log.warning("the engine process did not exit; killing it")
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)
