"""One tensor / expert-parallel rank's glm5_next model with FP8 block-quantized weights.

`load_fp8_rank_model(model_dir, dtype, ctx, ...)` is fp8.load.load_fp8_model for a rank of
`ctx` (tp_size > 1; at TP=1 it returns load_fp8_model's model): the FP8 checkpoint as stored, or
a bf16 / fp32 one quantized per block as it loads (`quantization="fp8"`, SGLang's online FP8);
`names.split` sorts the tensors into FP8 linears, FP8 expert stacks and the rest; then

* the rank reads only its share (rank_read.read_fp8_rank_state_dict: the FP8 weights' rows /
  columns or experts and the matching scale blocks, every other tensor as the bf16 rank's
  sliced read), or, online, its bf16 slices quantized (rank_quantize); both first plan the
  shard from the headers, so a layout that would hand a rank part of a scale block is refused,
  naming the tensor (shard.scale_rule), before any weight is read and before anything is built;
* the rank model (`rank_model._skeleton`: RankForServing and the parallel_blocks, built from the
  rank's local config on meta) gets Fp8Linear / Fp8Experts in place of the FP8 modules, at the
  rank's local shapes, and the tensors are assigned with load.load_fp8_model's checks.

Fusion: `load.prepare_fp8` keeps the projections of a block with an FP8 part apart, as at TP=1
(fusing FP8 pieces would need a fused scale grid whose blocks line up across the pieces, which
the replicated 576-row kv_a does not); such blocks take their unfused forward, same maths. The
parallel blocks are the bf16 ones: their collectives sit around the block, so the FP8 modules
inside need nothing of their own.

Reading: `read_fp8_parts` + shard.shard_fp8_tensors (the whole checkpoint read, then cut) is
kept as the reference the sliced readers are tested against, bit for bit; the load never uses it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trnrt.parallel.context import ParallelContext

from ..config import ConfigError
from ..model import Glm5NextForServing
from ..moe import Experts
from ..rank_model import _rank_buffers, _skeleton
from ..sharded_load import checkpoint_files
from ..sharding import expert_config
from ..weights import read_safetensors
from . import backend, names, qconfig
from .blocks import DEFAULT_BLOCK, FP8_DTYPE
from .checkpoint import quantize_raw
from .load import _assign, _child, _configs, _replace, load_fp8_model, prepare_fp8, wants_fp8
from .modules import Fp8Experts, Fp8Linear
from .rank_quantize import quantize_rank_state_dict
from .rank_read import plan, read_fp8_rank_state_dict

log = logging.getLogger("trnrt.models.glm5_next")


def read_fp8_parts(model_dir: str | Path, cfg, load_mtp: bool, quantization: str | None,
                   online_block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[names.Fp8Tensors, qconfig.QuantConfig]:
    """The whole checkpoint split into its FP8 and other tensors (serving names), and its
    QuantConfig; a checkpoint without quantization_config is quantized now, per `online_block`
    (`--quantization fp8`: 128 x 128, SGLang's online FP8)."""
    qc = qconfig.read(model_dir)
    if qc is None and quantization != "fp8":
        raise ConfigError("quantization", f"{model_dir} is not an FP8 checkpoint and quantization is not 'fp8'")
    raw = read_safetensors(model_dir)
    if qc is None:
        qc = qconfig.QuantConfig(block=tuple(online_block))
        raw = quantize_raw(raw, qc)
    return names.split(raw, cfg, qc, load_mtp), qc


def build_fp8_rank_model(cfg, mtp_cfg, sd: dict[str, torch.Tensor], qc: qconfig.QuantConfig, ctx: ParallelContext,
                         dtype: torch.dtype, device: str | torch.device = "cpu") -> Glm5NextForServing:
    """The rank's model from its FP8 serving state dict (see the module doc; an Fp8Linear per
    `<module>.qweight`, Fp8Experts per `<experts>.gate_q`): eval, frozen, prepared."""
    linears = [k[: -len(".qweight")] for k in sd if k.endswith(".qweight")]
    experts = [k[: -len(".gate_q")] for k in sd if k.endswith(".mlp.experts.gate_q")]
    model = _skeleton(cfg, ctx, mtp_cfg, set(sd))
    with torch.device("meta"):
        for path in linears:
            old = _child(model, path, torch.nn.Linear, path + ".weight")  # rank-local in / out features
            _replace(model, path, Fp8Linear(old.in_features, old.out_features, qc.block, dtype))
        ecfg = expert_config(cfg, ctx)  # E / ep experts of I / moe_tp: the rank's stacks
        for path in experts:
            _child(model, path, Experts, path + ".0.gate_proj.weight")
            _replace(model, path, Fp8Experts(ecfg, qc.block, dtype))
    _assign(model, sd, dtype, device)
    _rank_buffers(model, torch.device(device))
    backend.select(torch.device(device))  # how FP8 weights multiply on this device (logged once)
    model.requires_grad_(False)
    model.eval()
    prepare_fp8(model)
    fp8 = sum(p.nbytes for p in model.parameters() if p.dtype == FP8_DTYPE)
    log.info("glm5_next rank %d/%d (ep %d): FP8 weights (block %s), %.1f MiB FP8 on this rank",
             ctx.tp_rank, ctx.tp_size, ctx.ep_size, list(qc.block), fp8 / 2**20)
    return model


def check_fp8_layout(model_dir: str | Path, tp_size: int, ep_size: int = 1, quantization: str | None = None,
                     load_mtp: bool = False) -> None:
    """Refuse, before any weight is read, a layout whose cut would split an FP8 scale block: the
    checkpoint's headers as meta tensors through the loader's own split and cut (ShardingError
    naming the tensor, as the load would raise on every rank). Not FP8: nothing to check."""
    if tp_size == 1 or not wants_fp8(model_dir, quantization):
        return
    cfg, _ = _configs(model_dir)
    qc = qconfig.read(model_dir)
    ctx = ParallelContext.for_rank(tp_size, 0, ep_size=ep_size)
    plan(checkpoint_files(model_dir), cfg, qc or qconfig.QuantConfig(), ctx, load_mtp, online=qc is None)


def load_fp8_rank_model(model_dir: str | Path, dtype: torch.dtype, ctx: ParallelContext, load_mtp: bool = False,
                        device: str | torch.device = "cpu", quantization: str | None = None,
                        online_block: tuple[int, int] = DEFAULT_BLOCK) -> Glm5NextForServing:
    """The FP8 model of `ctx`'s rank (module doc). Raises ShardingError naming an FP8 tensor
    whose scale blocks the layout would split, ConfigError / CheckpointError as load_fp8_model."""
    if ctx.tp_size == 1:
        return load_fp8_model(model_dir, dtype=dtype, device=device, load_mtp=load_mtp)
    cfg, mtp_cfg = _configs(model_dir)
    if load_mtp and mtp_cfg.num_nextn_predict_layers != 1:
        raise ConfigError("num_nextn_predict_layers",
                          f"load_mtp needs exactly one MTP layer, the config has {mtp_cfg.num_nextn_predict_layers}")
    qc = qconfig.read(model_dir)
    if qc is None and quantization != "fp8":
        raise ConfigError("quantization", f"{model_dir} is not an FP8 checkpoint and quantization is not 'fp8'")
    if qc is None:  # online: the rank's bf16 slices, quantized per block
        qc = qconfig.QuantConfig(block=tuple(online_block))
        sd = quantize_rank_state_dict(model_dir, cfg, qc, ctx, load_mtp)
    else:
        sd = read_fp8_rank_state_dict(model_dir, cfg, qc, ctx, load_mtp)
    return build_fp8_rank_model(cfg, mtp_cfg if load_mtp else None, sd, qc, ctx, dtype, device)
