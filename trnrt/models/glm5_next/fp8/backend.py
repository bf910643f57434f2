"""The one place that decides how an FP8 weight meets an activation.

Two kinds, chosen per device by `matmul_kind` (the choice is made outside any graph, at load, by
`select(device)`; a trace only reads it):

* "dequant" (the CPU, and any device where the FP8 GEMM is missing or fails its self-check): the
  FP8 weight and its block scales become the activation's dtype inside the graph
  (`blocks.dequantize`: fp32 product, one rounding), then a plain GEMM. Correct everywhere and
  memory-light (the weight stays FP8 between steps; one layer's weight exists in bf16 for the
  length of its GEMM).
* "scaled_mm" (CUDA devices of compute capability >= 9.0, Hopper, whose torch has the blockwise
  `torch.nn.functional.scaled_mm`): DeepSeek-V3's recipe, as SGLang and vLLM run it on Hopper: the
  activation is quantized to FP8 per 1 x 128 group of its input features (scale = amax / 448),
  the weight stays FP8 with its 128 x 128 block scales, and one FP8 GEMM applies both. Torch's
  expected scale layouts are not pinned down by its documentation, so `select` runs a self-check
  on the device: candidate layouts against the dequant reference on weights whose blocks differ
  in magnitude by powers of two (a wrong layout is off by ~100 %), and the first within
  SELF_CHECK_TOL of it is kept; none passing, the device stays "dequant" (logged either way).

Only `Fp8Linear` goes through `linear`; the routed experts' grouped forms dequantize (a grouped
FP8 GEMM is not wired). The Neuron backend's FP8 matmul would be a third kind here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .blocks import FP8_DTYPE, FP8_MAX, dequantize, quantize

log = logging.getLogger("trnrt.models.glm5_next")

GROUP = 128  # activation quantization group (input features), DeepSeek-V3's 1 x 128
SELF_CHECK_TOL = 0.08  # relative Frobenius error vs the dequant GEMM (FP8 activations cost ~2-4 %)

# device key ("cuda:0") -> (scale_a layout, scale_b layout) of the FP8 GEMM; absent: "dequant"
_SCALED: dict[str, tuple[str, str]] = {}
_SELECTED: set[str] = set()


def _key(device: torch.device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def matmul_kind(device: torch.device) -> str:
    """'scaled_mm' where `select` kept the FP8 GEMM for `device`, else 'dequant'. The name is part
    of no graph hash key: the FP8 graphs' fingerprint comes from their ops and weight placeholders."""
    return "scaled_mm" if _key(device) in _SCALED else "dequant"


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of GROUP) -> (FP8 [M, K], fp32 scales [M, K / GROUP]): per 1 x 128
    group, scale = amax / 448 (a zero group gets the smallest normal scale, any scale keeps it 0)."""
    M, K = x.shape
    g = x.float().view(M, K // GROUP, GROUP)  # [M, Kb, 128]
    scale = (g.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [M, Kb]
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(M, K)  # [M, K]
    return q, scale


def _layout(scale: torch.Tensor, how: str) -> torch.Tensor:
    """A scale grid in one candidate memory layout: 'rows' as is (row-major), 'cols' the same
    values column-major (outer-dim-major, as cuBLAS's blockwise scales are often laid out)."""
    return scale.contiguous() if how == "rows" else scale.t().contiguous().t()


def _scaled_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, layouts: tuple[str, str],
                   gemm: Callable | None = None) -> torch.Tensor:
    """x [..., I] @ W^T with the FP8 GEMM; W = (q [O, I], scale [O/128, I/128])."""
    from torch.nn.functional import ScalingType

    gemm = gemm or F.scaled_mm
    lead, K = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_activation(x.reshape(-1, K))  # [M, K], [M, K/128]
    out = gemm(xq, q.t(), _layout(xs, layouts[0]), ScalingType.BlockWise1x128,
               _layout(scale.t(), layouts[1]), ScalingType.BlockWise128x128, output_dtype=x.dtype)  # [M, O]
    return out.view(*lead, q.shape[0])


def self_check(device: torch.device, gemm: Callable | None = None, dtype: torch.dtype = torch.bfloat16):
    """The first (scale_a, scale_b) layout whose FP8 GEMM matches the dequant GEMM on `device`
    within SELF_CHECK_TOL, or None. `gemm` replaces F.scaled_mm (tests inject stand-ins)."""
    g = torch.Generator().manual_seed(0)
    O, I, M = 256, 384, 8
    w = torch.randn(O, I, generator=g)
    w = w * torch.tensor([1.0, 4.0]).repeat_interleave(128)[:, None]  # block rows x1 / x4
    w = w * torch.tensor([1.0, 8.0, 0.5]).repeat_interleave(128)[None, :]  # block columns x1 / x8 / x0.5
    x = torch.randn(M, I, generator=g) * torch.tensor([1.0, 16.0, 0.25]).repeat_interleave(128)
    w, x = w.to(device), x.to(device=device, dtype=dtype)
    q, s = quantize(w)
    ref = F.linear(x, dequantize(q, s, (128, 128), dtype)).float()
    for layouts in (("rows", "rows"), ("cols", "rows"), ("rows", "cols"), ("cols", "cols")):
        try:
            got = _scaled_linear(x, q, s, layouts, gemm).float()
        except Exception as e:  # this layout (or the op itself) is not supported here
            log.debug("FP8 GEMM self-check %s on %s: %s", layouts, device, e)
            continue
        err = float((got - ref).norm() / ref.norm())
        if err <= SELF_CHECK_TOL:
            return layouts
        log.debug("FP8 GEMM self-check %s on %s: relative error %.3f", layouts, device, err)
    return None


def select(device: torch.device) -> str:
    """Choose (once per device, outside any graph) and log how FP8 weights multiply on `device`:
    'scaled_mm' on a Hopper-class CUDA device whose FP8 GEMM passes `self_check`, else 'dequant'."""
    key = _key(device)
    if key not in _SELECTED:
        _SELECTED.add(key)
        d = torch.device(key)
        ok = None
        if (d.type == "cuda" and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
                and torch.cuda.get_device_capability(d) >= (9, 0)):
            ok = self_check(d)
        if ok is not None:
            _SCALED[key] = ok
        log.info("FP8 weights on %s: %s", key, "FP8 GEMM (torch scaled_mm, 1x128 activation / 128x128 weight "
                 f"blocks, scale layouts {ok})" if ok else "dequantized per block inside the graph, then a plain GEMM")
    return matmul_kind(device)


def weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight [..., O, I] in `dtype` (for code that reads `.weight` directly)."""
    return dequantize(q, scale, block, dtype)


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., I] @ W^T for the FP8 weight W = (q [O, I], scale [Ob, Ib]) -> [..., O] in x's dtype."""
    layouts = _SCALED.get(_key(x.device)) if x.device.type == "cuda" else None
    if layouts is not None and tuple(block) == (128, 128) and q.shape[-1] % GROUP == 0 and q.shape[0] % 128 == 0:
        return _scaled_linear(x, q, scale, layouts)
    return F.linear(x, dequantize(q, scale, block, x.dtype))
