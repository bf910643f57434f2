"""Issue #31, model-level acceptance: the rank model (trnrt/models/glm5_next/rank_model.py) at TP 2
and 4, in TP mode (ep 1) and EP mode (ep 2, ep 4, and tp 4 / ep 2), equals the TP=1 model on the
tiny checkpoint through the real runner step path: a chunked prefill across a prefix-cache
checkpoint, a prefix-cache resume from it, 32 batched decode steps, speculative MTP steps
(draft, verify, rollback): max |Δ logit| <= 1e-5 (fp32), greedy tokens equal, the MoE router's
and the DSA indexer's selections equal TP=1's and identical on every rank (tp_model_checks).

ONE spawn of 2 gloo ranks and ONE of 4 run every layout; the tests below read their results.
The one-process tests: TP=1 is exactly load_model's model, a rank's state has local shapes, a
shard of the wrong layout is refused naming the tensor.
"""

from __future__ import annotations

import time

import pytest
import torch
from launcher import launch
from tp_model_checks import DECODE_STEPS, TOL, run_model_checks

LAUNCHES = {2: ([[2, 1], [2, 2]], [2, 1]), 4: ([[4, 1], [4, 4], [4, 2]], [4, 1])}
LAYOUTS = [(world, f"tp{tp}_ep{ep}") for world, (lays, _) in LAUNCHES.items() for tp, ep in lays]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, list[dict]]:
    from trnrt.models import kernels

    kernels.load()  # built once per machine (cached); the ranks then only load it
    out = {}
    for world, (layouts, planted) in LAUNCHES.items():
        t0 = time.monotonic()
        out[world] = launch(run_model_checks, world, tmp_path_factory.mktemp(f"tpm{world}"), timeout_s=240,
                            layouts=layouts, planted=planted)
        bodies = ", ".join(f"{r['seconds']:.1f}" for r in out[world])
        print(f"\n{world} gloo ranks: {len(layouts)} layouts in {time.monotonic() - t0:.1f} s (rank bodies {bodies} s)")
    return out


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_rank_model_equals_tp1_through_the_runner(launches, world, layout):
    ranks = launches[world]
    for r, out in enumerate(ranks):
        row = out["layouts"][layout]
        assert row["forwards"] == out["ref_forwards"] and row["num_tokens"] == out["ref_tokens"], (r, row)
        assert row["delta"] <= TOL, f"{layout} rank {r}: max |Δ logit| {row['delta']:.3e} > {TOL}"
        assert row["tokens_equal"], f"{layout} rank {r}: greedy tokens differ from TP=1"
        assert row["router_equal_tp1"] and row["index_equal_tp1"], (layout, r, row)
    assert ranks[0]["layouts"][layout]["num_tokens"] >= 2 * DECODE_STEPS
    assert ranks[0]["layouts"][layout]["drafts"] > 0  # the speculative steps verified MTP drafts


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_every_rank_routes_and_selects_the_same(launches, world, layout):
    rows = [out["layouts"][layout] for out in launches[world]]
    for key in ("router_digest", "index_digest"):
        assert len({row[key] for row in rows}) == 1, f"{layout}: {key} differs between ranks"
    assert rows[0]["num_router"] > 0 and rows[0]["num_index"] > 0


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_a_decode_step_issues_one_collective_per_block(launches, world, layout):
    """Embedding 1 all-reduce, each layer's attention and MLP 1 each, the logits 1 all-gather; a
    rank's KDA state holds its heads only."""
    row = launches[world][0]["layouts"][layout]
    n_layers = 6  # the tiny model
    assert row["decode_collectives"] == {"all_reduce": 1 + 2 * n_layers, "all_gather": 1}
    assert row["kda_heads"] == 4 // world


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_a_contiguous_conv_split_is_caught(launches, world):
    """The planted bug of tensor_parallel.md §8.7 (the 3*qkv conv cut as one block, which
    round-trips and passes every shape check) moves the first prefill chunk's logits."""
    for out in launches[world]:
        assert out["planted"]["delta"] > 100 * TOL, f"went unnoticed: max |Δ| {out['planted']['delta']:.3e}"


# ---------------------------------------------------------------------- one process
def test_tp1_is_exactly_the_ordinary_model():
    from trnrt.models.glm5_next.model import Glm5NextForServing
    from trnrt.models.glm5_next.mtp import Glm5NextMTP
    from trnrt.models.glm5_next.rank_model import load_rank_model, state_config
    from trnrt.models.glm5_next.weights import load_model
    from trnrt.models.tiny import default_model_dir
    from trnrt.parallel.context import ParallelContext

    d = default_model_dir()
    for dtype in (torch.float32, torch.bfloat16):
        a = load_model(d, dtype=dtype, load_mtp=True)
        b = load_rank_model(d, dtype, ParallelContext.single(), load_mtp=True)
        assert type(b) is Glm5NextForServing and type(b.mtp) is Glm5NextMTP
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb)
        assert all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
        assert state_config(b) is b.config


def test_a_rank_has_local_state_and_refuses_another_layout():
    from trnrt.models.glm5_next.config import Glm5NextConfig
    from trnrt.models.glm5_next.rank_model import build_rank_model, read_full_then_shard, state_config
    from trnrt.models.glm5_next.weights import CheckpointError
    from trnrt.models.tiny import default_model_dir
    from trnrt.parallel.context import ParallelContext

    d = default_model_dir()
    cfg = Glm5NextConfig.from_pretrained(d)
    ctx = ParallelContext.for_rank(2, 1, ep_size=2)  # no group: built, not run
    model = build_rank_model(cfg, read_full_then_shard(d, cfg, ctx, load_mtp=True), ctx)
    st = model.allocate_state(4, 8, 3, mtp=True)
    assert st.kda.shape[2] == cfg.linear_num_heads // 2 and st.conv.shape[2] == cfg.conv_channels // 2
    assert st.latent.shape[-1] == cfg.kv_lora_rank and st.mtp is not None  # MLA latents whole
    assert state_config(model).linear_num_heads == 2 and model.config is cfg
    assert int(model.embed_tokens.vocab_start) == cfg.vocab_size // 2
    assert int(model.layers[1].mlp.expert_start) == cfg.n_routed_experts // 2
    other = read_full_then_shard(d, cfg, ParallelContext.for_rank(4, 1), load_mtp=True)
    with pytest.raises(CheckpointError, match="embed_tokens.weight"):
        build_rank_model(cfg, other, ctx)
