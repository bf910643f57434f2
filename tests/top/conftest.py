"""Fabricated /v1/stats snapshots for the dashboard tests, made by the real StatsCollector so the
fixtures can never drift from the schema."""

from __future__ import annotations

import pytest

from trnrt.stats import StatsCollector, merge_snapshots


def build_snapshot(step: int = 0) -> dict:
    """Two engines with fixed traffic; `step` adds 1 s of uptime, 120 output tokens and 2 finished
    requests per engine, so consecutive steps give the dashboard known deltas (120 tok/s and 2 req/s
    per engine). Latency: queue 10 ms, TTFT 50 ms, ITL 20 ms, E2E 1.23 s;
    prefix hit 25%; uptime 1h00m."""
    t = [0.0]
    engines = []
    for i in range(2):
        t[0] = 0.0  # each engine starts at 0: uptime 1h00m03s
        c = StatsCollector(clock=lambda: t[0], wall_clock=lambda: 1.7e9, engine_id=f"engine-{i}")
        c.set_engine_info("glm-5.3-flash", preset="batch8", backend="cpu", compiled=True, version="0.1.0")
        for r in range(4 + 2 * step):
            # Traffic late in the hour, inside the snapshot's 60 s latency window; requests
            # overlap, each on its own timeline (the collector only needs per-request order).
            rid, t[0] = f"r{r}", 3600.0 + 0.1 * r
            c.on_request_arrived(rid, 100)
            t[0] += 0.01
            c.on_request_scheduled(rid)  # queue 10 ms
            t[0] += 0.04
            c.on_tokens(rid, 1)  # TTFT 50 ms
            t[0] += 59 * 0.02
            c.on_tokens(rid, 59)  # ITL 20 ms
            c.on_request_finished(rid, "stop", num_cached_tokens=25)  # E2E 1.23 s
        t[0] = 3600.0 + 3 + step  # uptime 1h00m03s (+1 s per step)
        c.set_live(running=3 + i, queued=2 * i, pages_used=48, pages_total=64, slots_used=3 + i,
                   slots_total=8, tokens_in_flight=900)
        engines.append(c.engine_snapshot())
    return merge_snapshots(engines, time_s=1.7e9 + step)


@pytest.fixture
def make_snapshot():
    return build_snapshot
