"""FP8 weights and their block scales are cut together (fp8/shard.py), and a TP degree that
would split a scale block is refused naming the tensor."""

from __future__ import annotations

import pytest
import torch

from trnrt.models.glm5_next.config import Glm5NextConfig
from trnrt.models.glm5_next.fp8 import blocks
from trnrt.models.glm5_next.fp8.shard import fp8_rule, shard_fp8
from trnrt.models.tiny.build import tiny_text_config
from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import ShardingError, shard_tensor

CFG = Glm5NextConfig.from_dict(tiny_text_config())
BLOCK = (16, 16)  # the tiny dims are below 128: 16-blocks let a TP=2 split keep whole blocks


@pytest.mark.parametrize("name,shape", [
    ("layers.1.self_attn.q_b_proj.weight", (64, 32)),  # column (by head)
    ("layers.1.self_attn.o_proj.weight", (64, 64)),  # row
    ("layers.1.mlp.experts.gate", (8, 32, 64)),  # experts: I over moe_tp
    ("layers.1.mlp.experts.down", (8, 64, 32)),
])
def test_shards_dequantize_to_the_shards_of_the_dequantized_weight(name, shape):
    q, s = blocks.quantize(torch.randn(*shape), BLOCK)
    full = blocks.dequantize(q, s, BLOCK, torch.float32)
    rule = fp8_rule(name, CFG)
    assert rule, name  # every case here is really split
    for rank in range(2):
        ctx = ParallelContext(tp_size=2, tp_rank=rank)
        qs, ss = shard_fp8(name, q, s, BLOCK, rule, ctx)
        want = shard_tensor(full, rule, ctx, name)
        assert torch.equal(blocks.dequantize(qs, ss, BLOCK, torch.float32), want)


def test_a_tp_degree_that_splits_a_block_is_refused():
    name = "layers.1.self_attn.q_b_proj.weight"
    q, s = blocks.quantize(torch.randn(64, 32), (128, 128))
    with pytest.raises(ShardingError) as e:
        shard_fp8(name, q, s, (128, 128), fp8_rule(name, CFG), ParallelContext(tp_size=2, tp_rank=0))
    assert e.value.tensor == name and "128-blocks" in str(e.value)


def test_an_expert_split_that_cuts_a_block_suggests_ep():
    name = "layers.1.mlp.experts.down"  # [E, D, I]: I over moe_tp
    q, s = blocks.quantize(torch.randn(8, 64, 32), (16, 32))
    with pytest.raises(ShardingError) as e:
        shard_fp8(name, q, s, (16, 32), fp8_rule(name, CFG), ParallelContext(tp_size=2, tp_rank=1))
    assert e.value.tensor == name and "--ep-size" in str(e.value)
    qs, ss = shard_fp8(name, q, s, (16, 32), fp8_rule(name, CFG), ParallelContext(tp_size=2, tp_rank=1, ep_size=2))
    assert qs.shape == (4, 64, 32) and torch.equal(ss, s[4:])  # EP: whole experts, their whole grids


def test_an_uncut_dim_may_end_in_a_partial_block():
    """EP owns experts whole (moe_tp 1): their I = 32 with 128-blocks is one partial block, as at
    TP 1, not a split block."""
    name = "layers.1.mlp.experts.down"  # [E, D, I]
    q, s = blocks.quantize(torch.randn(8, 64, 32), (128, 128))
    qs, ss = shard_fp8(name, q, s, (128, 128), fp8_rule(name, CFG), ParallelContext(tp_size=2, tp_rank=1, ep_size=2))
    assert qs.shape == (4, 64, 32) and torch.equal(qs.view(torch.uint8), q[4:].view(torch.uint8)) and torch.equal(ss, s[4:])
