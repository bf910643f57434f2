"""Loading glm5_next with FP8 block-quantized weights (glm5_next.loading.load_model hands over).

An FP8 checkpoint (config.json's `quantization_config`) is read as is; with `quantization="fp8"`
a bf16 / fp32 checkpoint is quantized per 128 x 128 block as it loads (SGLang's online FP8). The
FP8 weights stay FP8 in memory with their fp32 scales (Fp8Linear / Fp8Experts swapped into the
model built on the meta device); every other tensor is loaded as weights.load_model loads it.
Projection fusion (`prepare`) is skipped where a part is FP8: fusing would need bf16 copies.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn as nn

from trnrt.models import kernels

from ..config import ConfigError, Glm5NextConfig, Glm5NextMTPConfig
from ..model import Glm5NextForServing
from ..moe import Experts
from ..weights import CheckpointError, is_fp32_param, read_safetensors
from . import backend, names, qconfig
from .blocks import FP8_DTYPE
from .checkpoint import quantize_raw
from .modules import Fp8Experts, Fp8Linear

log = logging.getLogger("trnrt.models.glm5_next")
QUANTIZATIONS = (None, "fp8")


def wants_fp8(model_dir: str | Path, quantization: str | None) -> bool:
    """Whether load_model must take the FP8 path: `quantization="fp8"` or an FP8 checkpoint.
    Refuses an unknown `quantization` or `quant_method` (ConfigError naming it)."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError("quantization", f"unsupported {quantization!r} (choose fp8, or none)")
    return quantization == "fp8" or qconfig.read(model_dir) is not None


def load_fp8_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                   load_mtp: bool = False) -> Glm5NextForServing:
    """load_model for FP8: same contract (eval mode, errors naming the tensor or field); `dtype`
    is the activation / compute dtype and that of the tensors kept unquantized."""
    cfg, mtp_cfg = _configs(model_dir)
    if load_mtp and mtp_cfg.num_nextn_predict_layers != 1:
        raise ConfigError("num_nextn_predict_layers",
                          f"load_mtp needs exactly one MTP layer, the config has {mtp_cfg.num_nextn_predict_layers}")
    qc = qconfig.read(model_dir)
    raw = read_safetensors(model_dir)
    if qc is None:  # online: quantize the bf16 / fp32 checkpoint now
        qc = qconfig.QuantConfig()
        raw = quantize_raw(raw, qc)
    parts = names.split(raw, cfg, qc, load_mtp)
    del raw
    sd = parts.rest
    with torch.device("meta"):
        model = Glm5NextForServing(cfg)
        if load_mtp:
            from ..mtp import Glm5NextMTP

            model.mtp = Glm5NextMTP(cfg, mtp_cfg, own_embed="mtp.embed_tokens.weight" in sd,
                                    own_head="mtp.shared_head.head.weight" in sd)
        for path, (q, s) in parts.linears.items():
            old = _child(model, path, nn.Linear, path + ".weight")
            _replace(model, path, Fp8Linear(old.in_features, old.out_features, qc.block, dtype))
            sd[path + ".qweight"], sd[path + ".weight_scale_inv"] = q, s
        for path, stacks in parts.experts.items():
            _child(model, path, Experts, path + ".0.gate_proj.weight")
            _replace(model, path, Fp8Experts(cfg, qc.block, dtype))
            for proj, (q, s) in stacks.items():
                sd[f"{path}.{proj}_q"], sd[f"{path}.{proj}_scale_inv"] = q, s
    _assign(model, sd, dtype, device)
    backend.select(torch.device(device))  # how FP8 weights multiply on this device (logged once)
    total = sum(weight_bytes(model).values())
    fp8 = sum(p.nbytes for p in model.parameters() if p.dtype == FP8_DTYPE)
    scales = sum(p.nbytes for n, p in model.named_parameters() if n.endswith("_scale_inv"))
    log.info("glm5_next: FP8 weights (block %s): %d linears + %d expert stacks; resident weights %.1f MiB "
             "= FP8 %.1f MiB + block scales %.2f MiB + other %.1f MiB", list(qc.block), len(parts.linears),
             len(parts.experts), total / 2**20, fp8 / 2**20, scales / 2**20, (total - fp8 - scales) / 2**20)
    model.requires_grad_(False)
    model.eval()
    prepare_fp8(model)
    return model


def _configs(model_dir) -> tuple[Glm5NextConfig, Glm5NextMTPConfig]:
    """The model configs without quantization_config (Glm5NextConfig refuses one: the bf16
    loader must never take an FP8 checkpoint for its own; qconfig has checked it)."""
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    raw.pop(qconfig.FIELD, None)
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k != qconfig.FIELD}
    return Glm5NextConfig.from_dict(raw), Glm5NextMTPConfig.from_dict(raw)


def _child(model: nn.Module, path: str, kind: type, tensor: str) -> nn.Module:
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        raise CheckpointError(tensor, "unexpected tensor (no such module in the model)") from None
    if not isinstance(mod, kind):
        raise CheckpointError(tensor, f"stored as FP8, but {path} is a {type(mod).__name__}, "
                              f"not a {kind.__name__}")
    return mod


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _assign(model: nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype, device) -> None:
    """Check every tensor against the meta model (weights.load_model's checks) and assign it:
    FP8 weights stay FP8, scales fp32, transformers' fp32 parameters fp32, the rest `dtype`."""
    expected = dict(model.state_dict())
    for name, ref in expected.items():
        if name not in sd:
            raise CheckpointError(name, "missing")
        t = sd[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(name, f"shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if ref.dtype == FP8_DTYPE:
            want = FP8_DTYPE
        elif not t.is_floating_point():
            raise CheckpointError(name, f"dtype {t.dtype}, expected a floating-point tensor")
        elif name.endswith("_scale_inv") or is_fp32_param(name):
            want = torch.float32
        else:
            want = dtype
        sd[name] = t.to(device=device, dtype=want).contiguous()
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise CheckpointError(unexpected[0], f"unexpected tensor ({len(unexpected)} in all)")
    model.load_state_dict(sd, strict=True, assign=True)


def prepare_fp8(model: Glm5NextForServing) -> None:
    """Glm5NextForServing.prepare, except that blocks with an FP8 part keep their projections
    apart (their forwards take the unfused path, same maths)."""
    for mod in model.modules():
        if mod is model or not hasattr(mod, "prepare"):
            continue
        if any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in mod.modules()):
            continue
        mod.prepare()
    if model.embed_tokens.weight.device.type == "cpu":
        kernels.load()


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the model's parameters and buffers by dtype (FP8 scales count as fp32)."""
    out: dict[str, int] = {}
    seen: set[int] = set()  # by storage: prepare's fused matrices and their views count once
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        key = str(t.dtype).replace("torch.", "")
        out[key] = out.get(key, 0) + st.nbytes()
    return out
