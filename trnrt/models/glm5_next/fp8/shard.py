"""Cutting FP8 weights and their block scales for tensor / expert parallelism, together.

The weight's rule is the bf16 weight's (sharding.rule_for); its scale grid [.., Ob, Ib] is cut
by the same rule in block units. A rule that would give a rank part of a scale block (per-rank
rows or columns not a whole number of blocks, e.g. moe_intermediate 2048 at moe_tp 32: 64 of a
128-block) is refused with a ShardingError naming the tensor: shard experts by EP there instead.
Fp8Experts keep gate and up apart, so they take gate_up_proj's rule with one part each.
Used by fp8/rank_load.py (the FP8 rank model's loader).
"""

from __future__ import annotations

import dataclasses

import torch

from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import Rule, ShardingError, Split, shard_tensor

from ..config import Glm5NextConfig
from ..sharding import rule_for


def fp8_rule(name: str, cfg: Glm5NextConfig) -> Rule:
    """The rule of an FP8 tensor's weight: `<module>.weight` for a linear, `<experts>.gate` /
    `.up` / `.down` for an Fp8Experts stack (serving names)."""
    for proj, merged in (("gate", "gate_up_proj"), ("up", "gate_up_proj"), ("down", "down_proj")):
        if name.endswith(f"mlp.experts.{proj}"):
            rule = rule_for(name[: -len(proj)] + merged, cfg)
            return tuple(dataclasses.replace(s, parts=1) for s in rule)  # gate and up are apart here
    return rule_for(name, cfg)


def shard_fp8(name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], rule: Rule,
              ctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's (FP8 weight, scale) shards of q [..., O, I] and its grid [..., Ob, Ib]."""
    scale_rule = []
    for s in rule:
        size, _ = ctx.axis(s.axis)
        blk = {q.dim() - 2: block[0], q.dim() - 1: block[1]}.get(s.dim, 1)  # leading dims: experts
        chunk, rem = divmod(q.shape[s.dim] // s.parts, size)
        if blk > 1 and (rem or chunk % blk):
            raise ShardingError(name, f"{s.axis} size {size} gives each rank {q.shape[s.dim] / s.parts / size:g} "
                                      f"of dim {s.dim} ({q.shape[s.dim]}), not whole {blk}-blocks of the FP8 "
                                      f"scales (weight_block_size {list(block)}): choose a --tp-size that "
                                      f"leaves whole blocks{', or --ep-size to own experts whole' if s.axis == 'moe_tp' else ''}")
        scale_rule.append(Split(s.dim, s.axis, s.parts, 1))
    return shard_tensor(q, rule, ctx, name), shard_tensor(scale, tuple(scale_rule), ctx, name + "_scale_inv")
