"""One rank's FP8 serving state dict, read as slices of an FP8 checkpoint (issue #31 item 3, #32).

`read_fp8_rank_state_dict(model_dir, cfg, qc, ctx, load_mtp)` returns exactly what the whole
read cut afterwards returns, `shard.shard_fp8_tensors(names.split(read_safetensors(d), cfg, qc,
load_mtp), cfg, ctx, qc.block)` (same names, shapes, dtypes, bit-equal values), but a rank reads
only its share of the checkpoint (sharded_load's pread slices, never a whole tensor it does not own):

* first the plan (`plan`): the checkpoint's headers as meta tensors through that same split and
  cut. Every check of names.split (an FP8 weight without its scale, a wrong grid, ...) and every
  refusal of a layout that splits a scale block happens there, naming the tensor, before a byte
  of weight is read; and the slices read must come out at the plan's names and shapes;
* an FP8 linear's weight [O, I] is read as the rank's rows / columns (its bf16 rule, fp8_rule)
  and its scale grid [Ob, Ib] as the matching blocks only (scale_rule: the splits in block units);
* a routed-expert stack `{gate,up,down}_q` [E, O, I] and `_scale_inv` [E, Ob, Ib] is assembled
  from the per-expert tensors of the experts the rank owns (EP), or of each expert's I-slice and
  its block rows / columns (TP); the scales in fp32, as names.split stacks them;
* every other tensor is read as sharded_load reads a bf16 checkpoint (lazy_tensors: the rank's
  slices, merged experts and conv from their parts, the vision tower never read).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import Rule, shard_shape

from ..config import Glm5NextConfig
from ..sharded_load import (Getter, SliceOpener, checkpoint_files, header_tensors, lazy_tensors, mtp_name,
                            mtp_renamed)
from ..sharding import iter_shards, rule_for
from ..weights import classify_key
from . import names
from .checkpoint import quantize_raw
from .qconfig import QuantConfig
from .shard import fp8_rule, scale_rule, shard_fp8_tensors

SCALE = names.SCALE


def plan(where: dict[str, Path], cfg: Glm5NextConfig, qc: QuantConfig, ctx: ParallelContext,
         load_mtp: bool, online: bool = False) -> dict[str, torch.Tensor]:
    """The rank's serving state dict as meta tensors (names, shard shapes, dtypes) from the
    checkpoint's headers alone, through the whole-read loader's own split and cut (its checks
    and refusals included). online: the checkpoint is quantized per qc first (`--quantization fp8`)."""
    raw = header_tensors(where)
    if online:
        raw = quantize_raw(raw, qc)
    return shard_fp8_tensors(names.split(raw, cfg, qc, load_mtp), cfg, ctx, qc.block)


def _stacked(parts: list, dtype: torch.dtype | None = None) -> Getter:
    """A getter over [E, ...] from per-expert slices [...]: each owned expert's block is read
    straight into its place (no stacked copy of the whole layer)."""

    def get(idx) -> torch.Tensor:  # idx: one slice per dim of [E, ...]
        exps = range(len(parts))[idx[0]]
        out = None
        for j, ex in enumerate(exps):
            t = parts[ex][tuple(idx[1:])]  # [o, i] of this expert
            if out is None:
                out = torch.empty((len(exps),) + tuple(t.shape), dtype=dtype or t.dtype)
            out[j] = t  # a cast to `dtype` is exact (bf16 / fp16 scales -> fp32)
        return out  # [e, o, i]

    return get


def _add_fp8(fp8_keys: Iterable[str], sl: SliceOpener, cfg: Glm5NextConfig, load_mtp: bool,
             shapes: dict, getters: dict) -> dict[str, tuple[str, str | None]]:
    """Add every FP8 weight and its scale grid to the lazy tensors, in serving names (the MTP
    layer as `layers.{N}.`); returns name -> (the name fp8_rule takes, the weight's name for a
    scale grid, None for a weight)."""
    kinds: dict[str, tuple[str, str | None]] = {}
    experts: dict[tuple[str, str], dict[int, str]] = {}  # (path, gate|up|down) -> expert -> key
    for key in fp8_keys:
        kind = classify_key(key, cfg.num_hidden_layers, load_mtp)
        if kind[0] == "expert":
            experts.setdefault((f"layers.{kind[1]}.mlp.experts", kind[3][: -len("_proj")]), {})[kind[2]] = key
        elif kind[0] == "plain":  # a linear's `<module>.weight` (names.split refused anything else)
            path = kind[1][: -len(".weight")]
            for name, k in ((path + ".qweight", key), (path + ".weight_scale_inv", key + SCALE)):
                s = sl(k)
                shapes[name], getters[name] = tuple(s.get_shape()), (lambda idx, s=s: s[idx])
            kinds[path + ".qweight"] = (kind[1], None)
            kinds[path + ".weight_scale_inv"] = (kind[1], path + ".qweight")
    for (path, proj), by_expert in experts.items():
        keys = [by_expert[e] for e in range(cfg.n_routed_experts)]  # every expert: names.split checked
        q, s = [sl(k) for k in keys], [sl(k + SCALE) for k in keys]
        qn, sn = f"{path}.{proj}_q", f"{path}.{proj}_scale_inv"
        shapes[qn], getters[qn] = (len(q), *q[0].get_shape()), _stacked(q)  # [E, O, I]
        shapes[sn], getters[sn] = (len(s), *s[0].get_shape()), _stacked(s, torch.float32)  # [E, Ob, Ib]
        kinds[qn], kinds[sn] = (f"{path}.{proj}", None), (f"{path}.{proj}", qn)
    return kinds


def read_fp8_rank_state_dict(model_dir: str | Path, cfg: Glm5NextConfig, qc: QuantConfig, ctx: ParallelContext,
                             load_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The rank's FP8 serving state dict of an FP8 checkpoint, read as slices (module doc).
    CheckpointError / ShardingError / ConfigError as the whole read's split and cut, raised
    before any weight is read."""
    where = checkpoint_files(model_dir)
    want = plan(where, cfg, qc, ctx, load_mtp)
    fp8 = {k[: -len(SCALE)] for k in where if k.endswith(SCALE)}  # FP8 iff a scale sits beside it
    others = [k for k in where if not k.endswith(SCALE) and k not in fp8]
    with SliceOpener(where) as sl:
        shapes, getters = lazy_tensors(others, sl, cfg, load_mtp)
        kinds = _add_fp8(sorted(fp8), sl, cfg, load_mtp, shapes, getters)
        if load_mtp:
            shapes, getters = mtp_renamed(shapes, cfg), mtp_renamed(getters, cfg)
            kinds = {mtp_name(k, cfg): (mtp_name(r, cfg), w and mtp_name(w, cfg)) for k, (r, w) in kinds.items()}
        rules = {name: _rule(name, kinds.get(name), shapes, cfg, qc, ctx) for name in shapes}
        _check_against_plan(want, shapes, rules, ctx)
        return dict(iter_shards(shapes, lambda nm, idx: getters[nm](idx), cfg, ctx, rule=lambda nm, _: rules[nm]))


def _rule(name: str, kind: tuple[str, str | None] | None, shapes: dict, cfg: Glm5NextConfig,
          qc: QuantConfig, ctx: ParallelContext) -> Rule:
    if kind is None:
        return rule_for(name, cfg)
    weight_rule = fp8_rule(kind[0], cfg)
    if kind[1] is None:
        return weight_rule
    return scale_rule(name, shapes[kind[1]], qc.block, weight_rule, ctx)  # the weight's splits, in blocks


def _check_against_plan(want: dict[str, torch.Tensor], shapes: dict, rules: dict, ctx: ParallelContext) -> None:
    """The slices must make the plan's tensors: a name or shard shape that differs is a bug of
    this reader's mapping (not of the checkpoint, which the plan has checked)."""
    if set(want) != set(shapes):
        raise RuntimeError(f"FP8 sliced read: names differ from the plan (only planned: "
                           f"{sorted(set(want) - set(shapes))[:3]}, only read: {sorted(set(shapes) - set(want))[:3]})")
    for name, t in want.items():
        if shard_shape(rules[name], shapes[name], ctx, name) != tuple(t.shape):
            raise RuntimeError(f"FP8 sliced read: {name} would be {shard_shape(rules[name], shapes[name], ctx, name)}, "
                               f"planned {tuple(t.shape)}")
