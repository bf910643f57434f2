"""The `/v1/stats` schema (version 1): its shape, the top-level aggregation, and a light validator.

`trnrt.stats` owns the schema; the server produces it (through `StatsCollector.snapshot()` or, for
a router, `merge_snapshots`) and `trnrt top` consumes it. docs/TOP.md shows an example.

Shape::

    {
      "version": 1,
      "time_s": <unix time of the snapshot>,
      "uptime_s": <longest engine uptime>,
      "engines": [<EngineStats>, ...],          # one per engine; a router lists all of its engines
      "live": {...}, "counters": {...},          # sums over engines
      "rates": {...},                            # sums over engines
      "latency": {...},                          # see merge_latency: exact for one engine
      "prefix_hit_rate": <cached / prompt tokens of finished requests, or null>,
      "speculative": {...}                       # see merge_speculative
    }

Every rate is per second; every latency is in milliseconds; a percentile with no samples is null.
"""

from __future__ import annotations

from typing import Literal, Sequence, TypedDict

SCHEMA_VERSION = 1

FINISH_TYPES: tuple[str, ...] = ("stop", "length", "abort", "error")
FinishType = Literal["stop", "length", "abort", "error"]

# Rate windows: key -> seconds (None: since start).
RATE_WINDOWS: dict[str, float | None] = {"1m": 60.0, "5m": 300.0, "15m": 900.0, "since_start": None}
RATE_KEYS: tuple[str, ...] = (
    "requests_arrived_per_s",
    "requests_finished_per_s",
    "prompt_tokens_per_s",
    "generation_tokens_per_s",
)
LATENCY_KEYS: tuple[str, ...] = ("ttft_ms", "itl_ms", "e2e_ms", "queue_ms")
QUANTILES: tuple[int, ...] = (50, 90, 99)
LIVE_KEYS: tuple[str, ...] = (
    "running",
    "queued",
    "pages_used",
    "pages_total",
    "slots_used",
    "slots_total",
    "tokens_in_flight",
)
# Speculative decoding counters (the `speculative` section): verify passes (sequences verified),
# draft tokens proposed, draft tokens accepted. Windows: RATE_WINDOWS but since_start (the
# section's own figures are since start).
SPEC_COUNTER_KEYS: tuple[str, ...] = ("num_verifies", "num_draft_tokens", "num_accepted_tokens")
SPEC_WINDOWS: tuple[str, ...] = tuple(k for k, w in RATE_WINDOWS.items() if w is not None)


class LatencySummary(TypedDict):
    p50: float | None
    p90: float | None
    p99: float | None
    count: int  # samples in the window
    mean: float | None
    total_count: int  # samples since start (Prometheus summary _count)
    total_sum_s: float  # their sum, in seconds (Prometheus summary _sum)


class EngineInfo(TypedDict, total=False):
    model: str
    served_model_name: str
    preset: str
    backend: str
    compiled: bool
    version: str
    started_at_s: float  # unix time
    uptime_s: float


class EngineStats(TypedDict):
    id: str
    state: str  # "ok" (a router may report "stale" or "down")
    info: EngineInfo
    live: dict  # LIVE_KEYS -> int
    counters: dict  # see StatsCollector.snapshot
    rates: dict  # RATE_WINDOWS key -> {RATE_KEYS -> float}
    latency: dict  # {"window_s": float, LATENCY_KEYS -> LatencySummary}
    prefix_hit_rate: float | None
    # The last finished requests (StatsCollector(recent_requests=20)), oldest first: finished_at_s
    # (unix), finish_reason, prompt/output/cached token counts and queue/TTFT/ITL/E2E in ms (None
    # when unknown). Numbers only: never an id or any text.
    recent_requests: list
    speculative: dict  # see speculative_section; `enabled` false when speculative decoding is off


class SchemaError(ValueError):
    """A document is not a /v1/stats snapshot this code understands."""


def _sum_dicts(dicts: Sequence[dict]) -> dict:
    """Element-wise sum of nested dicts of numbers (keys from the first; missing counts as 0)."""
    if not dicts:
        return {}
    out: dict = {}
    for key, val in dicts[0].items():
        if isinstance(val, dict):
            out[key] = _sum_dicts([d.get(key) or {} for d in dicts])
        elif isinstance(val, bool) or not isinstance(val, (int, float)):
            out[key] = val
        else:
            out[key] = sum((d.get(key) or 0) for d in dicts)
    return out


def merge_latency(latencies: Sequence[dict]) -> dict:
    """Aggregate per-engine latency summaries.

    With one engine this is that engine's summary, exactly. Percentiles of several engines cannot
    be combined from their summaries, so each aggregate percentile is the worst (largest) engine's:
    an upper bound, which is what an operator watching for slow requests wants. `count` sums and
    `mean` is count-weighted, both exact.
    """
    if len(latencies) == 1:
        return latencies[0]
    if not latencies:
        return {"window_s": None, **{k: _empty_summary() for k in LATENCY_KEYS}}
    out: dict = {"window_s": max((lat.get("window_s") or 0) for lat in latencies)}
    for key in LATENCY_KEYS:
        sums = [lat.get(key) or _empty_summary() for lat in latencies]
        merged: dict = {}
        for q in QUANTILES:
            vals = [s.get(f"p{q}") for s in sums if s.get(f"p{q}") is not None]
            merged[f"p{q}"] = max(vals) if vals else None
        count = sum(s.get("count") or 0 for s in sums)
        merged["count"] = count
        weighted = sum((s.get("mean") or 0.0) * (s.get("count") or 0) for s in sums)
        merged["mean"] = weighted / count if count else None
        merged["total_count"] = sum(s.get("total_count") or 0 for s in sums)
        merged["total_sum_s"] = sum(s.get("total_sum_s") or 0.0 for s in sums)
        out[key] = merged
    return out


def _empty_summary() -> dict:
    return {**{f"p{q}": None for q in QUANTILES}, "count": 0, "mean": None, "total_count": 0, "total_sum_s": 0.0}


def spec_ratios(num_verifies: int, num_draft_tokens: int, num_accepted_tokens: int) -> dict:
    """{"accept_rate", "avg_accept_length"} of speculative-decoding counts.

    accept_rate = accepted / draft tokens; avg_accept_length = (accepted + verifies) / verifies,
    the tokens one verify emits (SGLang's `avg_spec_accept_length`: the accepted drafts plus the
    bonus or correction token, so 1.0 means no draft accepted). None when the denominator is 0
    (nothing verified yet), never a made-up 0.
    """
    return {
        "accept_rate": num_accepted_tokens / num_draft_tokens if num_draft_tokens else None,
        "avg_accept_length": (num_accepted_tokens + num_verifies) / num_verifies if num_verifies else None,
    }


def speculative_section(algorithm: str | None, num_steps: int, counts: dict, accepted_per_position: Sequence[int],
                        windows: dict | None = None) -> dict:
    """The `speculative` section of an engine entry (and, through merge_speculative, of the top level).

    `counts`: SPEC_COUNTER_KEYS -> int since start; `windows`: SPEC_WINDOWS key -> such counts over
    that window (None: all zero). With `algorithm` None (speculative decoding off) the section still
    has every key, `enabled` false with zeros and nulls, so a client can read it unconditionally.
    """
    def block(c: dict) -> dict:
        vals = {k: int(c.get(k) or 0) for k in SPEC_COUNTER_KEYS}
        return {**vals, **spec_ratios(*(vals[k] for k in SPEC_COUNTER_KEYS))}

    windows = windows or {}
    return {
        "enabled": algorithm is not None,
        "algorithm": algorithm,
        "num_steps": int(num_steps),
        **block(counts),
        "accepted_per_position": [int(v) for v in accepted_per_position],
        "windows": {w: block(windows.get(w) or {}) for w in SPEC_WINDOWS},
    }


def merge_speculative(sections: Sequence[dict | None]) -> dict:
    """The top-level `speculative` section over engine sections (missing or None: off).

    enabled: any engine has it on; algorithm: the first enabled engine's; num_steps: the largest;
    counts (since start, per window, per position) summed; the ratios recomputed from the sums.
    One engine gives exactly its own section.
    """
    on = [s for s in sections if isinstance(s, dict) and s.get("enabled")]
    if not on:
        return speculative_section(None, 0, {}, [])
    positions = max(len(s.get("accepted_per_position") or []) for s in on)
    per_pos = [0] * positions
    for s in on:
        for j, v in enumerate(s.get("accepted_per_position") or []):
            per_pos[j] += int(v or 0)

    def total(get) -> dict:
        return {k: sum(int((get(s) or {}).get(k) or 0) for s in on) for k in SPEC_COUNTER_KEYS}

    return speculative_section(
        on[0].get("algorithm"), max(int(s.get("num_steps") or 0) for s in on), total(lambda s: s), per_pos,
        {w: total(lambda s, w=w: (s.get("windows") or {}).get(w)) for w in SPEC_WINDOWS},
    )


def merge_snapshots(engines: Sequence[EngineStats], time_s: float, router: dict | None = None) -> dict:
    """Build a top-level snapshot from engine entries (one for `trnrt serve`, N behind a router).

    Live state, counters and rates are sums over engines; latency follows `merge_latency`; the
    prefix hit rate is recomputed from summed token counters (token-level, like vLLM and SGLang);
    `speculative` follows `merge_speculative`.
    """
    engines = list(engines)
    counters = _sum_dicts([e["counters"] for e in engines])
    snap: dict = {
        "version": SCHEMA_VERSION,
        "time_s": time_s,
        "uptime_s": max((e["info"].get("uptime_s") or 0.0) for e in engines) if engines else 0.0,
        "engines": engines,
        "live": _sum_dicts([e["live"] for e in engines]),
        "counters": counters,
        "rates": _sum_dicts([e["rates"] for e in engines]),
        "latency": merge_latency([e["latency"] for e in engines]),
        "prefix_hit_rate": hit_rate(counters),
        "speculative": merge_speculative([e.get("speculative") for e in engines]),
    }
    if router is not None:
        snap["router"] = router
    return snap


def hit_rate(counters: dict) -> float | None:
    """Prefix-cache hit rate over tokens: cached / prompt tokens of finished requests (None if none)."""
    denom = counters.get("finished_prompt_tokens") or 0
    return (counters.get("cached_tokens") or 0) / denom if denom else None


def validate_snapshot(doc: object) -> dict:
    """Check that `doc` is a version-1 snapshot with the keys `trnrt top` reads; return it.

    Light on purpose: readers tolerate extra keys (newer servers add fields without a version bump)
    and missing optional ones; only a wrong version or a missing skeleton is an error.
    """
    if not isinstance(doc, dict):
        raise SchemaError(f"expected a JSON object, got {type(doc).__name__}")
    version = doc.get("version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"unsupported stats schema version {version!r} (this trnrt reads {SCHEMA_VERSION})")
    engines = doc.get("engines")
    if not isinstance(engines, list):
        raise SchemaError("'engines' must be a list")
    for i, eng in enumerate(engines):
        if not isinstance(eng, dict) or "id" not in eng:
            raise SchemaError(f"engines[{i}] must be an object with an 'id'")
    for key in ("live", "counters", "rates", "latency"):
        if not isinstance(doc.get(key), dict):
            raise SchemaError(f"'{key}' must be an object")
    return doc
