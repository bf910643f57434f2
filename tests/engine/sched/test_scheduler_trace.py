"""Golden traces: the current Scheduler plans every stored scenario exactly as the pre-change one did.

tests/engine/sched/data/scheduler_traces.json was captured from commit 5f1d6ae's scheduler by
scripts/capture_scheduler_traces.py (scenarios and driver: trace_scenarios.py). Each scenario is
replayed with SchedulerConfig defaults for every field the capture did not set (fcfs, no priority
scheduling, no queue limit) and no prefix cache; scheduler.check_integrity() runs after every step.
A failure names the scenario and the first step whose plan differs.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("trace_scenarios", HERE / "trace_scenarios.py")
ts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ts)

GOLDEN = json.loads((HERE / "data" / "scheduler_traces.json").read_text())


def test_golden_file_covers_the_required_situations():
    assert len(GOLDEN) >= 50
    traces = {g["scenario"]["name"]: g["trace"] for g in GOLDEN}
    steps = [r for t in traces.values() for r in t]
    assert sum(len(r["p"]) for r in steps) >= 20, "preemptions"
    aborts = {e[2] for r in steps for e in r["ev"] + r["post"] if e[0] == "abort" and e[3]}
    assert {"waiting", "running", "preempted"} <= aborts
    reasons = {(u[2]["type"], u[3] is not None) for r in steps for u in r["u"] if u[2]}
    assert {("stop", False), ("length", False), ("abort", True)} <= reasons
    assert any(not g["scenario"]["config"].get("chunked_prefill", True) for g in GOLDEN)
    assert any(g["scenario"]["config"].get("decode_first") is False for g in GOLDEN)
    assert any(e[0] > 1 for g in GOLDEN for e in g["scenario"]["events"] if e[1] == "add")


@pytest.mark.parametrize("golden", GOLDEN, ids=[g["scenario"]["name"] for g in GOLDEN])
def test_trace_matches_golden(golden):
    expected = golden["trace"]
    # JSON round trip: the driver's tuples/ints compare like the stored lists.
    got = json.loads(json.dumps(ts.run_scenario(golden["scenario"], check_integrity=True)))
    for want, have in zip(expected, got):
        assert have == want, f"step {want['n']} differs"
    assert len(got) == len(expected), "a different number of steps"
