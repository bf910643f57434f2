"""Quantizing a bf16 / fp32 checkpoint into the release's FP8 layout, in memory (online
`--quantization fp8`) or on disk (`trnrt make-tiny --fp8`).

Per weight the policy (policy.py) picks: `<m>.weight` becomes float8_e4m3fn and
`<m>.weight_scale_inv` fp32 [ceil(O/128), ceil(I/128)] is added. transformers' merged experts
(`mlp.experts.gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]) are first split into the
release's per-expert names, since gate and up are quantized apart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..weights import _RENAMES, is_fp32_param
from . import blocks, policy
from .qconfig import QuantConfig

_MERGED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
FP8_FIELD = "quantization_config"


def _per_expert(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Merged expert stacks -> per-expert `<experts>.{e}.{gate,up,down}_proj.weight` (views)."""
    out: dict[str, torch.Tensor] = {}
    for k, t in raw.items():
        m = _MERGED.match(k)
        if m is None:
            out[k] = t
            continue
        if m.group(2) == "down_proj":
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e]
        else:
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{m.group(1)}.{e}.up_proj.weight"] = t[e, inter:]
    return out


def _keeps_fp32(name: str) -> bool:
    """is_fp32_param under either naming (the release's `hc_attn_base` is `attn_hc.base`)."""
    for a, b in _RENAMES:
        name = name.replace(a, b)
    return is_fp32_param(name)


def quantize_raw(raw: dict[str, torch.Tensor], qc: QuantConfig, cast_rest: torch.dtype | None = None
                 ) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the same checkpoint in the FP8 layout (policy weights quantized per
    block, scales added). Tensors already FP8 are kept. cast_rest: also cast the other floating
    tensors to this dtype, except those transformers keeps in fp32 (what a release stores)."""
    out: dict[str, torch.Tensor] = {}
    for k, t in _per_expert(raw).items():
        if t.dtype == blocks.FP8_DTYPE or k.endswith("_scale_inv"):
            out[k] = t
        elif policy.quantizes(k) and t.dim() == 2 and not qc.keeps_bf16(k):
            out[k], out[k + "_scale_inv"] = blocks.quantize(t, qc.block)
        elif cast_rest is not None and t.is_floating_point() and not _keeps_fp32(k):
            out[k] = t.to(cast_rest).contiguous()
        else:
            out[k] = t.contiguous()
    return out


def convert_dir(model_dir: str | Path, qc: QuantConfig | None = None) -> None:
    """Rewrite a checkpoint directory in place into the release's FP8 layout: model.safetensors
    quantized (non-FP8 tensors in bf16, transformers' fp32 ones fp32) and `quantization_config`
    added to config.json at the top level, as the releases have it."""
    from safetensors.torch import load_file, save_file

    qc = qc or QuantConfig()
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if [p.name for p in files] != ["model.safetensors"]:
        raise ValueError(f"{d}: expected one model.safetensors, found {[p.name for p in files]}")
    sd = quantize_raw(load_file(str(files[0])), qc, cast_rest=torch.bfloat16)
    save_file(dict(sorted(sd.items())), str(files[0]), metadata={"format": "pt"})
    cfg_path = d / "config.json"
    raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    raw[FP8_FIELD] = qc.to_json()
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
