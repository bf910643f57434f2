"""Online FP8 (`--quantization fp8`) at TP > 1: a rank reads its bf16 / fp32 slices and quantizes
only its share.

`quantize_rank_state_dict(model_dir, cfg, qc, ctx, load_mtp)` returns exactly what the whole read
quantized and cut returns (`shard_fp8_tensors(names.split(quantize_raw(read_safetensors(d), qc),
..))`), bit for bit. Why that holds: block quantization is per block (a block's scale is its own
amax / 448, each value divided by its block's scale), and the plan (rank_read.plan, the headers
through quantize_raw, split and cut on meta) refuses every layout whose cut is not whole blocks,
so a rank's slice is a whole number of the whole tensor's blocks, at the same block offsets.
Which tensors become FP8 is the plan's decision (the policy applied to checkpoint names, as the
whole read applies it), not re-derived from serving names here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trnrt.parallel.context import ParallelContext

from ..config import Glm5NextConfig
from ..sharded_load import checkpoint_files, read_rank_state_dict
from .blocks import quantize
from .qconfig import QuantConfig
from .rank_read import plan


def quantize_rank_state_dict(model_dir: str | Path, cfg: Glm5NextConfig, qc: QuantConfig, ctx: ParallelContext,
                             load_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The rank's FP8 serving state dict of a bf16 / fp32 checkpoint quantized per qc.block
    (module doc). ShardingError naming a tensor whose cut would split a block, before any read."""
    want = plan(checkpoint_files(model_dir), cfg, qc, ctx, load_mtp, online=True)
    sd = read_rank_state_dict(model_dir, cfg, ctx, load_mtp)  # the rank's slices, stored dtypes
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        path, _, last = name.rpartition(".")
        if last == "weight" and path + ".qweight" in want:  # an FP8 linear: [o, i] -> its blocks
            out[path + ".qweight"], out[path + ".weight_scale_inv"] = quantize(t, qc.block)
        elif last == "gate_up_proj" and path + ".gate_q" in want:  # [e, 2 * i_r, d]: gate and up apart
            half = t.shape[1] // 2  # the rank's gate rows then its up rows (the merged rule's two parts)
            out[path + ".gate_q"], out[path + ".gate_scale_inv"] = quantize(t[:, :half], qc.block)
            out[path + ".up_q"], out[path + ".up_scale_inv"] = quantize(t[:, half:], qc.block)
        elif last == "down_proj" and path + ".down_q" in want:  # [e, d, i_r]
            out[path + ".down_q"], out[path + ".down_scale_inv"] = quantize(t, qc.block)
        else:
            out[name] = t
    if {k: tuple(v.shape) for k, v in out.items()} != {k: tuple(v.shape) for k, v in want.items()}:
        raise RuntimeError("online FP8 rank read: names / shapes differ from the plan "
                           f"({sorted(set(out) ^ set(want))[:4]})")
    return out
