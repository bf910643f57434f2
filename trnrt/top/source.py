"""Where `trnrt top` gets its snapshots: the `StatsSource` protocol and its implementations.

- `HttpStatsSource`: `GET <url>/v1/stats` with urllib (stdlib; the dashboard needs no HTTP client
  package and never imports torch).
- `FakeStatsSource`: canned snapshots and a fetch counter, for tests.
- `DemoStatsSource`: a real `StatsCollector` driven by synthetic traffic (`trnrt top --demo`).

Sources are called from a worker thread, never from the UI thread.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from typing import Callable, Protocol, Sequence, runtime_checkable

from trnrt.stats.schema import SchemaError, validate_snapshot

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
        req = urllib.request.Request(self.description, headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 401:
                hint = ("wrong API key" if "Authorization" in self._headers
                        else "the server needs an API key: --api-key or TRNRT_API_KEY")
                raise SourceError(f"HTTP 401 {e.reason} ({hint})") from e
            raise SourceError(f"HTTP {e.code} {e.reason}") from e
        except urllib.error.URLError as e:
            raise SourceError(str(e.reason)) from e
        except (OSError, ValueError) as e:  # timeouts, resets, a malformed URL
            raise SourceError(str(e) or type(e).__name__) from e
        try:
            return validate_snapshot(json.loads(body))
        except (ValueError, SchemaError) as e:  # json.JSONDecodeError is a ValueError
            raise SourceError(f"bad /v1/stats body: {e}") from e


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
