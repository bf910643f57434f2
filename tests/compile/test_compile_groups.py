"""The compile tests' graph selection and job split (compile_groups.py), without compiling."""

from __future__ import annotations

from compile_groups import Graph, jobs


def _g(preset, gid, cost, lock_hash=None):
    return Graph(preset, (), gid, ("decode", "base", "full", False), lock_hash, cost)


def test_jobs_balance_cost_and_keep_equal_graphs_together_source_first():
    graphs = [_g("default", "d1", 100, "h1"), _g("default", "d2", 90, "h2"), _g("default", "d3", 80, "h3"),
              _g("batch8", "b1", 100, "h1"), _g("batch8", "b2", 70, "h4"), _g("batch8", "b3", 60, "h5")]
    split = jobs(2, graphs)
    assert len(split) == 2
    placed = [(p, gid) for job in split for p, _, ids in job for gid in ids]
    assert sorted(placed) == sorted((g.preset, g.id) for g in graphs)  # each graph once
    cost = {(g.preset, g.id): g.cost for g in graphs}
    # equal hashes are one compile: d1 and b1 in the same job, counted once, default's step first
    [job] = [j for j in split if any("d1" in ids for _, _, ids in j)]
    assert any("b1" in ids for _, _, ids in job)
    assert [p for p, _, _ in job] == ["default", "batch8"]
    loads = [sum(cost[(p, i)] for p, _, ids in j for i in ids if (p, i) != ("batch8", "b1")) for j in split]
    assert abs(loads[0] - loads[1]) <= 100 and sum(loads) == 400


def test_more_jobs_than_graphs_gives_no_empty_job():
    assert len(jobs(4, [_g("batch8", "b1", 10)])) == 1
