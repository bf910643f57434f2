"""One tensor / expert-parallel rank's glm5_next model with FP8 block-quantized weights.

`load_fp8_rank_model(model_dir, dtype, ctx, ...)` is fp8.load.load_fp8_model for a rank of
`ctx` (tp_size > 1; at TP=1 it returns load_fp8_model's model): the FP8 checkpoint as stored, or
a bf16 / fp32 one quantized per block as it loads (`quantization="fp8"`, SGLang's online FP8);
`names.split` sorts the tensors into FP8 linears, FP8 expert stacks and the rest; then

* the rest (bf16 / fp32: norms, router, embeddings, lm_head, the policy's bf16 linears) is cut
  by `sharding.shard_state_dict`, as the bf16 rank model's shard;
* every FP8 weight is cut with its scale grid by `shard.shard_fp8` (the weight's own rule; the
  grid in block units), which refuses, naming the tensor, a layout that would hand a rank part
  of a scale block. Every FP8 tensor is cut before anything is built, so a refused layout
  costs no model;
* the rank model (`rank_model._skeleton`: RankForServing and the parallel_blocks, built from the
  rank's local config on meta) gets Fp8Linear / Fp8Experts in place of the FP8 modules, at the
  rank's local shapes, and the tensors are assigned with load.load_fp8_model's checks.

Fusion: `load.prepare_fp8` keeps the projections of a block with an FP8 part apart, as at TP=1
(fusing FP8 pieces would need a fused scale grid whose blocks line up across the pieces, which
the replicated 576-row kv_a does not); such blocks take their unfused forward, same maths. The
parallel blocks are the bf16 ones: their collectives sit around the block, so the FP8 modules
inside need nothing of their own.

Reading: every rank reads the whole checkpoint, then cuts it (as rank_model.read_full_then_shard
does): correct for any layout, but each rank's peak host memory is the whole FP8 checkpoint,
not its share (the sliced reader, sharded_load, reads bf16 tensors only so far).
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
from ..sharding import expert_config, shard_state_dict
from ..weights import read_safetensors
from . import backend, names, qconfig
from .blocks import DEFAULT_BLOCK, FP8_DTYPE
from .checkpoint import quantize_raw
from .load import _assign, _child, _configs, _replace, load_fp8_model, prepare_fp8, wants_fp8
from .modules import Fp8Experts, Fp8Linear
from .shard import fp8_rule, shard_fp8

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


def build_fp8_rank_model(cfg, mtp_cfg, parts: names.Fp8Tensors, qc: qconfig.QuantConfig, ctx: ParallelContext,
                         dtype: torch.dtype, device: str | torch.device = "cpu") -> Glm5NextForServing:
    """The rank's model from the checkpoint's parts (see the module doc): eval, frozen, prepared."""
    sd = shard_fp8_tensors(parts, cfg, ctx, qc.block)
    model = _skeleton(cfg, ctx, mtp_cfg, set(sd))
    with torch.device("meta"):
        for path in parts.linears:
            old = _child(model, path, torch.nn.Linear, path + ".weight")  # rank-local in / out features
            _replace(model, path, Fp8Linear(old.in_features, old.out_features, qc.block, dtype))
        ecfg = expert_config(cfg, ctx)  # E / ep experts of I / moe_tp: the rank's stacks
        for path in parts.experts:
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
    from ..safetensors_pread import SafetensorsFile
    from ..sharded_load import checkpoint_files

    if tp_size == 1 or not wants_fp8(model_dir, quantization):
        return
    raw: dict[str, torch.Tensor] = {}
    where = checkpoint_files(model_dir)
    for path in sorted(set(where.values())):
        with SafetensorsFile(path) as f:  # headers only: each file opened once
            for key in (k for k, p in where.items() if p == path):
                sl = f.get_slice(key)
                raw[key] = torch.empty(tuple(sl.get_shape()), dtype=sl.dtype, device="meta")
    cfg, _ = _configs(model_dir)
    qc = qconfig.read(model_dir)
    if qc is None:
        qc = qconfig.QuantConfig()
        raw = quantize_raw(raw, qc)
    parts = names.split(raw, cfg, qc, load_mtp)
    shard_fp8_tensors(parts, cfg, ParallelContext.for_rank(tp_size, 0, ep_size=ep_size), qc.block)


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
    parts, qc = read_fp8_parts(model_dir, cfg, load_mtp, quantization, online_block)
    return build_fp8_rank_model(cfg, mtp_cfg if load_mtp else None, parts, qc, ctx, dtype, device)
