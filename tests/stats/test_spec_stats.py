"""Speculative-decoding statistics: StatsCollector.set_speculative / on_spec_step to the `speculative`
section of /v1/stats, its merge over engines, the engine load's summary, /metrics, `trnrt top`'s
line and /v1/loads' section. No model, no server: the collector on a fabricated clock."""

from __future__ import annotations

import json
import logging
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trnrt.stats import StatsCollector, merge_snapshots, validate_snapshot
from trnrt.stats.prometheus import to_prometheus
from trnrt.stats.schema import merge_speculative, spec_ratios

from concurrency_helpers import run_writer_and_readers

WINDOWS = ("1m", "5m", "15m")
ZERO = {"num_verifies": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accept_rate": None,
        "avg_accept_length": None}
OFF = {"enabled": False, "algorithm": None, "num_steps": 0, **ZERO, "accepted_per_position": [],
       "windows": {w: dict(ZERO) for w in WINDOWS}}


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return FakeClock()


def _col(clock, engine_id: str = "e0") -> StatsCollector:
    c = StatsCollector(clock=clock, wall_clock=lambda: 1.7e9, engine_id=engine_id)
    c.set_engine_info("glm-5.3-flash", preset="default", backend="cpu")
    return c


def _feed(c: StatsCollector) -> None:
    """Three steps of NEXTN with 3 drafts per sequence: 10 verifies, 30 drafts, 16 accepted."""
    c.on_spec_step(4, 12, 6, [3, 2, 1])
    c.on_spec_step(2, 6, 0, [0, 0, 0])  # nothing accepted: 1 token per verify
    c.on_spec_step(4, 12, 10, [4, 3, 3])


def test_off_by_default_every_key_with_zeros_and_nulls(clock):
    c = _col(clock)
    snap = c.snapshot()
    assert snap["engines"][0]["speculative"] == OFF
    assert snap["speculative"] == OFF
    assert c.spec_summary() == {"enabled": False, "avg_accept_length": None, "accept_rate": None}
    c.set_speculative(None, 5)  # explicitly off: num_steps does not apply
    assert c.snapshot()["speculative"] == OFF


def test_on_spec_step_while_off_is_ignored_with_one_warning(clock, caplog):
    c = _col(clock)
    with caplog.at_level(logging.WARNING, logger="trnrt.stats"):
        c.on_spec_step(4, 12, 6, [3, 2, 1])
        c.on_spec_step(4, 12, 6)
    assert c.snapshot()["speculative"] == OFF
    assert sum("on_spec_step while speculative decoding is off" in r.message for r in caplog.records) == 1


def test_enabled_counts_and_exact_ratios(clock):
    c = _col(clock)
    c.set_speculative("NEXTN", 3)
    # enabled, nothing verified yet: zeros, null ratios, one zero per position
    s = c.snapshot()["speculative"]
    assert s == {**OFF, "enabled": True, "algorithm": "NEXTN", "num_steps": 3, "accepted_per_position": [0, 0, 0]}
    assert c.spec_summary() == {"enabled": True, "avg_accept_length": None, "accept_rate": None}

    _feed(c)
    snap = c.snapshot()
    s = snap["engines"][0]["speculative"]
    block = {"num_verifies": 10, "num_draft_tokens": 30, "num_accepted_tokens": 16,
             "accept_rate": 16 / 30, "avg_accept_length": 2.6}  # (16 + 10) / 10: the bonus token counts
    assert s == {"enabled": True, "algorithm": "NEXTN", "num_steps": 3, **block,
                 "accepted_per_position": [7, 5, 4], "windows": {w: block for w in WINDOWS}}
    assert snap["speculative"] == s  # one engine: the top level is its own section
    assert c.spec_summary() == {"enabled": True, "avg_accept_length": 2.6, "accept_rate": 16 / 30}
    json.dumps(snap, allow_nan=False)
    validate_snapshot(snap)


def test_nothing_accepted_is_length_one_and_zero_drafts_is_null_rate(clock):
    c = _col(clock)
    c.set_speculative("NEXTN", 2)
    c.on_spec_step(3, 6, 0, [0, 0])
    s = c.snapshot()["speculative"]
    assert (s["accept_rate"], s["avg_accept_length"]) == (0.0, 1.0)
    assert spec_ratios(0, 0, 0) == {"accept_rate": None, "avg_accept_length": None}
    assert spec_ratios(2, 0, 0) == {"accept_rate": None, "avg_accept_length": 1.0}


def test_shorter_per_position_is_padded_longer_raises(clock):
    c = _col(clock)
    c.set_speculative("NEXTN", 3)
    c.on_spec_step(2, 4, 1, [1])  # one draft each (e.g. near max_model_len)
    c.on_spec_step(1, 3, 0)  # no per-position list
    assert c.snapshot()["speculative"]["accepted_per_position"] == [1, 0, 0]
    with pytest.raises(ValueError, match="num_steps is 3"):
        c.on_spec_step(1, 4, 4, [1, 1, 1, 1])
    s = c.snapshot()["speculative"]  # the refused call counted nothing
    assert (s["num_verifies"], s["num_accepted_tokens"], s["accepted_per_position"]) == (3, 1, [1, 0, 0])


@pytest.mark.parametrize("algorithm,steps", [("", 3), (3, 3), ("NEXTN", -1), ("NEXTN", 1.5), ("NEXTN", True)])
def test_set_speculative_rejects_bad_arguments(clock, algorithm, steps):
    with pytest.raises(ValueError):
        _col(clock).set_speculative(algorithm, steps)


def test_set_speculative_again_starts_from_zero(clock):
    c = _col(clock)
    c.set_speculative("NEXTN", 3)
    _feed(c)
    c.set_speculative("NEXTN", 2)
    s = c.snapshot()["speculative"]
    assert s["num_steps"] == 2 and s["num_verifies"] == 0 and s["accepted_per_position"] == [0, 0]
    c.set_speculative(None)
    assert c.snapshot()["speculative"] == OFF


def test_windows_cover_the_recent_steps_only(clock):
    c = _col(clock)
    c.set_speculative("NEXTN", 1)
    c.on_spec_step(10, 10, 0, [0])  # at t=1000: 1.0 token per verify
    clock.t += 120.0
    c.on_spec_step(10, 10, 10, [10], now=clock.t)  # at t=1120: 2.0 tokens per verify
    s = c.snapshot()["speculative"]
    assert (s["num_verifies"], s["avg_accept_length"], s["accept_rate"]) == (20, 1.5, 0.5)
    assert s["windows"]["1m"] == {"num_verifies": 10, "num_draft_tokens": 10, "num_accepted_tokens": 10,
                                  "accept_rate": 1.0, "avg_accept_length": 2.0}
    assert s["windows"]["5m"]["avg_accept_length"] == s["windows"]["15m"]["avg_accept_length"] == 1.5
    clock.t += 1000.0  # past every window: since-start figures stay, the windows empty
    s = c.snapshot()["speculative"]
    assert s["avg_accept_length"] == 1.5
    assert all(s["windows"][w] == ZERO for w in WINDOWS)


def test_merge_over_engines(clock):
    a, b, off = _col(clock, "a"), _col(clock, "b"), _col(clock, "off")
    a.set_speculative("NEXTN", 3)
    _feed(a)
    b.set_speculative("NEXTN", 2)
    b.on_spec_step(5, 10, 4, [3, 1])
    snap = merge_snapshots([off.engine_snapshot(), a.engine_snapshot(), b.engine_snapshot()], time_s=1.0)
    s = snap["speculative"]
    assert (s["enabled"], s["algorithm"], s["num_steps"]) == (True, "NEXTN", 3)
    assert (s["num_verifies"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (15, 40, 20)
    assert s["accept_rate"] == 20 / 40 and s["avg_accept_length"] == 35 / 15
    assert s["accepted_per_position"] == [10, 6, 4]
    assert s["windows"]["1m"]["num_verifies"] == 15 and s["windows"]["1m"]["avg_accept_length"] == 35 / 15
    # engines from an older server (no section) and down rows count as off
    assert merge_speculative([None, {}, {"enabled": False}]) == OFF
    assert merge_snapshots([off.engine_snapshot()], time_s=1.0)["speculative"] == OFF


def test_metrics_only_when_enabled(clock):
    off = _col(clock, "off")
    assert "spec_" not in to_prometheus(off.snapshot()).decode()

    on = _col(clock, "on")
    on.set_speculative("NEXTN", 3)
    text = to_prometheus(merge_snapshots([off.engine_snapshot(), on.engine_snapshot()], time_s=1.0)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    gauge = fams["trnrt_spec_accept_length"]
    assert gauge.type == "gauge" and len(gauge.samples) == 1 and math.isnan(gauge.samples[0].value)

    _feed(on)
    fams = {f.name: f for f in text_string_to_metric_families(to_prometheus(on.snapshot()).decode())}
    lab = {"engine": "on", "model": "glm-5.3-flash"}

    def one(name: str) -> float:
        (s,) = [s for s in fams[name].samples if not s.name.endswith("_created")]
        assert s.labels == lab, s
        return s.value

    for name, value in [("trnrt_spec_decode_num_drafts", 10), ("trnrt_spec_decode_num_draft_tokens", 30),
                        ("trnrt_spec_decode_num_accepted_tokens", 16)]:
        assert fams[name].type == "counter" and one(name) == value, name
    assert one("trnrt_spec_accept_length") == 2.6
    assert one("trnrt_spec_accept_rate") == pytest.approx(16 / 30)
    per_pos = {s.labels["position"]: s.value for s in fams["trnrt_spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per_pos == {"0": 7, "1": 5, "2": 4}
    assert "trnrt_spec_decode_num_drafts_total{" in to_prometheus(on.snapshot()).decode()


def test_top_line_only_when_enabled(clock):
    from rich.console import Console

    from trnrt.top.format import once_renderable, spec_text

    c = _col(clock)

    def once() -> str:
        console = Console(width=160, record=True)
        console.print(once_renderable(c.snapshot(), "test"))
        return console.export_text()

    assert spec_text(c.snapshot()["speculative"]) is None and spec_text(None) is None
    assert "spec" not in once()
    c.set_speculative("NEXTN", 3)
    assert spec_text(c.snapshot()["speculative"]) == "spec accept length - (rate -)"
    _feed(c)
    assert spec_text(c.snapshot()["speculative"]) == "spec accept length 2.60 (rate 53%)"
    assert "spec accept length 2.60 (rate 53%) · NEXTN, 3 draft steps · 10 verifies" in once()


def test_engine_load_carries_the_summary_and_loads_has_the_section(clock):
    from trnrt.engine.core.client import EngineLoad
    from trnrt.serve.output.loads import load_entry, select, to_prometheus as loads_prometheus

    assert "speculative" not in load_entry(EngineLoad().to_dict())  # off: left out, as SGLang
    entry = load_entry(EngineLoad(spec_accept_length=2.6, spec_accept_rate=16 / 30).to_dict())
    assert entry["speculative"] == {"accept_length": 2.6, "accept_rate": 0.5333}
    assert list(entry).index("speculative") == list(entry).index("memory") + 1  # SGLang's order
    assert "speculative" in select(entry, frozenset({"spec"}))
    assert "speculative" in select(entry, frozenset({"all"}))
    assert "speculative" not in select(entry, frozenset({"core"}))
    text = loads_prometheus([entry])
    assert 'sglang_spec_accept_length{dp_rank="0"} 2.6\n' in text
    assert 'sglang_spec_accept_rate{dp_rank="0"} 0.5333\n' in text


def test_concurrent_steps_and_snapshots_stay_consistent():
    c = StatsCollector()
    c.set_speculative("NEXTN", 2)
    n = 2000

    def writer():
        for _ in range(n):
            c.on_spec_step(2, 4, 3, [2, 1])

    def reader(errors):
        try:
            for _ in range(30):
                s = c.snapshot()["speculative"]
                # each step is applied under one lock: a snapshot never sees half of one
                assert s["num_draft_tokens"] == 2 * s["num_verifies"] and sum(s["accepted_per_position"]) == \
                    s["num_accepted_tokens"] == 1.5 * s["num_verifies"]
                json.dumps(s, allow_nan=False)
        except Exception as e:
            errors.append(e)

    run_writer_and_readers(writer, reader)
    s = c.snapshot()["speculative"]
    assert (s["num_verifies"], s["num_accepted_tokens"], s["accepted_per_position"]) == (2 * n, 3 * n, [2 * n, n])
    assert s["avg_accept_length"] == 2.5 and s["accept_rate"] == 0.75
