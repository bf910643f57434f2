"""FP8 modules swapped into the serving model only when FP8 is active (`load.load_fp8_model`):
the default bf16 / fp32 model never builds them, so its traced lines and graphs are unchanged.

* Fp8Linear: a bias-free linear whose weight is FP8 + block scales. `.weight` is the dequantized
  weight (in the activation dtype the model runs in), so code that reads a projection's weight
  directly (MLA's absorbed kv_b_proj) works unchanged.
* Fp8Experts: the routed experts with FP8 gate / up / down stacks [E, ...] and per-expert scale
  grids (gate and up stay apart: with I not a multiple of 128 their grids do not concatenate).
  The decode form gathers the chosen experts' FP8 weights and scales, then dequantizes those only;
  the extend forms (grouped / dense) dequantize the whole stack inside the graph.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import Glm5NextConfig
from ..moe import Experts, swiglu
from . import backend
from .blocks import FP8_DTYPE, scale_grid


def _fp8_param(shape, block) -> tuple[nn.Parameter, nn.Parameter]:
    q = nn.Parameter(torch.empty(*shape, dtype=FP8_DTYPE), requires_grad=False)
    s = nn.Parameter(torch.empty(*scale_grid(tuple(shape), block), dtype=torch.float32), requires_grad=False)
    return q, s


class Fp8Linear(nn.Module):
    """y = x @ dequant(qweight, weight_scale_inv)^T; `compute_dtype` is the model's dtype."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block, self.compute_dtype = tuple(block), compute_dtype
        self.qweight, self.weight_scale_inv = _fp8_param((out_features, in_features), self.block)

    @property
    def weight(self) -> torch.Tensor:  # [O, I] in compute_dtype, dequantized on every read
        return backend.weight(self.qweight, self.weight_scale_inv, self.block, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backend.linear(x, self.qweight, self.weight_scale_inv, self.block)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={list(self.block)}"


class Fp8Experts(Experts):
    """Experts over FP8 stacks: gate_q / up_q [E, I, D], down_q [E, D, I] + `*_scale_inv` grids.
    `gate_up_proj` / `down_proj` are the dequantized stacks the inherited extend forms read."""

    def __init__(self, cfg: Glm5NextConfig, block: tuple[int, int], compute_dtype: torch.dtype):
        nn.Module.__init__(self)  # not Experts.__init__: no bf16 stacks
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.I, self.limit = I, cfg.swiglu_limit
        self.block, self.compute_dtype = tuple(block), compute_dtype
        self.gate_q, self.gate_scale_inv = _fp8_param((E, I, D), self.block)
        self.up_q, self.up_scale_inv = _fp8_param((E, I, D), self.block)
        self.down_q, self.down_scale_inv = _fp8_param((E, D, I), self.block)

    def _deq(self, q, s) -> torch.Tensor:
        return backend.weight(q, s, self.block, self.compute_dtype)

    @property
    def gate_up_proj(self) -> torch.Tensor:  # [E, 2I, D] gate rows, then up rows
        return torch.cat([self._deq(self.gate_q, self.gate_scale_inv), self._deq(self.up_q, self.up_scale_inv)], 1)

    @property
    def down_proj(self) -> torch.Tensor:  # [E, D, I]
        return self._deq(self.down_q, self.down_scale_inv)

    def gathered(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Decode form over the chosen experts only: gather FP8 weights + scales, dequantize,
        then the same maths as Experts.gathered. x [T,D], w/idx [T,k] -> [T,D]."""
        T, kk = idx.shape
        D = x.shape[-1]
        f = idx.reshape(-1)  # [T*k]
        pick = lambda q, s: self._deq(q.index_select(0, f), s.index_select(0, f))  # noqa: E731
        gu = torch.cat([pick(self.gate_q, self.gate_scale_inv), pick(self.up_q, self.up_scale_inv)], 1)  # [T*k,2I,D]
        h = torch.matmul(gu.view(T, kk * 2 * self.I, D), x.unsqueeze(-1)).view(T, kk, 2 * self.I)  # [T,k,2I]
        a = swiglu(h[..., : self.I], h[..., self.I:], self.limit, "routed")  # [T,k,I]
        dn = pick(self.down_q, self.down_scale_inv).view(T, kk, D, self.I)  # [T,k,D,I]
        y = torch.matmul(dn, a.unsqueeze(-1)).squeeze(-1)  # [T,k,D]
        return (y.float() * w.unsqueeze(-1)).sum(1).to(x.dtype)  # fp32 accumulation over top-k
