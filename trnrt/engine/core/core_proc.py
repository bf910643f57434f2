"""The engine core in its own process (SGLang's scheduler process, vLLM's EngineCoreProc).

`trnrt serve` runs the Engine (scheduler, runner, detokenizer) here and the HTTP server in the
parent, so that the HTTP threads' Python work (chat rendering, tokenization, SSE chunks) never
waits for, or delays, the engine thread on one GIL. The parent talks to it through
trnrt.engine.core.mp_client.MPEngineClient; the wire format is trnrt.engine.core.ipc's.

Threads here: the engine thread (steps; it also sends the outputs of each loop turn, one message
per turn, from `Engine.flush_outputs`), the main thread (reads the parent's messages in order:
submits and aborts are handled inline, so an abort never overtakes the submit it follows), and a
small pool for the calls that may wait (shutdown drains, a deferred flush_cache, abort_requests).

Lifetime: the parent's pipe closing (the parent exited or died) shuts the engine down at once and
ends the process. SIGINT and SIGTERM are ignored here: the parent owns the drain (a Ctrl-C reaches
the whole process group) and tells this process when to stop.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

from trnrt.engine.core.ipc import CALLABLE_METHODS, pack_exception
from trnrt.engine.output.stream import OutputStream

log = logging.getLogger("trnrt.engine.core")


class _Sender:
    """One lock around the pipe's write end: the engine thread, the main thread and the pool send."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()
        self.broken = False

    def send(self, msg) -> None:
        if self.broken:
            return
        try:
            with self.lock:
                self.conn.send(msg)
        except (OSError, EOFError, BrokenPipeError):
            self.broken = True  # the parent is gone; the main thread sees EOF and stops the engine


class Outbox:
    """Outputs the engine thread put during one loop turn, sent together by `flush` (engine thread)."""

    def __init__(self, sender: _Sender, engine):
        self.sender = sender
        self.engine = engine
        self.items: list = []
        self.records: list = []
        self._last_load = None

    def add(self, request_id: str, output) -> None:
        self.items.append((request_id, output))

    def flush(self) -> None:
        load = None
        current = self.engine._load  # published after each step and each idle turn (one reference)
        if current != self._last_load:  # sent when it changed, not every idle turn
            self._last_load = current
            load = self.engine.load()
        if not self.items and load is None and not self.records:
            return
        items, self.items = self.items, []
        if items or load is not None:
            self.sender.send(("out", items, load))
        if self.records:
            records, self.records = self.records, []
            for rec in records:
                self.sender.send(("record", rec))


class _ForwardQueue:
    """Stands in for OutputStream's queue: what the engine delivers goes to the outbox."""

    __slots__ = ("outbox", "request_id")

    def __init__(self, outbox: Outbox, request_id: str):
        self.outbox = outbox
        self.request_id = request_id

    def put(self, output) -> None:
        self.outbox.add(self.request_id, output)


def forwarding_stream_factory(outbox: Outbox):
    """Engine.stream_factory for an engine whose clients live in another process: the stream's
    delivery interval (and merging) is the engine's as usual, its deliveries go to the outbox."""

    def make(request_id: str, interval: int) -> OutputStream:
        stream = OutputStream(request_id, interval)
        stream._queue = _ForwardQueue(outbox, request_id)
        return stream

    return make


def _info(engine) -> dict:
    """What the parent needs without asking: the model, the flags the serve layer reads."""
    return {
        "model_info": engine.model_info,
        "startup_time_s": engine.startup_time_s,
        "prompt_logprobs": bool(getattr(engine, "prompt_logprobs", False)),
        "penalties": bool(getattr(engine, "penalties", False)),
        "stream_interval": getattr(engine, "stream_interval", 1),
    }


def run_engine_core(requests_conn, outputs_conn, factory, factory_args: tuple, log_level: int) -> None:
    """The process's target: build the engine with `factory(*factory_args)` (an object with the
    Engine's interface), then serve the parent's messages until told to exit or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sender = _Sender(outputs_conn)
    try:
        engine = factory(*factory_args)
    except BaseException as e:  # reported to the parent, which fails its start with it
        log.debug("engine construction failed", exc_info=True)
        sender.send(("failed", pack_exception(e)))
        return
    outbox = Outbox(sender, engine)
    engine.stream_factory = forwarding_stream_factory(outbox)
    engine.flush_outputs = outbox.flush
    sender.send(("ready", _info(engine)))
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="trnrt-core-call")

    def submit(reqs) -> None:  # the streams stay here (they forward to the outbox); the answer is "queued"
        engine.submit_many(reqs)

    def reply(call_id, fn, *args, **kwargs):
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:
            sender.send(("reply", call_id, False, pack_exception(e)))
        else:
            sender.send(("reply", call_id, True, value))

    try:
        while True:
            try:
                msg = requests_conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            kind = msg[0]
            if kind == "submit":
                _, call_id, reqs = msg
                reply(call_id, submit, reqs)
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "call":
                _, call_id, method, args, kwargs = msg
                if method not in CALLABLE_METHODS:
                    sender.send(("reply", call_id, False, pack_exception(AttributeError(method))))
                else:
                    pool.submit(reply, call_id, getattr(engine, method), *args, **kwargs)
            elif kind == "finish_records":
                collector = getattr(engine, "stats_collector", None)
                if collector is not None:
                    collector.add_finish_listener(outbox.records.append)
            elif kind == "exit":
                break
    finally:
        try:
            engine.shutdown(0.0)
        except Exception:
            log.exception("engine shutdown failed")
        pool.shutdown(wait=False, cancel_futures=True)
        try:
            outputs_conn.close()
        except OSError:
            pass
