"""Block-wise FP8 (float8_e4m3fn) quantization: one fp32 scale per [bo, bi] block of a weight.

The layout is DeepSeek-V3's (and every GLM / Kimi FP8 release's): a weight [..., O, I] is stored
as float8_e4m3fn with `weight_scale_inv` [..., ceil(O/bo), ceil(I/bi)] fp32, and
`w ~= fp8(w) * scale_inv` per block. The last block of a dimension may be partial (the release's
kv_a_proj_with_mqa has 576 = 4 x 128 + 64 rows): its scale covers the rows / columns that exist.
Leading dims (experts [E, O, I]) carry their own scale grids.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
DEFAULT_BLOCK = (128, 128)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `shape` ([..., O, I]) and block (bo, bi)."""
    bo, bi = block
    return (*shape[:-2], math.ceil(shape[-2] / bo), math.ceil(shape[-1] / bi))


def check_grid(w_shape, s_shape, block: tuple[int, int], name: str = "weight") -> None:
    """ValueError unless `s_shape` is the scale grid of `w_shape` for `block` (names `name`)."""
    want = scale_grid(tuple(w_shape), block)
    if tuple(s_shape) != want:
        raise ValueError(
            f"{name}: scale shape {tuple(s_shape)} does not match weight {tuple(w_shape)} with "
            f"weight_block_size {list(block)} (expected {want})"
        )


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """scale [..., Ob, Ib] -> [..., O, I]: each block's scale over its (possibly partial) block."""
    bo, bi = block
    O, I = shape[-2], shape[-1]
    s = scale.repeat_interleave(bo, dim=-2)[..., :O, :]  # [..., O, Ib]
    return s.repeat_interleave(bi, dim=-1)[..., :I]  # [..., O, I]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 weight [..., O, I] and its scales [..., Ob, Ib] -> `dtype` weight [..., O, I].

    Computed as fp32 `q * scale` per element, then one rounding to `dtype`: the reference
    block dequantization, bit for bit. Traceable (static shapes, no Python on values)."""
    check_grid(q.shape, scale.shape, block)
    w = q.to(torch.float32) * expand_scale(scale.to(torch.float32), tuple(q.shape), block)
    return w.to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., O, I] (any float dtype) -> (float8_e4m3fn [..., O, I], scale_inv fp32 grid).

    Per block: scale_inv = amax / 448 (so the largest value maps to FP8's max), q = w / scale_inv
    rounded to e4m3 (SGLang's online FP8 and the DeepSeek conversion script do the same). An
    all-zero block gets scale 1 (any scale reproduces zeros)."""
    bo, bi = block
    O, I = w.shape[-2], w.shape[-1]
    Ob, Ib = math.ceil(O / bo), math.ceil(I / bi)
    lead = w.shape[:-2]
    w32 = w.to(torch.float32)
    pad = torch.zeros(*lead, Ob * bo, Ib * bi, dtype=torch.float32, device=w.device)
    pad[..., :O, :I] = w32
    blocks = pad.view(*lead, Ob, bo, Ib, bi)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., Ob, Ib]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / expand_scale(scale, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()
