"""The one entry point that loads glm5_next, bf16 / fp32 or FP8 (what the engine and `trnrt compile`
call, so an FP8 checkpoint compiles the FP8 graphs it serves; trnrt.models.load_model keeps weights.load_model).

A checkpoint without `quantization_config`, and no `quantization`: weights.load_model, unchanged.
An FP8 checkpoint, or `quantization="fp8"`: fp8.load.load_fp8_model (the FP8 path imports the
bf16 loader's pieces, so the dispatch lives here, above both, not in weights.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import weights
from .fp8 import load as fp8_load
from .model import Glm5NextForServing


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    load_mtp: bool = False, quantization: str | None = None,
) -> Glm5NextForServing:
    """weights.load_model's contract, plus quantization: "fp8" quantizes a bf16 / fp32 checkpoint
    per 128x128 block as it loads; an FP8 checkpoint (config.json's quantization_config, checked:
    an unknown quant_method is a ConfigError naming it) takes the FP8 path by itself."""
    if fp8_load.wants_fp8(model_dir, quantization):
        return fp8_load.load_fp8_model(model_dir, dtype=dtype, device=device, load_mtp=load_mtp)
    return weights.load_model(model_dir, dtype=dtype, device=device, load_mtp=load_mtp)
