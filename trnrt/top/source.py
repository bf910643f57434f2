"""Where `trnrt top` gets its snapshots: the `StatsSource` protocol and its implementations.

- `HttpStatsSource`: `GET <url>/v1/stats` with urllib (stdlib; the dashboard needs no HTTP client
  package and never imports torch).
- `EnginesStatsSource`: several engines' `/v1/stats`, fetched in parallel, one row per engine and
  the total over the reachable ones; an unreachable engine is a row in state "down", not an error.
- `RouterStatsSource`: the engines an SGLang router lists (`GET <router>/workers`), as above.
- `AutoStatsSource`: one URL that may be an engine or a router: `/v1/stats` first; a 404 there and a
  worker list at `/workers` make it a router (sglang-router does not serve `/v1/stats`).
- `FakeStatsSource`: canned snapshots and a fetch counter, for tests.
- `DemoStatsSource`: a real `StatsCollector` driven by synthetic traffic (`trnrt top --demo`).

Sources are called from a worker thread, never from the UI thread.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol, Sequence, runtime_checkable

from trnrt.stats.schema import SchemaError, merge_snapshots, validate_snapshot

DEFAULT_URL = "http://127.0.0.1:30000"


class SourceError(Exception):
    """The stats could not be fetched or understood; the message is shown to the user as is."""


@runtime_checkable
class StatsSource(Protocol):
    """Something that returns /v1/stats snapshots."""

    #: Human-readable origin, shown in the banner ("http://127.0.0.1:30000/v1/stats").
    description: str

    def fetch(self) -> dict:
        """One validated snapshot. Raises SourceError when unreachable or malformed. Thread-safe."""


def stats_url(url: str) -> str:
    """`url` as given if it already names a path ending in /v1/stats, else url + "/v1/stats".

    Accepts "host:port" without a scheme, as people type it.
    """
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url if url.endswith("/v1/stats") else url + "/v1/stats"


def base_url(url: str) -> str:
    """`url` without a trailing `/v1/stats` or `/`, with a scheme ("h:1" -> "http://h:1")."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url[: -len("/v1/stats")] if url.endswith("/v1/stats") else url


def _get_json(url: str, headers: dict, timeout_s: float):
    """GET `url` and parse JSON; every failure is a SourceError (HTTP status kept in `.status`)."""
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        if e.code == 401:
            hint = ("wrong API key" if "Authorization" in headers
                    else "the server needs an API key: --api-key or TRNRT_API_KEY")
            err = SourceError(f"HTTP 401 {e.reason} ({hint})")
        else:
            err = SourceError(f"HTTP {e.code} {e.reason}")
        err.status = e.code  # type: ignore[attr-defined]
        raise err from e
    except urllib.error.URLError as e:
        raise SourceError(str(e.reason)) from e
    except (OSError, ValueError) as e:  # timeouts, resets, a malformed URL
        raise SourceError(str(e) or type(e).__name__) from e
    try:
        return json.loads(body)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise SourceError(f"bad JSON body: {e}") from e


def _headers(api_key: str | None) -> dict:
    h = {"Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


class HttpStatsSource:
    """Fetches snapshots over HTTP with urllib.request.

    `api_key`: sent as `Authorization: Bearer <api_key>` (a server started with --api-key needs it).
    The key is never part of `description` or of an error message.
    """

    def __init__(self, url: str = DEFAULT_URL, timeout_s: float = 2.0, api_key: str | None = None) -> None:
        self.description = stats_url(url)
        self.timeout_s = timeout_s
        self._headers = {"Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def fetch(self) -> dict:
        try:
            doc = _get_json(self.description, self._headers, self.timeout_s)
        except SourceError as e:
            if str(e).startswith("bad JSON body"):
                raise SourceError(f"bad /v1/stats body: {str(e)[len('bad JSON body: '):]}") from e
            raise
        try:
            return validate_snapshot(doc)
        except SchemaError as e:
            raise SourceError(f"bad /v1/stats body: {e}") from e


def _host(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc or url


def down_entry(engine_id: str, url: str, error: str) -> dict:
    """The row of an engine that did not answer: state "down", its error, no figures."""
    return {"id": engine_id, "state": "down", "url": url, "error": error, "info": {}, "live": {},
            "counters": {}, "rates": {}, "latency": {}, "prefix_hit_rate": None}


def combine(entries: list[dict], router: dict | None = None, time_s: float | None = None) -> dict:
    """A /v1/stats document over `entries`: every entry is listed (down ones too, in order); the
    sums, rates and latency cover the reachable ones only (trnrt.stats.merge_snapshots)."""
    ok = [e for e in entries if e.get("state") != "down"]
    snap = merge_snapshots(ok, time_s=time.time() if time_s is None else time_s, router=router)
    snap["engines"] = list(entries)
    return snap


class EnginesStatsSource:
    """The `/v1/stats` of several engines, fetched in parallel: one row per engine, the total.

    Each row's id is the engine's host:port (plus its own id when one URL reports several
    engines), and carries `url`. An engine that fails to answer becomes a `down_entry` row with
    its error: never fatal. All rows down is still a snapshot (the caller decides).
    """

    def __init__(self, urls: Sequence[str], timeout_s: float = 2.0, api_key: str | None = None,
                 description: str | None = None) -> None:
        self.urls = [base_url(u) for u in urls]
        self.timeout_s = timeout_s
        self._headers = _headers(api_key)
        self.description = description or ", ".join(self.urls)
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="top-fetch")

    def _one(self, url: str) -> list[dict]:
        host = _host(url)
        try:
            doc = validate_snapshot(_get_json(url + "/v1/stats", self._headers, self.timeout_s))
        except (SourceError, SchemaError) as e:
            return [down_entry(host, url, str(e))]
        engines = doc.get("engines") or []
        out = []
        for eng in engines:
            eng = dict(eng)
            eng["id"] = host if len(engines) == 1 else f"{host}/{eng.get('id')}"
            eng["url"] = url
            out.append(eng)
        return out

    def entries(self, urls: Sequence[str]) -> list[dict]:
        """One or more rows per URL, in the order given."""
        return [e for rows in self._pool.map(self._one, list(urls)) for e in rows]

    def fetch(self) -> dict:
        return combine(self.entries(self.urls))


def worker_urls(doc) -> list[tuple[str, bool | None]]:
    """(url, healthy) from a router's worker list: sglang-router's `GET /workers`
    (`{"workers": [{"url", "is_healthy", ...}], "total", "stats"}`), the older `/list_workers`
    (`{"urls": [...]}`) or a bare list of URLs."""
    items = doc.get("workers", doc.get("urls")) if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise SourceError("the router's worker list has no 'workers'")
    out = []
    for w in items:
        if isinstance(w, str):
            out.append((w, None))
        elif isinstance(w, dict) and isinstance(w.get("url"), str):
            healthy = w.get("is_healthy", w.get("healthy"))
            out.append((w["url"], healthy if isinstance(healthy, bool) else None))
    return out


class RouterStatsSource:
    """The engines behind an SGLang router: its worker list (`GET /workers`), then each worker's
    `/v1/stats` (EnginesStatsSource). The router unreachable is a SourceError; a worker that does
    not answer is a "down" row. `router` in the snapshot: url, workers, healthy (the router's view).
    """

    def __init__(self, url: str, timeout_s: float = 2.0, api_key: str | None = None) -> None:
        self.url = base_url(url)
        self.description = f"router {self.url}"
        self.timeout_s = timeout_s
        self._headers = _headers(api_key)
        self._engines = EnginesStatsSource([], timeout_s=timeout_s, api_key=api_key)

    def workers(self) -> list[tuple[str, bool | None]]:
        try:
            doc = _get_json(self.url + "/workers", self._headers, self.timeout_s)
        except SourceError as e:
            if getattr(e, "status", None) != 404:
                raise
            doc = _get_json(self.url + "/list_workers", self._headers, self.timeout_s)
        return worker_urls(doc)

    def fetch(self) -> dict:
        workers = self.workers()
        entries = self._engines.entries([u for u, _ in workers])
        health = {base_url(u): h for u, h in workers}
        for e in entries:
            h = health.get(e.get("url"))
            if h is not None:
                e["router_healthy"] = h
        router = {"url": self.url, "workers": len(workers), "healthy": sum(1 for _, h in workers if h)}
        return combine(entries, router=router)


class AutoStatsSource:
    """One URL, an engine or a router: `/v1/stats` first; if that is a 404 and `/workers` is a
    worker list, it is a router from then on (RouterStatsSource). Otherwise the engine's error."""

    def __init__(self, url: str, timeout_s: float = 2.0, api_key: str | None = None) -> None:
        self._http = HttpStatsSource(url, timeout_s=timeout_s, api_key=api_key)
        self._router: RouterStatsSource | None = None
        self._args = (url, timeout_s, api_key)
        self.description = self._http.description

    def fetch(self) -> dict:
        if self._router is not None:
            return self._router.fetch()
        try:
            return self._http.fetch()
        except SourceError as e:
            if getattr(e.__cause__, "status", None) != 404 and getattr(e, "status", None) != 404:
                raise
            router = RouterStatsSource(*self._args)
            try:
                router.workers()
            except SourceError:
                raise e from None  # not a router either: the engine's own error
            self._router = router
            self.description = router.description
            return router.fetch()


class FakeStatsSource:
    """Test double: returns `snapshots` in turn (the last one repeats), or raises while unreachable.

    `snapshots` may also be a callable taking the fetch number (0-based). `fetches` counts calls,
    including failed ones, so tests can check that pausing stops polling.
    """

    def __init__(
        self,
        snapshots: Sequence[dict] | Callable[[int], dict],
        *,
        unreachable: bool = False,
        description: str = "fake://stats",
    ) -> None:
        self._snapshots = snapshots
        self.unreachable = unreachable
        self.description = description
        self.fetches = 0
        self._lock = threading.Lock()

    def fetch(self) -> dict:
        with self._lock:
            n = self.fetches
            self.fetches += 1
        if self.unreachable:
            raise SourceError("connection refused (fake)")
        if callable(self._snapshots):
            return self._snapshots(n)
        return self._snapshots[min(n, len(self._snapshots) - 1)]


class DemoStatsSource:
    """Synthetic traffic through a real StatsCollector, so the dashboard can be tried offline.

    Each fetch advances a simulated clock by `step_s` and replays plausible events (arrivals,
    scheduling, tokens, finishes), which also exercises the collector end to end.
    """

    def __init__(self, engines: int = 2, step_s: float = 1.0, seed: int = 0) -> None:
        from trnrt.stats.collector import StatsCollector
        from trnrt.stats.schema import merge_snapshots

        self.description = "demo (synthetic traffic)"
        self._merge = merge_snapshots
        self._rng = random.Random(seed)
        self._t = 0.0
        self._step = step_s
        self._lock = threading.Lock()
        self._engines = []
        for i in range(engines):
            c = StatsCollector(clock=lambda: self._t, engine_id=f"engine-{i}")
            c.set_engine_info("glm-5.3-flash-demo", preset="batch8", backend="cpu", compiled=True)
            self._engines.append({"c": c, "queue": [], "running": {}, "n": 0})

    def fetch(self) -> dict:
        with self._lock:
            rng = self._rng
            for _ in range(10):  # ten engine steps per fetch, of uneven length like real ones
                self._t += self._step / 10 * rng.uniform(0.6, 1.4)
                for e in self._engines:
                    c = e["c"]
                    # Tokens first, for requests scheduled in an earlier step: a prefill takes a
                    # step, so TTFT is never zero.
                    for rid in list(e["running"]):
                        c.on_tokens(rid, 1)
                        e["running"][rid] -= 1
                        if e["running"][rid] <= 0:
                            del e["running"][rid]
                            kind = "stop" if rng.random() < 0.9 else rng.choice(("length", "abort"))
                            c.on_request_finished(rid, kind, num_cached_tokens=rng.randint(0, 64))
                    for _ in range(rng.choice((0, 0, 0, 0, 0, 1))):
                        rid = f"{c.engine_id}-{e['n']}"
                        e["n"] += 1
                        c.on_request_arrived(rid, rng.randint(20, 400))
                        e["queue"].append(rid)
                    while e["queue"] and len(e["running"]) < 8:
                        rid = e["queue"].pop(0)
                        c.on_request_scheduled(rid)
                        e["running"][rid] = rng.randint(8, 64)
                    c.set_live(running=len(e["running"]), queued=len(e["queue"]),
                               pages_used=16 * len(e["running"]), pages_total=256,
                               slots_used=len(e["running"]), slots_total=8,
                               tokens_in_flight=200 * len(e["running"]))
            return self._merge([e["c"].engine_snapshot() for e in self._engines], time_s=self._t)
