"""mHC hyper-connections of the glm5_next decoder layer: the N residual streams' coefficients
(`hc_coefficients`, with the truncated `sinkhorn`), the collapse of the streams into one sub-layer
input (`HyperConnection.collapse`) and the expansion of its output back into N streams
(`hc_expand`).

The 12 truncated Sinkhorn loops of the tiny model are ~940 of the ~2.7k aten ops of an eager
decode step (see `sinkhorn` for the eager and the traced spelling).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Glm5NextConfig
from .layers import fused_kernels


def hc_coefficients(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    hc: int, iters: int, hc_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre [.., N], post [.., N], comb [.., N, N] (fp32) from streams [.., N, D].

    comb: softmax + eps, then 1 column normalisation and (iters - 1) row+column pairs: exactly
    `iters` column and `iters - 1` row normalisations, truncated, not converged (spec §1.4).
    """
    flat = streams.flatten(-2).float()  # [.., N*D]
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)  # unweighted RMSNorm, fp32
    mix = F.linear(flat, fn.float())  # [.., (2+N)*N]
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre = torch.sigmoid(pre_w * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(post_w * scale[1] + base[hc: 2 * hc])
    comb = comb_w.unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + hc_eps  # [.., N, N]
    # The lines above keep transformers' exact op structure on purpose: folding scale/base into one
    # fused multiply-add moved the end-to-end logits by up to 2e-4 (vs 3e-5) on the tiny model.
    return pre, post, sinkhorn(comb, iters, hc_eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Truncated Sinkhorn of comb [.., N, N]: 1 column normalisation, then (iters - 1) row+column
    pairs, each x / (sum + eps) as transformers writes it.

    Two spellings of the same sums, chosen by a static flag, never by tensor values: under
    torch.export / torch.compile, plain `sum` (Inductor fuses the 39 normalisations into a few
    loops; a GEMM form stayed 480 extern calls per compiled decode step); in eager, the sums as
    `baddbmm(eps, ones, x)` (one dispatch instead of sum + add: 3.0 vs 4.7 us per normalisation,
    ~0.8 ms of an eager batch-8 step). Tests check the two agree.
    """
    if torch.compiler.is_compiling():
        comb = comb / (comb.sum(-2, keepdim=True) + eps)  # column sums (over i, for each j)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)  # row sums
            comb = comb / (comb.sum(-2, keepdim=True) + eps)  # column sums
        return comb
    n = comb.shape[-1]
    lead = comb.shape[:-2]
    x = comb.reshape(-1, n, n)  # [M, N, N]
    ones = torch.ones(n, n, dtype=x.dtype, device=x.device).expand_as(x)
    e = torch.full((), eps, dtype=x.dtype, device=x.device)
    x = x / torch.baddbmm(e, ones, x)  # column sums
    for _ in range(iters - 1):
        x = x / torch.baddbmm(e, x, ones)  # row sums
        x = x / torch.baddbmm(e, ones, x)  # column sums
    return x.view(*lead, n, n)


class HyperConnection(nn.Module):
    """mHC parameters of one sub-layer (`attn_hc` / `ffn_hc`): fn [(2+N)N, N*D], base, scale fp32."""

    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        n = cfg.hc_mult
        self.cfg = cfg
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B,S,N,D] -> (post [B,S,N] fp32, comb [B,S,N,N] fp32, collapsed [B,S,D])."""
        c = self.cfg
        if fused_kernels(streams):
            return torch.ops.trnrt.hc_collapse(
                streams, self.fn, self.base, self.scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
            )
        pre, post, comb = hc_coefficients(
            streams, self.fn, self.base, self.scale, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
        )
        collapsed = (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)  # fp32 product, cast
        return post, comb, collapsed


def hc_expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """new_stream_j = post_j * out + sum_i comb[i, j] * stream_i, in the model dtype.

    post [B,S,N], comb [B,S,N,N], out [B,S,D], residual [B,S,N,D] -> [B,S,N,D]."""
    dt = residual.dtype
    if dt == torch.float32 and fused_kernels(residual):
        return torch.ops.trnrt.hc_expand(post, comb, out, residual)
    B, S, N, D = residual.shape
    expanded = post.to(dt).unsqueeze(-1) * out.unsqueeze(-2)  # [B,S,N,D]
    mixed = torch.baddbmm(
        expanded.view(B * S, N, D), comb.to(dt).transpose(-1, -2).reshape(B * S, N, N), residual.view(B * S, N, D)
    )
    return mixed.view(B, S, N, D)
