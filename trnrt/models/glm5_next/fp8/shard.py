"""Cutting FP8 weights and their block scales for tensor / expert parallelism, together.

The weight's rule is the bf16 weight's (sharding.rule_for); its scale grid [.., Ob, Ib] is cut
by the same rule in block units. A rule that would give a rank part of a scale block (per-rank
rows or columns not a whole number of blocks, e.g. moe_intermediate 2048 at moe_tp 32: 64 of a
128-block) is refused with a ShardingError naming the tensor: shard experts by EP there instead.
Fp8Experts keep gate and up apart, so they take gate_up_proj's rule with one part each.
Used by fp8/rank_read.py (the rank's sliced read) and fp8/rank_load.py (the FP8 rank model).
"""

from __future__ import annotations

import dataclasses

import torch

from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import Rule, ShardingError, Split, shard_tensor

from ..config import Glm5NextConfig
from ..sharding import rule_for, shard_state_dict
from .names import Fp8Tensors


def fp8_rule(name: str, cfg: Glm5NextConfig) -> Rule:
    """The rule of an FP8 tensor's weight: `<module>.weight` for a linear, `<experts>.gate` /
    `.up` / `.down` for an Fp8Experts stack (serving names)."""
    for proj, merged in (("gate", "gate_up_proj"), ("up", "gate_up_proj"), ("down", "down_proj")):
        if name.endswith(f"mlp.experts.{proj}"):
            rule = rule_for(name[: -len(proj)] + merged, cfg)
            return tuple(dataclasses.replace(s, parts=1) for s in rule)  # gate and up are apart here
    return rule_for(name, cfg)


def scale_rule(name: str, shape, block: tuple[int, int], rule: Rule, ctx: ParallelContext) -> Rule:
    """The rule of the scale grid [..., Ob, Ib] of an FP8 weight of `shape` [..., O, I] cut by
    `rule`: the same splits in block units. ShardingError naming `name` when a rank's part of a
    block dim is not whole blocks (a rank would need a scale it shares with another)."""
    out = []
    for s in rule:
        size, _ = ctx.axis(s.axis)
        blk = {len(shape) - 2: block[0], len(shape) - 1: block[1]}.get(s.dim, 1)  # leading dims: experts
        chunk, rem = divmod(shape[s.dim] // s.parts, size)
        if blk > 1 and size > 1 and (rem or chunk % blk):  # an uncut dim may end in a partial block
            raise ShardingError(name, f"{s.axis} size {size} gives each rank {shape[s.dim] / s.parts / size:g} "
                                      f"of dim {s.dim} ({shape[s.dim]}), not whole {blk}-blocks of the FP8 "
                                      f"scales (weight_block_size {list(block)}): choose a --tp-size that "
                                      f"leaves whole blocks{', or --ep-size to own experts whole' if s.axis == 'moe_tp' else ''}")
        out.append(Split(s.dim, s.axis, s.parts, 1))
    return tuple(out)


def shard_fp8(name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], rule: Rule,
              ctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's (FP8 weight, scale) shards of q [..., O, I] and its grid [..., Ob, Ib]."""
    srule = scale_rule(name, tuple(q.shape), block, rule, ctx)
    return shard_tensor(q, rule, ctx, name), shard_tensor(scale, srule, ctx, name + "_scale_inv")


def shard_fp8_tensors(parts: Fp8Tensors, cfg: Glm5NextConfig, ctx: ParallelContext, block: tuple[int, int]
                      ) -> dict[str, torch.Tensor]:
    """The rank's serving state dict from the whole checkpoint's parts (Fp8Linear's `qweight` /
    `weight_scale_inv`, Fp8Experts' `{gate,up,down}_q` / `_scale_inv`, the rest as stored).
    ShardingError naming the first FP8 tensor whose cut would split a scale block (before any
    other tensor is cut). On meta tensors it is the plan of a rank's shard (names, shapes,
    refusals) that fp8/rank_read.py reads as slices; on real ones, that reader's test oracle."""
    fp8: dict[str, torch.Tensor] = {}
    for path, (q, s) in parts.linears.items():
        name = path + ".weight"
        fp8[path + ".qweight"], fp8[path + ".weight_scale_inv"] = shard_fp8(
            name, q, s, block, fp8_rule(name, cfg), ctx)
    for path, stacks in parts.experts.items():
        for proj, (q, s) in stacks.items():
            shown = f"{path}.*.{proj}_proj.weight"  # the release's per-expert names
            fp8[f"{path}.{proj}_q"], fp8[f"{path}.{proj}_scale_inv"] = shard_fp8(
                shown, q, s, block, fp8_rule(f"{path}.{proj}", cfg), ctx)
    return {**shard_state_dict(parts.rest, cfg, ctx), **fp8}
