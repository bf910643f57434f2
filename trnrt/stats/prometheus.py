"""Render a /v1/stats snapshot in the Prometheus text format (`GET /metrics`).

The same figures as the snapshot, one time series per engine (label `engine`, plus `model`):
gauges for live state, `_total` counters, summaries (`quantile` labels over the recent window,
cumulative `_sum` / `_count` in seconds) for latency, and the windowed rates as gauges with a
`window` label. Prometheus users normally derive rates with `rate()` from the counters; the rate
gauges are there so a scrape shows what `trnrt top` shows.

Speculative decoding: vLLM's counters under this module's prefix (`trnrt_spec_decode_num_drafts`
= verifies, `_num_draft_tokens`, `_num_accepted_tokens`, `_num_accepted_tokens_per_pos{position}`)
and SGLang's gauges (`trnrt_spec_accept_length`, `trnrt_spec_accept_rate`, since start here),
only for engines whose `speculative.enabled` is true: a server without it shows no spec series, as
vLLM shows none without a speculative config.

Tensor parallelism: `trnrt_tp_size` and `trnrt_ep_size` for every engine (1 and 1 without TP);
with an engine's `parallel` section (TP > 1) the steps' and their collectives' seconds and counts as
counters (`rate(trnrt_tp_collective_seconds_total) / rate(trnrt_tp_steps_total)` is the collectives'
seconds per step, over `rate(trnrt_tp_step_seconds_total)` their share of the step), the latest
step's collective seconds, and `trnrt_tp_rank_memory_bytes{rank, kind}`.

Two ways in, both fed by a snapshot (so /metrics and /v1/stats always agree):

    body = to_prometheus(collector.snapshot())                 # bytes, CONTENT_TYPE

    registry = CollectorRegistry()                              # or plug into a registry
    registry.register(SnapshotCollector(collector.snapshot))
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from trnrt.stats.schema import FINISH_TYPES, LIVE_KEYS, QUANTILES, RATE_KEYS

PREFIX = "trnrt"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LIVE_HELP = {
    "running": ("requests_running", "Requests holding a slot and being processed."),
    "queued": ("requests_queued", "Requests waiting to be scheduled."),
    "pages_used": ("kv_pages_used", "KV-cache pages in use."),
    "pages_total": ("kv_pages_total", "KV-cache pages in the pool."),
    "slots_used": ("slots_used", "Per-sequence state slots in use."),
    "slots_total": ("slots_total", "Per-sequence state slots in the pool."),
    "tokens_in_flight": ("tokens_in_flight", "Tokens held in the KV cache by running requests."),
}
_COUNTERS = {
    # snapshot counter key -> (metric name without _total, help)
    "requests_arrived": ("requests_arrived", "Requests admitted into the queue."),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of admitted requests."),
    "cached_tokens": ("cached_tokens", "Prompt tokens served from the prefix cache."),
    "generation_tokens": ("generation_tokens", "Output tokens generated."),
    "errors": ("request_errors", "Requests that failed inside the engine."),
    "aborts": ("request_aborts", "Requests aborted (client gone or admin)."),
    "preemptions": ("preemptions", "Times a running request lost its slot."),
}
_LATENCY = {
    "ttft_ms": ("time_to_first_token_seconds", "Time from arrival to the first output token."),
    "itl_ms": ("inter_token_latency_seconds", "Time between output tokens of a request."),
    "e2e_ms": ("e2e_request_latency_seconds", "Time from arrival to finish (stop or length)."),
    "queue_ms": ("request_queue_time_seconds", "Time from arrival to first scheduling."),
}
_RATES = {
    "requests_arrived_per_s": ("requests_arrived_per_second", "Request arrival rate over a window."),
    "requests_finished_per_s": ("requests_finished_per_second", "Request completion rate over a window."),
    "prompt_tokens_per_s": ("prompt_tokens_per_second", "Prompt token rate over a window."),
    "generation_tokens_per_s": ("generation_tokens_per_second", "Output token rate over a window."),
}


def metric_families(snapshot: dict) -> Iterator[Metric]:
    """Prometheus metric families for every engine in `snapshot` (a /v1/stats document)."""
    engines = snapshot.get("engines") or []
    base = ["engine", "model"]

    def labels(eng: dict) -> list[str]:
        info = eng.get("info") or {}
        return [str(eng.get("id", "")), str(info.get("served_model_name") or info.get("model") or "")]

    info = InfoMetricFamily(f"{PREFIX}_engine", "Static facts about each engine.", labels=["engine"])
    up = GaugeMetricFamily(f"{PREFIX}_uptime_seconds", "Seconds since the engine's stats began.", labels=base)
    for eng in engines:
        i = eng.get("info") or {}
        info.add_metric(
            [str(eng.get("id", ""))],
            {k: str(i.get(k, "")).lower() if k == "compiled" else str(i.get(k, ""))
             for k in ("model", "served_model_name", "preset", "backend", "compiled", "version")},
        )
        up.add_metric(labels(eng), float(i.get("uptime_s") or 0.0))
    yield info
    yield up

    for key in LIVE_KEYS:
        name, doc = _LIVE_HELP[key]
        g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=base)
        for eng in engines:
            g.add_metric(labels(eng), float((eng.get("live") or {}).get(key) or 0))
        yield g

    fin = CounterMetricFamily(f"{PREFIX}_requests_finished", "Finished requests by finish reason.",
                              labels=base + ["finish_reason"])
    for eng in engines:
        by = (eng.get("counters") or {}).get("requests_finished") or {}
        for reason in FINISH_TYPES:
            fin.add_metric(labels(eng) + [reason], float(by.get(reason) or 0))
    yield fin
    for key, (name, doc) in _COUNTERS.items():
        c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=base)
        for eng in engines:
            c.add_metric(labels(eng), float((eng.get("counters") or {}).get(key) or 0))
        yield c

    for key, (name, doc) in _LATENCY.items():
        # prometheus_client's SummaryMetricFamily has no quantile samples, so build it by hand.
        m = Metric(f"{PREFIX}_{name}", doc + " Quantiles over the recent window.", "summary")
        for eng in engines:
            s = (eng.get("latency") or {}).get(key) or {}
            lab = dict(zip(base, labels(eng)))
            for q in QUANTILES:
                v = s.get(f"p{q}")
                # No samples: NaN, as prometheus_client's own summaries report empty quantiles.
                m.add_sample(m.name, {**lab, "quantile": _quantile_label(q)},
                             math.nan if v is None else v / 1000.0)
            m.add_sample(m.name + "_count", lab, float(s.get("total_count") or 0))
            m.add_sample(m.name + "_sum", lab, float(s.get("total_sum_s") or 0.0))
        yield m

    for key in RATE_KEYS:
        name, doc = _RATES[key]
        g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=base + ["window"])
        for eng in engines:
            for window, rates in (eng.get("rates") or {}).items():
                g.add_metric(labels(eng) + [window], float((rates or {}).get(key) or 0.0))
        yield g

    yield from _spec_families(engines, base, labels)
    yield from _parallel_families(engines, base, labels)

    hit = GaugeMetricFamily(f"{PREFIX}_prefix_cache_hit_ratio",
                            "Cached / prompt tokens of finished requests.", labels=base)
    for eng in engines:
        r = eng.get("prefix_hit_rate")
        hit.add_metric(labels(eng), math.nan if r is None else float(r))
    yield hit


_SPEC_COUNTERS = {
    # speculative section key -> (vLLM's metric name without its prefix and _total, help)
    "num_verifies": ("spec_decode_num_drafts", "Speculative verifies: sequences whose drafts were verified."),
    "num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}
_SPEC_GAUGES = {
    "avg_accept_length": ("spec_accept_length",
                          "Tokens emitted per verify since start: accepted drafts + the bonus token."),
    "accept_rate": ("spec_accept_rate", "Accepted / proposed draft tokens since start."),
}


def _section_counters(table: dict, on: list, base: list[str], labels: Callable[[dict], list[str]]) -> Iterator[Metric]:
    """One counter family per `table` entry (section key -> (name, help)) over `on`'s
    (engine, section) pairs; a missing value counts 0."""
    for key, (name, doc) in table.items():
        c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=base)
        for eng, section in on:
            c.add_metric(labels(eng), float(section.get(key) or 0))
        yield c


def _spec_families(engines: list, base: list[str], labels: Callable[[dict], list[str]]) -> Iterator[Metric]:
    """Speculative-decoding families over the engines that have it on; nothing when none has."""
    on = [(e, e["speculative"]) for e in engines
          if isinstance(e.get("speculative"), dict) and e["speculative"].get("enabled")]
    if not on:
        return
    yield from _section_counters(_SPEC_COUNTERS, on, base, labels)
    per_pos = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                  "Sequences that accepted the draft at each position (0: the first draft).",
                                  labels=base + ["position"])
    for eng, spec in on:
        for j, v in enumerate(spec.get("accepted_per_position") or []):
            per_pos.add_metric(labels(eng) + [str(j)], float(v or 0))
    yield per_pos
    for key, (name, doc) in _SPEC_GAUGES.items():
        g = GaugeMetricFamily(f"{PREFIX}_{name}", doc + " NaN before the first verify.", labels=base)
        for eng, spec in on:
            v = spec.get(key)
            g.add_metric(labels(eng), math.nan if v is None else float(v))
        yield g


_PARALLEL_COUNTERS = {
    # parallel section key -> (metric name without _total, help)
    "steps": ("tp_steps", "Engine steps run by the tensor-parallel ranks."),
    "step_s_total": ("tp_step_seconds", "Wall seconds of those steps on rank 0 (broadcast, forward, sampling)."),
    "collective_s_total": ("tp_collective_seconds",
                           "Wall seconds rank 0 spent in the model's collectives during steps (issue to wait)."),
    "collective_calls_total": ("tp_collectives", "Model collectives rank 0 issued during steps."),
}
_RANK_MEMORY = {"rss_bytes": "rss", "weight_bytes": "weights", "state_bytes": "state",
                "cache_tier_bytes": "cache_tiers"}


def _parallel_families(engines: list, base: list[str], labels: Callable[[dict], list[str]]) -> Iterator[Metric]:
    """`trnrt_tp_size` / `trnrt_ep_size` for every engine (1 without a `parallel` section); the
    collectives' seconds and the ranks' memory only for engines with one (TP > 1)."""
    sections = [(e, e.get("parallel") if isinstance(e.get("parallel"), dict) else {}) for e in engines]
    for key, name, doc in (("tp_size", "tp_size", "Tensor-parallel ranks of the engine (1: no tensor parallelism)."),
                           ("ep_size", "ep_size", "Expert-parallel degree of the engine's MoE layers.")):
        g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=base)
        for eng, par in sections:
            g.add_metric(labels(eng), float(par.get(key) or 1))
        yield g
    on = [(e, p) for e, p in sections if "steps" in p]
    if not on:
        return
    yield from _section_counters(_PARALLEL_COUNTERS, on, base, labels)
    last = GaugeMetricFamily(f"{PREFIX}_tp_collective_seconds_last_step",
                             "Wall seconds of the model's collectives in rank 0's latest step (NaN before one).",
                             labels=base)
    for eng, par in on:
        v = par.get("collective_s_last_step")
        last.add_metric(labels(eng), math.nan if v is None else float(v))
    yield last
    mism = CounterMetricFamily(f"{PREFIX}_tp_agreement_mismatches",
                               "Agreement checks in which the ranks' sampled-token digests differed.", labels=base)
    for eng, par in on:
        mism.add_metric(labels(eng), float((par.get("agreement") or {}).get("mismatches") or 0))
    yield mism
    mem = GaugeMetricFamily(f"{PREFIX}_tp_rank_memory_bytes",
                            "A rank's memory by kind: process RSS, weights, state, cache tiers (rank 0 now; "
                            "the others as of the last agreement check).", labels=base + ["rank", "kind"])
    for eng, par in on:
        for r in par.get("ranks") or []:
            for key, kind in _RANK_MEMORY.items():
                if r.get(key) is not None:
                    mem.add_metric(labels(eng) + [str(r.get("rank")), kind], float(r[key]))
    yield mem


def _quantile_label(q: int) -> str:
    return str(q / 100.0)  # 50 -> "0.5", 99 -> "0.99"


class SnapshotCollector:
    """A prometheus_client custom collector: each scrape calls `snapshot_fn()` and renders it."""

    def __init__(self, snapshot_fn: Callable[[], dict]) -> None:
        self._snapshot_fn = snapshot_fn

    def collect(self) -> Iterator[Metric]:
        yield from metric_families(self._snapshot_fn())

    def describe(self) -> list:
        # Returning [] stops CollectorRegistry.register from calling collect() at registration.
        return []


def to_prometheus(snapshot: dict) -> bytes:
    """The Prometheus text exposition (format 0.0.4) of `snapshot`; serve it with CONTENT_TYPE."""
    from prometheus_client.exposition import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry)
