"""The one place that decides how an FP8 weight meets an activation.

Today every device takes the dequantize path: the FP8 weight and its block scales become the
activation's dtype inside the graph (`blocks.dequantize`: fp32 product, one rounding), then a
plain GEMM. Correct everywhere and memory-light (the weight stays FP8 between steps; one layer's
weight exists in bf16 for the length of its GEMM). A backend FP8 GEMM (torch._scaled_mm with
1x128 activation / 128x128 weight block scales on Hopper, the Neuron backend's FP8 matmul) goes
here, behind `matmul_kind`, and nowhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import dequantize


def matmul_kind(device: torch.device) -> str:
    """'dequant' (every device today). The name is part of no graph: the FP8 graphs' fingerprint
    comes from the FP8 weight placeholders themselves."""
    return "dequant"


def weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight [..., O, I] in `dtype` (for code that reads `.weight` directly)."""
    return dequantize(q, scale, block, dtype)


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., I] @ W^T for the FP8 weight W = (q [O, I], scale [Ob, Ib]) -> [..., O] in x's dtype."""
    return F.linear(x, dequantize(q, scale, block, x.dtype))
