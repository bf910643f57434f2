"""StatsCollector: producer events to snapshot figures, on a fabricated clock."""

from __future__ import annotations

import json

import pytest

from trnrt.stats import SCHEMA_VERSION, SchemaError, StatsCollector, merge_snapshots, validate_snapshot

from concurrency_helpers import run_writer_and_readers


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def col(clock):
    c = StatsCollector(clock=clock, wall_clock=lambda: 1.7e9, engine_id="e0")
    c.set_engine_info("glm-5.3-flash", preset="batch8", backend="cpu", compiled=True, version="9.9.9", tp=1)
    return c


def test_latencies_counters_and_info(col, clock):
    col.on_request_arrived("a", 100)
    clock.advance(0.5)
    col.on_request_scheduled("a")  # queue 500 ms
    clock.advance(0.25)
    col.on_tokens("a", 1)  # TTFT 750 ms (arrival to first token, queue included)
    clock.advance(0.02)
    col.on_tokens("a", 1)  # ITL 20 ms
    clock.advance(0.06)
    col.on_tokens("a", 3)  # a 3-token step: ITL 60 / 3 = 20 ms
    col.on_request_preempted("a")
    clock.advance(0.04)
    col.on_request_scheduled("a")  # rescheduled after preemption: no second queue sample
    col.on_tokens("a", 1)  # ITL 40 ms
    col.on_request_finished("a", "length", num_cached_tokens=25)  # E2E 870 ms

    col.on_request_arrived("b", 50)
    clock.advance(0.1)
    col.on_request_finished("b", "abort")  # aborted in the queue: no E2E, no queue sample
    col.on_request_arrived("c", 10)
    col.on_request_finished("c", "error")

    e = col.engine_snapshot()
    lat = e["latency"]
    assert lat["queue_ms"]["count"] == 1 and lat["queue_ms"]["p50"] == pytest.approx(500)
    assert lat["ttft_ms"]["count"] == 1 and lat["ttft_ms"]["p99"] == pytest.approx(750)
    assert lat["itl_ms"]["count"] == 3
    assert lat["itl_ms"]["p50"] == pytest.approx(20) and lat["itl_ms"]["p99"] == pytest.approx(39.6)
    assert lat["e2e_ms"]["count"] == 1 and lat["e2e_ms"]["p50"] == pytest.approx(870)
    assert lat["e2e_ms"]["total_sum_s"] == pytest.approx(0.87)

    cnt = e["counters"]
    assert cnt["requests_arrived"] == 3
    assert cnt["requests_finished"] == {"stop": 0, "length": 1, "abort": 1, "error": 1}
    assert cnt["requests_finished_total"] == 3
    assert (cnt["errors"], cnt["aborts"], cnt["preemptions"]) == (1, 1, 1)
    assert cnt["prompt_tokens"] == 160 and cnt["finished_prompt_tokens"] == 160
    assert cnt["generation_tokens"] == 6 and cnt["cached_tokens"] == 25
    assert e["prefix_hit_rate"] == pytest.approx(25 / 160)

    info = e["info"]
    assert info["model"] == "glm-5.3-flash" and info["preset"] == "batch8" and info["compiled"] is True
    assert info["version"] == "9.9.9" and info["extra"] == {"tp": 1}
    assert info["uptime_s"] == pytest.approx(0.97) and info["started_at_s"] == 1.7e9
    assert col._reqs == {}  # finished requests leave no bookkeeping behind


def test_rates_over_windows_and_since_start(col, clock):
    start = clock.t
    # 10 minutes of traffic: each second one request arrives (20 prompt tokens), 5 tokens are
    # generated and one request finishes.
    for s in range(600):
        clock.t = start + s + 0.5
        col.on_request_arrived(f"r{s}", 20)
        col.on_tokens(f"r{s}", 5)
        col.on_request_finished(f"r{s}", "stop")
    clock.t = start + 600.0
    r = col.snapshot()["rates"]
    for key in ("1m", "5m", "15m", "since_start"):
        assert r[key]["generation_tokens_per_s"] == pytest.approx(5.0, rel=0.02), key
        assert r[key]["requests_arrived_per_s"] == pytest.approx(1.0, rel=0.02), key
        assert r[key]["prompt_tokens_per_s"] == pytest.approx(20.0, rel=0.02), key
        assert r[key]["requests_finished_per_s"] == pytest.approx(1.0, rel=0.02), key

    # Two silent minutes later the windows tell recent from old traffic.
    clock.t = start + 720.0
    r = col.snapshot()["rates"]
    assert r["1m"]["generation_tokens_per_s"] == 0.0
    assert r["5m"]["generation_tokens_per_s"] == pytest.approx(5 * 180 / 300, rel=0.02)
    assert r["15m"]["generation_tokens_per_s"] == pytest.approx(3000 / 720, rel=0.01)
    assert r["since_start"]["generation_tokens_per_s"] == pytest.approx(3000 / 720)

    # After 20 minutes of silence every window is empty; since-start keeps the average.
    clock.t = start + 600.0 + 1200.0
    r = col.snapshot()["rates"]
    assert all(r[k]["generation_tokens_per_s"] == 0.0 for k in ("1m", "5m", "15m"))
    assert r["since_start"]["generation_tokens_per_s"] == pytest.approx(3000 / 1800)


def test_latency_percentiles_cover_a_recent_window_only(clock):
    col = StatsCollector(clock=clock, latency_window_s=60.0)
    for i in range(100):  # TTFTs of 1..100 ms
        col.on_request_arrived(f"r{i}", 1)
        clock.advance((i + 1) / 1000)
        col.on_tokens(f"r{i}", 1)
    ttft = col.snapshot()["latency"]["ttft_ms"]
    assert ttft["count"] == 100
    assert ttft["p50"] == pytest.approx(50.5)
    assert ttft["p90"] == pytest.approx(90.1)
    assert ttft["p99"] == pytest.approx(99.01)
    clock.advance(61)
    ttft = col.snapshot()["latency"]["ttft_ms"]
    assert ttft["count"] == 0 and ttft["p50"] is None  # no data is null, not 0
    assert ttft["total_count"] == 100  # the cumulative count survives the window


def test_memory_is_bounded_whatever_the_traffic(clock):
    col = StatsCollector(clock=clock, latency_max_samples=64, max_tracked_requests=100)
    for i in range(5000):
        clock.advance(0.37)  # ~30 minutes: more than the 15-minute horizon
        col.on_request_arrived(f"r{i}", 10)
        col.on_tokens(f"r{i}", 1)
        col.on_tokens(f"r{i}", 1)
        if i % 2:  # half the requests never finish (an engine bug): bookkeeping still capped
            col.on_request_finished(f"r{i}", "stop")
    assert len(col._reqs) <= 100 and col.dropped_requests > 0
    assert all(len(w._samples) <= 64 for w in col._lat.values())
    assert len(col._generated._val) == 900  # 15 min of 1 s buckets, fixed
    snap = col.snapshot()
    assert snap["counters"]["generation_tokens"] == 10000
    assert snap["latency"]["itl_ms"]["count"] <= 64
    # Tokens for a request the collector forgot are still counted.
    col.on_tokens("r0", 4)
    assert col.snapshot()["counters"]["generation_tokens"] == 10004


def test_set_live_is_partial_and_rejects_unknown_keys(col):
    col.set_live(running=3, queued=2, pages_used=10, pages_total=100, slots_used=3, slots_total=8,
                 tokens_in_flight=4096)
    col.set_live(queued=5)
    assert col.snapshot()["live"] == {"running": 3, "queued": 5, "pages_used": 10, "pages_total": 100,
                                      "slots_used": 3, "slots_total": 8, "tokens_in_flight": 4096}
    with pytest.raises(TypeError, match="waiting"):
        col.set_live(waiting=1)
    with pytest.raises(ValueError, match="finish_type"):
        col.on_request_finished("x", "eos")


def test_snapshot_is_strict_json_and_valid(col, clock):
    col.on_request_arrived("a", 5)
    snap = col.snapshot()
    text = json.dumps(snap, allow_nan=False)  # no NaN/inf sneaks into the document
    again = validate_snapshot(json.loads(text))
    assert again["version"] == SCHEMA_VERSION == 1 and again["time_s"] == 1.7e9
    assert [e["id"] for e in again["engines"]] == ["e0"]
    # One engine: the top-level aggregates equal the engine's own figures.
    eng = again["engines"][0]
    for key in ("live", "counters", "rates", "latency", "prefix_hit_rate"):
        assert again[key] == eng[key], key


def test_merge_snapshots_for_a_router(clock):
    engines = []
    for i, ttft in enumerate((0.1, 0.3)):
        c = StatsCollector(clock=clock, engine_id=f"e{i}")
        c.set_live(running=i + 1, pages_total=100, pages_used=10 * (i + 1))
        c.on_request_arrived("a", 100)
        clock.advance(ttft)
        c.on_tokens("a", 2)
        c.on_request_finished("a", "stop", num_cached_tokens=50 * i)
        engines.append(c.engine_snapshot())
    snap = merge_snapshots(engines, time_s=1.0, router={"policy": "round_robin"})
    assert [e["id"] for e in snap["engines"]] == ["e0", "e1"]
    assert snap["live"]["running"] == 3 and snap["live"]["pages_used"] == 30
    assert snap["counters"]["requests_finished"]["stop"] == 2
    assert snap["counters"]["generation_tokens"] == 4
    assert snap["prefix_hit_rate"] == pytest.approx(50 / 200)
    # Percentiles of different engines cannot be merged exactly: the worst engine's is reported.
    assert snap["latency"]["ttft_ms"]["p50"] == pytest.approx(300)
    assert snap["latency"]["ttft_ms"]["count"] == 2
    assert snap["latency"]["ttft_ms"]["mean"] == pytest.approx(200)
    assert snap["router"] == {"policy": "round_robin"}
    validate_snapshot(snap)


@pytest.mark.parametrize(
    "doc,msg",
    [
        ([], "JSON object"),
        ({"version": 2}, "version"),
        ({"version": 1, "engines": {}}, "engines"),
        ({"version": 1, "engines": [{}]}, "id"),
        ({"version": 1, "engines": [], "live": {}, "counters": {}, "rates": {}}, "latency"),
    ],
)
def test_validate_rejects_malformed(doc, msg):
    with pytest.raises(SchemaError, match=msg):
        validate_snapshot(doc)


def test_concurrent_writer_and_readers_stay_consistent():
    col = StatsCollector()
    n = 3000

    def writer():
        for i in range(n):
            col.on_request_arrived(f"r{i}", 3)
            col.on_request_scheduled(f"r{i}")
            col.on_tokens(f"r{i}", 2)
            col.on_request_finished(f"r{i}", "stop")

    def reader(errors):
        try:
            for _ in range(50):
                s = col.snapshot()
                c = s["counters"]
                # Each event is applied under one lock, so a snapshot never sees a finish
                # without its arrival.
                assert c["requests_finished_total"] <= c["requests_arrived"]
                json.dumps(s, allow_nan=False)
        except Exception as e:  # surface the failure in the main thread
            errors.append(e)

    run_writer_and_readers(writer, reader)
    c = col.snapshot()["counters"]
    assert c["requests_arrived"] == c["requests_finished_total"] == n
    assert c["generation_tokens"] == 2 * n and c["prompt_tokens"] == 3 * n


def test_on_tokens_many_equals_one_call_per_request(clock):
    """The engine's per-step batch form gives the same snapshot as on_tokens per request."""
    snaps = []
    for batched in (False, True):
        clock.t = 100.0
        col = StatsCollector(clock=clock, wall_clock=lambda: 1.7e9, engine_id="e0")
        for rid in ("a", "b", "c"):
            col.on_request_arrived(rid, 5)
        for step in range(4):
            clock.advance(0.01 * (step + 1))
            items = [("a", 1), ("b", 2 if step else 1), ("c", 0), ("unknown", 1)]
            if batched:
                col.on_tokens_many(items)
            else:
                for rid, n in items:
                    col.on_tokens(rid, n)
        snap = col.snapshot()
        snap.pop("time", None)
        snaps.append(json.dumps(snap, sort_keys=True))
    assert snaps[0] == snaps[1]
    assert json.loads(snaps[1])["counters"]["generation_tokens"] == 4 + 7 + 4
