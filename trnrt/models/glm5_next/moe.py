"""The feed-forward blocks of glm5_next: the clamped SwiGLU MLP (`DenseMLP`: dense layers and the
shared expert), the sigmoid group-limited router, the routed experts and the MoE that combines them.

MoE: decode gathers the chosen experts' weights per token and runs batched matvecs (reads only
the experts it uses: what matters at the HBM floor). Extend in bf16 sorts (token, k) pairs by
expert and runs `torch._grouped_mm` (static shapes, chosen experts' FLOPs only); extend in fp32
runs every expert densely over the chunk, weighted by a dense [T, E] routing matrix, because
`_grouped_mm`'s export kernel accepts bf16 only. The dense form costs E/top_k times the FLOPs:
fine for the tiny model on the CPU, not for the real 288-expert model in fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Glm5NextConfig
from .layers import _fuse, _linear, fused_kernels, select_topk


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, kind: str) -> torch.Tensor:
    """Clamped SwiGLU used by every MLP (dense, shared and routed; spec lesson 1).

    `kind` ('dense' | 'shared' | 'routed') is unused here; tests patch this function to check
    that the clamp is reached in each kind of MLP.
    """
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class DenseMLP(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, inter: int, kind: str):
        super().__init__()
        self.gate_proj = _linear(cfg.hidden_size, inter)
        self.up_proj = _linear(cfg.hidden_size, inter)
        self.down_proj = _linear(inter, cfg.hidden_size)
        self.limit, self.kind = cfg.swiglu_limit, kind
        self.inter = inter
        self.register_buffer("gate_up", None, persistent=False)  # fused [gate; up] (prepare)

    def prepare(self) -> None:
        self.gate_up = _fuse(self, [(self.gate_proj, "weight"), (self.up_proj, "weight")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            g, u = F.linear(x, self.gate_up).split([self.inter, self.inter], dim=-1)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(swiglu(g, u, self.limit, self.kind))


class Router(nn.Module):
    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] fp32, expert ids [T, k])."""
        c = self.cfg
        E = c.n_routed_experts
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [T,E]
        choice = scores + self.e_score_correction_bias  # bias only for choosing
        if c.n_group > 1:
            grp = select_topk(choice.view(-1, c.n_group, E // c.n_group), 2)[0].sum(-1)  # [T,G]
            gidx = select_topk(grp, c.topk_group, sorted=False)[1]
            gmask = torch.zeros_like(grp, dtype=torch.bool).scatter(1, gidx, True)
            choice = choice.masked_fill(~gmask.repeat_interleave(E // c.n_group, dim=1), float("-inf"))
        idx = select_topk(choice, c.num_experts_per_tok, sorted=False)[1]
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor, idx


class Experts(nn.Module):
    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))  # gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        self.I, self.limit = I, cfg.swiglu_limit

    def gathered(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Decode form: gather each token's k experts. x [T,D], w/idx [T,k] -> [T,D]."""
        T, kk = idx.shape
        flat_idx = idx.reshape(-1)
        gu = self.gate_up_proj.index_select(0, flat_idx).view(T, kk, -1, x.shape[-1])  # [T,k,2I,D]
        h = torch.matmul(gu.flatten(1, 2), x.unsqueeze(-1)).view(T, kk, 2 * self.I)  # [T,k,2I]
        a = swiglu(h[..., : self.I], h[..., self.I:], self.limit, "routed")  # [T,k,I]
        dn = self.down_proj.index_select(0, flat_idx).view(T, kk, x.shape[-1], self.I)  # [T,k,D,I]
        y = torch.matmul(dn, a.unsqueeze(-1)).squeeze(-1)  # [T,k,D]
        return (y.float() * w.unsqueeze(-1)).sum(1).to(x.dtype)  # fp32 accumulation over top-k

    def grouped(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Extend form: (token, k) pairs sorted by expert, one grouped GEMM per projection.
        Static shapes ([T*k] rows, [E] offsets); FLOPs of the chosen experts only."""
        T, kk = idx.shape
        E = self.gate_up_proj.shape[0]
        flat = idx.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        tok = order // kk  # token of each sorted pair
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)  # [E] end row of each expert's group
        xs = x.index_select(0, tok)  # [T*k, D]
        h = torch._grouped_mm(xs, self.gate_up_proj.transpose(-2, -1), offs=offs)  # [T*k, 2I]
        a = swiglu(h[:, : self.I], h[:, self.I:], self.limit, "routed")  # [T*k, I]
        y = torch._grouped_mm(a, self.down_proj.transpose(-2, -1), offs=offs)  # [T*k, D]
        y = y.float() * w.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)
        return out.to(x.dtype)  # fp32 accumulation over top-k

    def dense(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Extend form: every expert over every token, weighted by a dense [T,E] routing matrix."""
        h = torch.matmul(x.unsqueeze(0), self.gate_up_proj.transpose(1, 2))  # [E,T,2I]
        a = swiglu(h[..., : self.I], h[..., self.I:], self.limit, "routed")  # [E,T,I]
        y = torch.matmul(a, self.down_proj.transpose(1, 2))  # [E,T,D]
        wd = torch.zeros(x.shape[0], self.gate_up_proj.shape[0], dtype=torch.float32, device=x.device)
        wd = wd.scatter(1, idx, w)  # [T,E]
        return torch.einsum("etd,te->td", y.float(), wd).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = DenseMLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts, "shared")

    def forward(self, x: torch.Tensor, short: bool = False) -> torch.Tensor:
        """x [B,S,D] -> [B,S,D]. short: a short extend (a speculative verify or draft catch-up:
        B rows of k + 1 tokens), whose tokens take the decode form (each token's k experts
        gathered, as a decode step of B * (k + 1) rows would) where the extend form would be the
        dense one (fp32: every expert over every token); bf16 keeps the grouped GEMM."""
        B, S, D = x.shape
        flat = x.reshape(-1, D)
        if (S == 1 or short) and x.dtype == torch.float32 and fused_kernels(x):
            return self._decode_fused(flat).view(B, S, D) + self.shared_experts(x)
        w, idx = self.gate(flat)
        if S == 1 or (short and flat.dtype != torch.bfloat16):
            routed = self.experts.gathered(flat, w, idx)
        elif flat.dtype == torch.bfloat16:
            # grouped GEMM: chosen experts' FLOPs only. bf16 only: torch._grouped_mm's fake (export)
            # kernel refuses fp32, so the fp32 extend graph uses the dense form.
            routed = self.experts.grouped(flat, w, idx)
        else:
            routed = self.experts.dense(flat, w, idx)
        return routed.view(B, S, D) + self.shared_experts(x)  # shared expert is not routing-weighted

    def _decode_fused(self, flat: torch.Tensor) -> torch.Tensor:
        """Router + gathered experts of decode tokens in one C++ call (eager, fp32;
        trnrt/models/kernels): same maths as Router.forward and Experts.gathered. [T,D] -> [T,D]."""
        c, g, e = self.gate.cfg, self.gate, self.experts
        return torch.ops.trnrt.moe_routed(
            flat, g.weight, g.e_score_correction_bias, e.gate_up_proj, e.down_proj, c.n_group, c.topk_group,
            c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor, c.swiglu_limit,
        )
