"""`trnrt compile --tp-size` (issue #31): a TP graph is the same program on every rank, so one
export on a fake world serves them all, and its key differs from TP=1's.

ONE spawn of 2 gloo ranks exports the default preset's decode-b1 graph of the tiny checkpoint at
tp 2 / ep 1 and tp 2 / ep 2 (tp_compile_checks). Checked: both ranks' fingerprints and graph code
are equal (the rank lives in the weights and in the vocab_start / expert_start buffers, which are
graph inputs by name, not constants), the collectives name the default group '0' and never a
rank; the one-process fake-world export (what `trnrt compile --tp-size` runs) has the same
fingerprint; the TP=1 fingerprint differs, and so does the layout key; `compile_graphs(...,
parallel=ctx)` writes its manifest under <preset>/<backend>/tp2ep1/ with the layout hash. The
AOTInductor compile of a TP graph (~100 s a graph here) is not run by these tests: see
scripts/aoti_gloo_collectives.py and docs/COMPILE.md.
"""

from __future__ import annotations

import json

import pytest
from launcher import launch
from tp_compile_checks import GRAPH, export_layouts, export_one

LAYOUTS = [[2, 1], [2, 2]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from trnrt.models import kernels

    kernels.load()
    return launch(export_layouts, 2, tmp_path_factory.mktemp("tpc"), timeout_s=300, layouts=LAYOUTS)


@pytest.fixture(scope="module")
def fake_rank0() -> dict:
    from trnrt.parallel.fake import destroy_world, fake_context

    ctx = fake_context(2, 1)
    try:
        return {"tp2_ep1": export_one(ctx), "ctx": ctx}
    finally:
        destroy_world()


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_tp_graph_is_the_same_program_on_every_rank(ranks, tp, ep):
    r0, r1 = (r[f"tp{tp}_ep{ep}"] for r in ranks)
    assert r0["hash"] == r1["hash"], "the exported TP graph differs between ranks (a rank baked in?)"
    assert r0["code"] == r1["code"]
    assert r0["groups"] == r1["groups"] == ["0"]  # the default group, by name
    assert r0["ops"]["all_reduce"] > 0 and r0["ops"]["all_gather_into_tensor"] == 1  # logits gathered once


def test_fake_world_export_equals_the_gloo_ranks(ranks, fake_rank0):
    assert fake_rank0["tp2_ep1"]["hash"] == ranks[0]["tp2_ep1"]["hash"]
    assert fake_rank0["tp2_ep1"]["ops"] == ranks[0]["tp2_ep1"]["ops"]


def test_tp_key_differs_from_tp1_and_tp1_key_is_unchanged(ranks):
    from trnrt.compile.tp import layout_hash, layout_key
    from trnrt.parallel.context import ParallelContext

    one = export_one(ParallelContext.single())
    assert not one["groups"] and one["hash"] != ranks[0]["tp2_ep1"]["hash"]
    assert layout_hash(one["hash"], ParallelContext.single()) == one["hash"]  # TP=1 locks do not move
    keys = {layout_hash(ranks[0]["tp2_ep1"]["hash"], ParallelContext.for_rank(2, 0, ep)) for ep in (1, 2)}
    assert len(keys) == 2 and layout_key(ParallelContext.for_rank(2, 0, 2)) == "tp2ep2"


def test_compile_graphs_writes_the_layout_manifest(tmp_path, ranks):
    from trnrt.compile.pipeline import compile_graphs
    from trnrt.compile.tp import layout_hash, rank_model_and_state
    from trnrt.config.presets import read_preset
    from trnrt.parallel.fake import destroy_world, fake_context

    ec = read_preset("default").engine_config
    ctx = fake_context(2, 1)
    try:
        model, state = rank_model_and_state(None, ec, ctx)
        man, art = compile_graphs(model, state, ec, backend="cpu", out=tmp_path, dry_run=True, only=[GRAPH],
                                  parallel=ctx)
    finally:
        destroy_world()
    assert art == tmp_path / ec.preset / "cpu" / "tp2ep1"
    data = json.loads((art / "manifest.json").read_text())
    assert data["engine_config"]["parallel"] == {"tp_size": 2, "ep_size": 1, "moe_tp_size": 2, "group": "default"}
    assert man.entry(GRAPH).graph_hash == layout_hash(ranks[0]["tp2_ep1"]["hash"], ctx)
    assert not (tmp_path / ec.preset / "cpu" / "manifest.json").exists()  # TP=1's manifest untouched
