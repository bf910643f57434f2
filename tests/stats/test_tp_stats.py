"""Tensor-parallel stats without processes: the collectives' per-step seconds and counts in rank 0's
`parallel` section (MirroredRunner over a fake channel and a runner whose step issues collectives
through collectives._issue), the ranks' memory, the /metrics families and `trnrt top`'s line."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from trnrt.engine.core.tp_config import ParallelConfig
from trnrt.engine.core.tp_runner import MirroredRunner
from trnrt.parallel import collectives
from trnrt.parallel.context import ParallelContext
from trnrt.stats import StatsCollector
from trnrt.stats.prometheus import to_prometheus
from trnrt.top.format import fmt_bytes, once_renderable, parallel_section, parallel_text

COLL_SLEEP_S = 0.004  # each fake collective's wall time
COMPUTE_SLEEP_S = 0.006  # each fake step's time outside its collectives
CALLS_PER_STEP = 3


class FakeChannel:
    """RankBroadcaster's interface without a group: sends are recorded, a gather answers rank 0's
    report and a rank 1 report derived from it (other RSS and pid)."""

    def __init__(self):
        self.seconds, self.calls, self.sent = 0.0, 0, []

    def send(self, op, *args):
        self.sent.append(op)
        self.calls += 1

    def gather(self, obj):
        return [obj, {**obj, "rank": 1, "pid": obj["pid"] + 1, "rss_bytes": 7 * 2**20}]


class FakeRunner:
    """A runner with a model (weights), a state (tensors()) and a step that issues
    CALLS_PER_STEP collectives through collectives._issue."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.model = torch.nn.Linear(64, 32)  # (64*32 + 32) fp32 weights
        tensors = (torch.zeros(4, 128), torch.zeros(2, 16, dtype=torch.float16))
        self.state = SimpleNamespace(tensors=lambda: tensors, mtp=None)

    def execute(self, rows):
        x = torch.ones(8, 4)
        for _ in range(CALLS_PER_STEP):
            collectives._issue(self.ctx, "all_reduce", x, lambda: (time.sleep(COLL_SLEEP_S), x)[1])
        time.sleep(COMPUTE_SLEEP_S)
        return [SimpleNamespace(token_id=7, extra_token_ids=[]) for _ in rows]


@pytest.fixture
def mirrored():
    ctx = ParallelContext(tp_size=2, tp_rank=0, ep_size=1, group=object())  # _issue only checks it is set
    runner = MirroredRunner(FakeRunner(ctx), FakeChannel(), ctx, parallel=ParallelConfig(tp_size=2),
                            check_every=2, on_fatal=lambda m: None, model_kind="sharded")
    yield runner
    runner.close()


def test_collectives_per_step_and_rank_memory(mirrored):
    before = mirrored.stats()
    assert before["steps"] == 0 and before["collective_s_last_step"] is None and before["collective_share"] is None
    # collectives outside a step (warm-up) count on the context but not in the steps' figures
    x = torch.ones(2)
    collectives._issue(mirrored._ctx, "all_gather", x, lambda: x)
    for _ in range(3):
        mirrored.execute([object(), object()])
    par = mirrored.stats()
    assert (par["tp_size"], par["ep_size"], par["steps"]) == (2, 1, 3)
    assert par["collective_calls_last_step"] == CALLS_PER_STEP
    assert par["collective_calls_per_step"] == CALLS_PER_STEP and par["collective_calls_total"] == 3 * CALLS_PER_STEP
    assert par["collective_s_last_step"] >= CALLS_PER_STEP * COLL_SLEEP_S
    assert par["collective_s_total"] >= 3 * CALLS_PER_STEP * COLL_SLEEP_S
    assert par["collective_ms_per_step"] == pytest.approx(1e3 * par["collective_s_total"] / 3, rel=1e-3)
    # the step also sleeps COMPUTE_SLEEP_S outside its collectives: the share is strictly inside (0, 1)
    assert 0.3 < par["collective_share"] < 1.0 - 0.5 * COMPUTE_SLEEP_S / par["step_ms"] * 1e3
    assert par["step_s_total"] >= par["collective_s_total"] + 3 * COMPUTE_SLEEP_S
    r0, r1 = par["ranks"]
    assert (r0["rank"], r1["rank"]) == (0, 1) and r1["rss_bytes"] == 7 * 2**20  # rank 1's from the check
    assert r0["weight_bytes"] == (64 * 32 + 32) * 4
    assert r0["state_bytes"] == 4 * 128 * 4 + 2 * 16 * 2
    assert r0["cache_tier_bytes"] == 0 and r0["rss_bytes"] > 0
    assert r0["collective_calls"] == 3 * CALLS_PER_STEP + 1  # the whole context, warm-up included
    assert r1["steps"] == 2 and mirrored._channel.sent.count("check") == 1  # check_every=2


def test_tp1_collectives_are_the_identity_and_count_nothing():
    ctx = ParallelContext.single()
    x = torch.ones(3)
    assert collectives.all_reduce(x, ctx) is x and collectives.all_gather(x, ctx, 0) is x
    assert ctx.stats.totals() == (0, 0.0)


def _tp_snapshot(par: dict) -> dict:
    c = StatsCollector(engine_id="engine-0")
    c.set_engine_info("glm-5.3-flash", preset="default", backend="cpu", compiled=False)
    c.set_section("parallel", lambda: par)
    return c.snapshot()


def _families(snap: dict) -> dict:
    return {f.name: f for f in text_string_to_metric_families(to_prometheus(snap).decode())}


def test_metrics_parallel_families(mirrored):
    for _ in range(2):
        mirrored.execute([object()])
    par = mirrored.stats()
    fams = _families(_tp_snapshot(par))
    one = lambda f: [s.value for s in fams[f].samples]  # noqa: E731
    assert one("trnrt_tp_size") == [2] and one("trnrt_ep_size") == [1]
    assert fams["trnrt_tp_collective_seconds"].type == "counter"
    assert one("trnrt_tp_collective_seconds") == [pytest.approx(par["collective_s_total"])]
    assert one("trnrt_tp_collectives") == [2 * CALLS_PER_STEP] and one("trnrt_tp_steps") == [2]
    assert one("trnrt_tp_collective_seconds_last_step") == [pytest.approx(par["collective_s_last_step"])]
    mem = {(s.labels["rank"], s.labels["kind"]): s.value for s in fams["trnrt_tp_rank_memory_bytes"].samples}
    assert mem[("0", "weights")] == (64 * 32 + 32) * 4 and mem[("1", "rss")] == 7 * 2**20
    assert {r for r, _ in mem} == {"0", "1"}
    # TP=1 (no section): the sizes are 1, no other tp series
    fams = _families(StatsCollector().snapshot())
    assert [s.value for s in fams["trnrt_tp_size"].samples] == [1]
    assert not any(name.startswith("trnrt_tp_") and name != "trnrt_tp_size" for name in fams)


PAR = {"tp_size": 2, "ep_size": 1, "steps": 10, "step_ms": 4.0, "collective_ms_per_step": 1.5,
       "collective_share": 0.375, "collective_calls_per_step": 18.0, "agreement": {"mismatches": 0},
       "ranks": [{"rank": 0, "rss_bytes": 310 * 2**20, "weight_bytes": 12 * 2**20, "state_bytes": 3 * 2**19},
                 {"rank": 1, "rss_bytes": 305 * 2**20, "weight_bytes": 12 * 2**20, "state_bytes": 3 * 2**19}]}


def test_parallel_text():
    assert parallel_text(PAR) == ("TP2×EP1 · collectives 1.5ms/step (38% of the 4.0ms step, 18 per step) · "
                                  "ranks agree · memory RSS·weights·state r0 310M·12M·1.5M, r1 305M·12M·1.5M")
    assert parallel_text(None) is None and parallel_text({"error": "x"}) is None
    before = parallel_text({"tp_size": 2, "ep_size": 2, "agreement": {"mismatches": 1}})
    assert before == "TP2×EP2 · collectives -/step · ⚠ 1 disagreements"
    assert (fmt_bytes(None), fmt_bytes(512), fmt_bytes(3 * 2**29), fmt_bytes(2**31)) == ("-", "512B", "1.5G", "2.0G")
    snap = _tp_snapshot(PAR)
    assert parallel_section(snap) == PAR and parallel_section(StatsCollector().snapshot()) is None
    from rich.console import Console

    def once(snapshot) -> str:
        console = Console(width=300, file=io.StringIO(), record=True)
        console.print(once_renderable(snapshot, "test"))
        return console.export_text()

    (row,) = [line for line in once(snap).splitlines() if "parallel" in line]
    assert "TP2×EP1 · collectives 1.5ms/step" in row
    assert "×EP" not in once(StatsCollector().snapshot())  # no parallel row at TP=1
