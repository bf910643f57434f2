"""Issue #31, first acceptance line: every sharded module equals its unsharded original on 2
gloo processes (fp32, one thread each): vocab-parallel embedding and lm_head, KDA projections
and conv thirds (and the per-head state they leave), MLA heads, the dense MLP and the shared
expert, the routed experts in TP mode (I split per gate / up half) and EP mode (E split).

ONE spawn of 2 ranks runs every check (tp_checks.run_checks); the tests below read its results.
"""

from __future__ import annotations

import time

import pytest
from launcher import launch
from tp_checks import CHECKS, FUSED_CHECKS, PLANTED, TOL, run_checks

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from trnrt.models import kernels

    kernels.load()  # built once per machine (cached); the ranks then only load it
    t0 = time.monotonic()
    out = launch(run_checks, WORLD, tmp_path_factory.mktemp("tp2"), timeout_s=180)
    bodies = ", ".join(f"{r['seconds']:.1f}" for r in out)
    print(f"\n{WORLD} gloo ranks ran {len(out[0]['checks'])} checks in {time.monotonic() - t0:.1f} s "
          f"(rank bodies {bodies} s)")
    return out


def _worst(ranks, name) -> dict:
    rows = [r["checks"][name] for r in ranks]
    return {"delta": max(row["delta"] for row in rows), "rows": rows}


@pytest.mark.parametrize("check", CHECKS)
def test_sharded_module_equals_unsharded(ranks, check):
    w = _worst(ranks, check)
    assert w["delta"] <= TOL, f"{check}: max |Δ| {w['delta']:.3e} > {TOL} ({w['rows']})"
    for row in w["rows"]:
        assert row.get("selection_equal", True), f"{check}: the indexer's selection differs from the unsharded one"


@pytest.mark.parametrize("check", FUSED_CHECKS)
def test_sharded_module_equals_unsharded_with_fused_kernels(ranks, check):
    if not ranks[0]["fused"]:
        pytest.skip(f"trnrt's CPU kernels did not load: {ranks[0]['kernels_error']}")
    w = _worst(ranks, check)
    assert w["delta"] <= TOL, f"{check}: max |Δ| {w['delta']:.3e} > {TOL} ({w['rows']})"
    for row in w["rows"]:
        assert row.get("selection_equal", True), f"{check}: the indexer's selection differs"


def test_a_contiguous_conv_split_is_caught(ranks):
    """The planted bug of tensor_parallel.md §8.7: the 3*qkv conv cut as one contiguous block
    (a valid partition that round-trips and passes every shape check) mixes q/k/v channels."""
    w = _worst(ranks, PLANTED)
    assert w["delta"] > 100 * TOL, f"the contiguous conv split went unnoticed (max |Δ| {w['delta']:.3e})"


def test_each_sharded_forward_issues_one_collective(ranks):
    """Embedding: 1 all-reduce; lm_head: 1 all-gather; a block: 1 all-reduce (the MoE's routed
    and shared partials share it); state checks issue none."""
    for r in ranks:
        for name, row in r["checks"].items():
            want = 0 if name.endswith(("_state", "_latent_state")) else 1
            assert row["calls"] == want, (name, row)
    assert ranks[0]["checks"]["lm_head"]["shape"] == [2, 4096]  # the gathered logits are [B, V]


def test_replicated_router_agrees_on_every_rank(ranks):
    assert all(r["router"] == ranks[0]["router"] for r in ranks)
