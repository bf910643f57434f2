"""/metrics text: parses with prometheus_client's parser and carries the snapshot's figures."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trnrt.stats import StatsCollector, merge_snapshots
from trnrt.stats.prometheus import CONTENT_TYPE, SnapshotCollector, to_prometheus


def _collector(engine_id: str, t: list[float]) -> StatsCollector:
    c = StatsCollector(clock=lambda: t[0], engine_id=engine_id)
    c.set_engine_info("glm-5.3-flash", preset="default", backend="cpu", compiled=False)
    return c


@pytest.fixture
def snapshot():
    t = [0.0]
    e0, e1 = _collector("e0", t), _collector("e1", t)
    e0.set_live(running=2, queued=1, pages_used=12, pages_total=64, slots_used=2, slots_total=8,
                tokens_in_flight=300)
    e0.on_request_arrived("a", 40)
    t[0] += 0.2
    e0.on_request_scheduled("a")
    e0.on_tokens("a", 1)
    t[0] += 0.05
    e0.on_tokens("a", 1)
    e0.on_request_finished("a", "stop", num_cached_tokens=16)
    e0.on_request_arrived("b", 10)
    e0.on_request_finished("b", "error")
    # e1 saw nothing: its quantiles must come out as NaN, not 0.
    return merge_snapshots([e0.engine_snapshot(), e1.engine_snapshot()], time_s=1.0)


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fam, _name: str | None = None, **labels) -> float:
    """The value of the sample of `fam` with these labels (and sample name, if given)."""
    for s in fam.samples:
        if all(s.labels.get(k) == v for k, v in labels.items()) and _name in (None, s.name):
            if _name is None and "quantile" not in labels and s.name.endswith(("_count", "_sum")):
                continue
            return s.value
    raise KeyError(labels)


def test_metrics_text_parses_and_matches_snapshot(snapshot):
    body = to_prometheus(snapshot)
    assert isinstance(body, bytes) and CONTENT_TYPE.startswith("text/plain")
    fams = _families(body.decode())
    assert all(name.startswith("trnrt_") for name in fams)

    # Counters: the parser strips _total from the family name and keeps the type.
    fin = fams["trnrt_requests_finished"]
    assert fin.type == "counter"
    assert _value(fin, engine="e0", finish_reason="stop") == 1
    assert _value(fin, engine="e0", finish_reason="error") == 1
    assert _value(fin, engine="e1", finish_reason="stop") == 0
    assert {s.name for s in fin.samples} == {"trnrt_requests_finished_total"}
    assert _value(fams["trnrt_prompt_tokens"], engine="e0") == 50
    assert _value(fams["trnrt_generation_tokens"], engine="e0") == 2
    assert _value(fams["trnrt_cached_tokens"], engine="e0") == 16
    assert _value(fams["trnrt_request_errors"], engine="e0") == 1

    # Gauges for live state.
    assert fams["trnrt_requests_running"].type == "gauge"
    assert _value(fams["trnrt_requests_running"], engine="e0") == 2
    assert _value(fams["trnrt_kv_pages_total"], engine="e0") == 64

    # Summaries: quantile labels in seconds, cumulative _count/_sum; empty quantiles are NaN.
    ttft = fams["trnrt_time_to_first_token_seconds"]
    assert ttft.type == "summary"
    assert _value(ttft, engine="e0", quantile="0.5") == pytest.approx(0.2)
    assert _value(ttft, engine="e0", quantile="0.99") == pytest.approx(0.2)
    assert _value(ttft, engine="e0", _name="trnrt_time_to_first_token_seconds_count") == 1
    assert _value(ttft, engine="e0", _name="trnrt_time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert math.isnan(_value(ttft, engine="e1", quantile="0.5"))
    itl = fams["trnrt_inter_token_latency_seconds"]
    assert _value(itl, engine="e0", quantile="0.9") == pytest.approx(0.05)

    # Rates as gauges per window, and engine info.
    gen = fams["trnrt_generation_tokens_per_second"]
    assert {s.labels["window"] for s in gen.samples} == {"1m", "5m", "15m", "since_start"}
    info = fams["trnrt_engine_info"]  # the 0.0.4 text format renders an info metric as a gauge
    assert info.type == "gauge"
    (s,) = [s for s in info.samples if s.labels["engine"] == "e0"]
    assert s.labels["model"] == "glm-5.3-flash" and s.labels["compiled"] == "false" and s.value == 1
    assert _value(fams["trnrt_prefix_cache_hit_ratio"], engine="e0") == pytest.approx(16 / 50)


def test_snapshot_collector_in_a_registry_reads_live_values():
    t = [0.0]
    c = _collector("e0", t)
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(c.snapshot))
    before = _families(generate_latest(registry).decode())
    assert _value(before["trnrt_generation_tokens"], engine="e0") == 0
    c.on_request_arrived("a", 3)
    c.on_tokens("a", 7)
    after = _families(generate_latest(registry).decode())  # every scrape takes a fresh snapshot
    assert _value(after["trnrt_generation_tokens"], engine="e0") == 7
