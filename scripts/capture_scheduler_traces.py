"""Capture the golden scheduler traces (tests/engine/sched/data/scheduler_traces.json).

Usage: .venv/bin/python scripts/capture_scheduler_traces.py [TREE]

TREE is the checkout whose trnrt.engine.sched.scheduler is recorded (default /tmp/sched-base, a git
worktree of the pre-change commit: `git worktree add /tmp/sched-base 5f1d6ae`). It goes first on
sys.path, so the scenarios run against that tree's scheduler, not this one's.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    tree = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sched-base").resolve()
    sys.path.insert(0, str(tree))
    import trnrt.engine.sched.scheduler as sched_mod

    assert pathlib.Path(sched_mod.__file__).resolve().is_relative_to(tree), sched_mod.__file__
    spec = importlib.util.spec_from_file_location("trace_scenarios", REPO / "tests/engine/sched/trace_scenarios.py")
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    out = []
    for sc in ts.build_scenarios():
        trace = ts.run_scenario(sc)
        out.append({"scenario": sc, "trace": trace})
        print(f"{sc['name']:36s} {len(trace):4d} steps")
    path = REPO / "tests/engine/sched/data/scheduler_traces.json"
    # One scenario per line: compact, yet a diff names the scenario that changed.
    text = "[\n" + ",\n".join(json.dumps(x, separators=(",", ":")) for x in out) + "\n]\n"
    path.write_text(text)
    print(f"{len(out)} scenarios -> {path} ({len(text)} bytes) from {sched_mod.__file__}")


if __name__ == "__main__":
    main()
