"""The production log (opt-in, `TRNRT_PROD_DIR`): one JSON line per finished request, and gauges.

Each line is a JSON object with a `type`:

- `"request"`: one per finished engine request that came in over HTTP: `request_id`, `route`,
  `choice` / `choices` (a request with n choices gives n lines), `stream`, `engine`,
  `finish_reason`, `prompt_tokens`, `output_tokens`, `cached_tokens`, `queue_ms`, `ttft_ms`,
  `itl_ms` (mean), `e2e_ms`, `time_s` (unix, at the finish). Numbers and ids only: never prompt
  or output text (nothing here ever sees it).
- `"gauges"`: every `gauges_interval_s`, per engine: `live`, `counters`, the 1-minute `rates`,
  latency percentiles and the prefix hit rate (from `/v1/stats`).

A request whose body has `"no_logs": true` (SGLang's field) is left out. The timings come from
the engine's `StatsCollector` (a finish listener, on the engine thread), the route and ids from
the HTTP request's close (`handlers/base.py`); the line is written when both are in, whichever
comes second. Writing happens on a background thread (the engine thread only puts a line on a
bounded queue; a full queue drops lines, counted in `dropped`). Files: `<dir>/trnrt-prod-<pid>.jsonl`,
rotated by size: at `max_bytes` the file becomes `.1` (`.1` becomes `.2`, ...), `backups` old
files kept, so the directory holds at most about `(backups + 1) * max_bytes` per process.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

log = logging.getLogger("trnrt.serve.prod_log")

_STOP = object()


class RotatingJsonl:
    """Append-only JSON lines with size-bounded rotation (not thread-safe: one writer thread)."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = Path(path)
        self.max_bytes = max(1024, int(max_bytes))
        self.backups = max(0, int(backups))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        self._size = self._f.tell()

    def write(self, line: bytes) -> None:
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        self._f.write(line)
        self._f.flush()
        self._size += len(line)

    def _rotate(self) -> None:
        self._f.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._f = open(self.path, "ab")
        self._size = 0

    def close(self) -> None:
        self._f.close()


def gauges_record(snapshot: dict, now: float) -> dict:
    """The `gauges` line: per engine, figures only."""
    engines = []
    for e in snapshot.get("engines") or []:
        lat = e.get("latency") or {}
        engines.append({
            "engine": e.get("id"),
            "state": e.get("state"),
            "live": e.get("live"),
            "counters": e.get("counters"),
            "rates_1m": (e.get("rates") or {}).get("1m"),
            "latency_ms": {k: {q: (lat.get(k) or {}).get(q) for q in ("p50", "p90", "p99", "count")}
                           for k in ("ttft_ms", "itl_ms", "e2e_ms", "queue_ms")},
            "prefix_hit_rate": e.get("prefix_hit_rate"),
        })
    return {"type": "gauges", "time_s": round(now, 3), "uptime_s": snapshot.get("uptime_s"), "engines": engines}


_ENGINE_FIELDS = ("engine", "finish_reason", "prompt_tokens", "output_tokens", "cached_tokens", "queue_ms",
                  "ttft_ms", "itl_ms", "e2e_ms")


class ProdLog:
    """The production log of one server process (see the module docstring).

    `stats`: returns the /v1/stats document, for the gauges (None: no gauges lines).
    `pending_cap`: half-joined records kept at most per side (a request's engine finish waiting
    for its HTTP close or the other way round); the oldest are dropped beyond it.
    """

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int = 64 << 20, backups: int = 4,
                 gauges_interval_s: float = 10.0, stats: Callable[[], dict] | None = None,
                 wall_clock: Callable[[], float] = time.time, pending_cap: int = 4096,
                 queue_size: int = 10000, collector=None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / f"trnrt-prod-{os.getpid()}.jsonl"
        self._out = RotatingJsonl(self.path, max_bytes, backups)
        self._stats = stats
        self._wall = wall_clock
        self._gauges_s = gauges_interval_s
        self._cap = pending_cap
        self._lock = threading.Lock()
        self._engine_side: OrderedDict[str, dict] = OrderedDict()  # rid -> engine record
        self._http_side: OrderedDict[str, dict | None] = OrderedDict()  # rid -> meta (None: keep out)
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.written = 0
        self.dropped = 0
        self.skipped = 0  # requests kept out (no_logs, or not from an HTTP route)
        self._closed = False
        # The engine's StatsCollector: its finish listener gives the timings. Without one, lines
        # carry the HTTP side only.
        self._collector = collector if hasattr(collector, "add_finish_listener") else None
        if self._collector is not None:
            self._collector.add_finish_listener(self.on_engine_finish)
        self._thread = threading.Thread(target=self._run, name="trnrt-prod-log", daemon=True)
        self._thread.start()

    @classmethod
    def for_server(cls, engine, settings) -> "ProdLog | None":
        """The server's log when `settings.prod_dir` is set: listens to the engine's collector."""
        if not settings.prod_dir:
            return None
        plog = cls(settings.prod_dir, max_bytes=int(settings.prod_max_mb * (1 << 20)),
                   backups=settings.prod_backups, gauges_interval_s=settings.prod_gauges_s,
                   stats=getattr(engine, "stats", None), collector=getattr(engine, "stats_collector", None))
        log.info("production log: %s (rotated at %.0f MB, %d backups)", plog.path, settings.prod_max_mb,
                 settings.prod_backups)
        return plog

    # ---- the two halves of a record ---------------------------------------------------------------

    def on_engine_finish(self, rec: dict) -> None:
        """StatsCollector finish listener (engine thread): quick, never blocks."""
        rid = rec.get("request_id")
        with self._lock:
            if rid in self._http_side:
                meta = self._http_side.pop(rid)
            else:
                self._engine_side[rid] = rec
                self._trim(self._engine_side)
                return
        if meta is None:
            self.skipped += 1
        else:
            self._emit(meta, rec)

    def on_request_closed(self, route: str | None, request_ids: list[str], *, no_logs: bool = False,
                          stream: bool | None = None) -> None:
        """An HTTP request's engine requests are done with (handlers/base.py, Submitted.close).
        `route` None (an internal probe) or `no_logs` keeps them out of the log."""
        keep = route is not None and not no_logs
        n = len(request_ids)
        ready = []
        with self._lock:
            for i, rid in enumerate(request_ids):
                meta = {"request_id": rid, "route": route, "choice": i, "choices": n, "stream": stream} if keep else None
                if self._collector is None:
                    ready.append((meta, {}))
                elif rid in self._engine_side:
                    ready.append((meta, self._engine_side.pop(rid)))
                else:
                    self._http_side[rid] = meta
                    self._trim(self._http_side)
        for meta, rec in ready:
            if meta is None:
                self.skipped += 1
            else:
                self._emit(meta, rec)

    def _trim(self, d: OrderedDict) -> None:
        while len(d) > self._cap:
            d.popitem(last=False)

    def _emit(self, meta: dict, rec: dict) -> None:
        line = {"type": "request", "time_s": rec.get("finished_at_s", round(self._wall(), 3)), **meta}
        for k in _ENGINE_FIELDS:
            line[k] = rec.get(k)
        self._put(line)

    def _put(self, obj: dict) -> None:
        try:
            self._q.put_nowait(obj)
        except queue.Full:
            self.dropped += 1

    # ---- writer thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        next_gauges = time.monotonic() + self._gauges_s
        while True:
            timeout = max(0.0, next_gauges - time.monotonic()) if self._stats else None
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = None
            try:
                if item is _STOP:
                    return
                if item is not None:
                    self._write(item)
                if self._stats is not None and time.monotonic() >= next_gauges:
                    next_gauges = time.monotonic() + self._gauges_s
                    self.write_gauges()
            except Exception:  # a full disk must not kill the thread silently
                log.exception("production log write failed")
            finally:
                if item is not None:
                    self._q.task_done()

    def _write(self, obj: dict) -> None:
        self._out.write((json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"))
        self.written += 1

    def write_gauges(self) -> None:
        """One `gauges` line now (writer thread; tests call it through flush)."""
        if self._stats is not None:
            self._write(gauges_record(self._stats(), self._wall()))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued line is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._q.unfinished_tasks

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._collector is not None:
            self._collector.remove_finish_listener(self.on_engine_finish)
        self.flush()
        self._q.put(_STOP)
        self._thread.join(5.0)
        self._out.close()
