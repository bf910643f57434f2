"""Issue #32 item 1 at TP > 1 (and #31): the FP8 rank model (fp8/rank_load.py) equals the FP8
TP=1 model on an FP8 tiny checkpoint at tp2 / ep1 and tp2 / ep2, with the FP8 KV cache too:
max |Δ logit| <= 1e-5 over prefill chunks and decode steps (fp32), greedy tokens equal.

ONE spawn of 2 gloo ranks runs every layout (tp_fp8_checks). The checkpoint is `make-tiny --fp8`'s
layout with weight_block_size [16, 16]: the tiny dims (64, 128, 32) are below 128, so a TP=2
split of the release's 128-blocks would cut a block (refused, see below); 16-blocks keep every
rank's part whole. The one-process tests: that refusal names the tensor, and online FP8
(`--quantization fp8`) of the bf16 checkpoint gives each rank the same FP8 shards as the checkpoint.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from launcher import launch
from tp_fp8_checks import DECODE_STEPS, run_fp8_checks
from tp_model_checks import TOL

BLOCK = (16, 16)
LAYOUTS = [[2, 1, "auto"], [2, 2, "auto"], [2, 2, "fp8_e4m3"]]
NAMES = [f"tp{tp}_ep{ep}_{kv}" for tp, ep, kv in LAYOUTS]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """The tiny checkpoint in the FP8 release layout, 16 x 16 scale blocks."""
    from trnrt.models.glm5_next.fp8.checkpoint import convert_dir
    from trnrt.models.glm5_next.fp8.qconfig import QuantConfig
    from trnrt.models.tiny import default_model_dir

    d = tmp_path_factory.mktemp("fp8tiny") / "ckpt"
    shutil.copytree(default_model_dir(), d)
    convert_dir(d, QuantConfig(block=BLOCK))
    return d


@pytest.fixture(scope="module")
def ranks(fp8_dir, tmp_path_factory) -> list[dict]:
    from trnrt.models import kernels

    kernels.load()  # built once per machine (cached); the ranks then only load it
    t0 = time.monotonic()
    out = launch(run_fp8_checks, 2, tmp_path_factory.mktemp("tpfp8"), timeout_s=180, model_dir=str(fp8_dir),
                 layouts=LAYOUTS)
    bodies = ", ".join(f"{r['seconds']:.1f}" for r in out)
    print(f"\n2 gloo ranks: {len(LAYOUTS)} FP8 layouts in {time.monotonic() - t0:.1f} s (rank bodies {bodies} s)")
    return out


@pytest.mark.parametrize("layout", NAMES)
def test_fp8_rank_model_equals_fp8_tp1(ranks, layout):
    for r, out in enumerate(ranks):
        row = out["layouts"][layout]
        assert row["forwards"] == row["ref_forwards"] and row["num_tokens"] == row["ref_tokens"], (r, row)
        assert row["delta"] <= TOL, f"{layout} rank {r}: max |Δ logit| {row['delta']:.3e} > {TOL}"
        assert row["tokens_equal"], f"{layout} rank {r}: greedy tokens differ from the FP8 TP=1 model"
        assert row["experts"] == "Fp8Experts"
        # FP8 in memory, and less of it than TP=1 (the replicated MLA latent projections stay whole)
        assert 0 < row["fp8_bytes"] < out["ref_fp8_bytes"], (r, row)
    assert ranks[0]["layouts"][layout]["num_tokens"] == 2 + 2 * DECODE_STEPS + 1


# ---------------------------------------------------------------------- one process
def test_a_layout_that_splits_a_scale_block_is_refused_naming_the_tensor():
    """The release's 128-blocks over the tiny dims: TP=2 would give a rank 64 of a 128-block.
    Refused by the load, and before it from the headers alone (what serve runs before the ranks)."""
    from trnrt.models.glm5_next.fp8.rank_load import check_fp8_layout
    from trnrt.models.glm5_next.fp8.rank_load import load_fp8_rank_model
    from trnrt.models.tiny import default_model_dir
    from trnrt.parallel.context import ParallelContext
    from trnrt.parallel.shard import ShardingError

    with pytest.raises(ShardingError) as e:
        load_fp8_rank_model(default_model_dir(), torch.float32, ParallelContext.for_rank(2, 0), quantization="fp8")
    assert e.value.tensor.endswith(".weight") and "128-blocks" in str(e.value) and "--tp-size" in str(e.value)
    with pytest.raises(ShardingError) as pre:
        check_fp8_layout(default_model_dir(), 2, 1, quantization="fp8")
    assert pre.value.tensor == e.value.tensor
    check_fp8_layout(default_model_dir(), 2, 1)  # bf16, no quantization: nothing to check


def test_online_fp8_shards_equal_the_fp8_checkpoints(fp8_dir):
    """`--quantization fp8` of the bf16 checkpoint (here per 16-block) and the FP8 checkpoint
    written from it give a rank the same FP8 weights and scales, bit for bit, and bf16 elsewhere."""
    from trnrt.models.glm5_next.fp8.rank_load import load_fp8_rank_model
    from trnrt.models.tiny import default_model_dir
    from trnrt.parallel.context import ParallelContext

    ctx = ParallelContext.for_rank(2, 1, ep_size=2)  # no group: built, not run
    online = load_fp8_rank_model(default_model_dir(), torch.float32, ctx, quantization="fp8", online_block=BLOCK)
    stored = load_fp8_rank_model(fp8_dir, torch.float32, ctx)
    a, b = online.state_dict(), stored.state_dict()
    assert list(a) == list(b)
    fp8 = [k for k in a if k.endswith(("qweight", "_q", "_scale_inv"))]
    assert fp8 and all(torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.float32 else a[k],
                                   b[k].view(torch.uint8) if b[k].dtype != torch.float32 else b[k]) for k in fp8)
    assert online.layers[1].mlp.experts.gate_q.shape[0] == 4  # EP 2: 4 of 8 experts whole
    assert online.lm_head.weight.dtype == torch.float32  # kept unquantized (the rank's vocab rows)
