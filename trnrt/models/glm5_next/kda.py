"""Kimi Delta Attention (KDA), the linear-attention layer of glm5_next: fused input projections,
the causal short conv over a per-slot window, the per-channel forget gate, the delta-rule
recurrence (one decode token, a short extend unrolled, or chunked) and the gated output norm.

The chunked form solves the intra-chunk triangular system with `torch.linalg.solve_triangular`
instead of transformers' row loop (same maths, different rounding, checked to 1e-4 in fp32).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .batch import _Meta
from .config import Glm5NextConfig
from .layers import RMSNorm, _fuse, _linear, fused_kernels, write_state
from .state import ModelState

# Chunk length of the chunked KDA form (as transformers / FLA).
KDA_CHUNK = 64


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA o_norm: all-fp32 RMSNorm times weight, times SIGMOID(gate) (not silu), cast back."""
    if x.dtype == gate.dtype == weight.dtype == torch.float32 and fused_kernels(x):
        return torch.ops.trnrt.gated_rms_norm(x, gate, weight, eps)
    x32 = x.float()
    y = weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps): the sqrt-and-divide form of FLA / transformers (spec lesson 3)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class ForgetGate(nn.Module):
    """Per-CHANNEL log-decay g [B,S,H,Dk] fp32 (not a per-head scalar; spec lesson 2)."""

    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        H, Dk = cfg.linear_num_heads, cfg.linear_head_dim
        self.H, self.Dk = H, Dk
        self.f_a_proj = _linear(cfg.hidden_size, Dk)
        self.f_b_proj = _linear(Dk, H * Dk)
        self.dt_bias = nn.Parameter(torch.empty(H * Dk))
        self.A_log = nn.Parameter(torch.empty(H))
        self.lower_bound = cfg.linear_lower_bound

    def forward(self, fa: torch.Tensor) -> torch.Tensor:
        """fa = f_a_proj(x) [B,S,Dk] -> g [B,S,H,Dk] fp32."""
        f = (self.f_b_proj(fa).float() + self.dt_bias.float()).unflatten(-1, (self.H, self.Dk))
        rate = torch.exp(self.A_log.float()).view(self.H, 1)  # per head, broadcast over channels
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))  # as transformers


class _Conv(nn.Module):
    def __init__(self, channels: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, k))  # depthwise, kept fp32


def kda_recurrent_step(q, k, v, g, beta, s0):
    """One KDA token for every row. q,k [B,H,Dk] (l2-normed, q scaled), v [B,H,Dv], g [B,H,Dk]
    log-decay, beta [B,H], s0 [B,H,Dk,Dv] fp32 -> (o [B,H,Dv], s1)."""
    s = s0 * torch.exp(g).unsqueeze(-1)  # decay along the key dim, per channel
    kv = (s * k.unsqueeze(-1)).sum(-2)  # [B,H,Dv] = S^T k (broadcast-sum: few ops, no permutes)
    s = s + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - kv)).unsqueeze(-2)
    o = (s * q.unsqueeze(-1)).sum(-2)  # [B,H,Dv] = S^T q
    return o, s


def kda_unrolled(q, k, v, g, beta, s0):
    """The recurrence token by token over a short extend (a speculative verify's k + 1 tokens):
    S recurrent steps cost less than one chunk's pairwise decays and triangular solve there.
    Shapes and padding as kda_chunked -> (o [B,S,H,Dv], final state)."""
    s, outs = s0, []
    for t in range(k.shape[1]):  # S is static: unrolled at trace time
        o, s = kda_recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(o)
    return torch.stack(outs, 1), s


def kda_chunked(q, k, v, g, beta, s0, chunk: int = KDA_CHUNK):
    """Chunked KDA (same maths as the recurrence). q,k [B,S,H,Dk] (normed, q scaled), v [B,S,H,Dv],
    g [B,S,H,Dk], beta [B,S,H], s0 [B,H,Dk,Dv]; all fp32. Tokens with g = 0 and beta = 0 leave the
    state untouched (padding). Returns (o [B,S,H,Dv], final state).

    Within a chunk with cumulative log-decay G (inclusive), writing u_t = beta_t (v_t - S~_t^T k_t):
      (I + L) U = beta*V - beta*(K e^G) S0,    L_ts = beta_t sum_c k_t k_s e^{G_t-G_s}  (s < t)
      O = (Q e^G) S0 + M U,                    M_ts = sum_c q_t k_s e^{G_t-G_s}         (s <= t)
      S_C = e^{G_C} S0 + (K e^{G_C-G})^T U
    """
    B, S, H, Dk = k.shape
    Dv = v.shape[-1]
    C = min(chunk, S)
    pad = (-S) % C
    q, k, v, g = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v, g))  # [B,H,S',D]
    beta = F.pad(beta.transpose(1, 2), (0, pad)).unsqueeze(-1)  # [B,H,S',1]
    N = (S + pad) // C
    ar = torch.arange(C, device=k.device)
    incl = ar[:, None] >= ar[None, :]  # [C(t), C(s)]
    strict = ar[:, None] > ar[None, :]
    eye = torch.eye(C, device=k.device, dtype=k.dtype)
    s = s0
    outs = []
    # One chunk at a time: the pairwise decay tensor is [B,H,C,C,Dk] per chunk (134 MB at the real
    # size), never [B,H,S/C,C,C,Dk] for the whole bucket.
    for n in range(N):
        sl = slice(n * C, (n + 1) * C)
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        G = g[:, :, sl].cumsum(-2)  # [B,H,C,Dk] inclusive cumulative log-decay
        if fused_kernels(G):  # eager CPU: the pairwise sums without the [B,H,C,C,Dk] tensor
            A, M = torch.ops.trnrt.kda_chunk_pairs(qc.reshape(-1, C, Dk), kc.reshape(-1, C, Dk), G.reshape(-1, C, Dk))
            A, M = A.view(B, H, C, C), M.view(B, H, C, C)  # A strictly lower, M lower (as below)
        else:
            diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B,H,C(t),C(s),Dk], <= 0 where t >= s
            decay = torch.exp(diff.masked_fill(~incl[:, :, None], float("-inf")))  # 0 above the diagonal
            A = ((kc.unsqueeze(-2) * kc.unsqueeze(-3)) * decay).sum(-1)  # [B,H,C,C]
            M = ((qc.unsqueeze(-2) * kc.unsqueeze(-3)) * decay).sum(-1)  # inclusive
        lhs = eye + (bc * A).masked_fill(~strict, 0.0)
        eG = torch.exp(G)
        rhs = torch.cat([bc * vc, bc * (kc * eG)], dim=-1)  # [B,H,C,Dv+Dk]
        W1, W2 = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True).split([Dv, Dk], -1)
        u = W1 - W2 @ s  # [B,H,C,Dv]
        outs.append((qc * eG) @ s + M @ u)
        GC = G[:, :, -1:]  # [B,H,1,Dk]
        s = torch.exp(GC).transpose(-1, -2) * s + (kc * torch.exp(GC - G)).transpose(-1, -2) @ u
    o = torch.cat(outs, 2)[:, :, :S].transpose(1, 2)  # [B,S,H,Dv]
    return o, s


class KDAttention(nn.Module):
    """Kimi Delta Attention layer with causal short conv; state in per-sequence slots."""

    def __init__(self, cfg: Glm5NextConfig, layer_idx: int, kda_idx: int):
        super().__init__()
        D, H, Dk = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
        self.cfg, self.layer_idx, self.kda_idx = cfg, layer_idx, kda_idx
        self.H, self.Dk, self.K = H, Dk, cfg.linear_conv_kernel_dim
        qkv = H * Dk
        self.q_proj, self.k_proj, self.v_proj = _linear(D, qkv), _linear(D, qkv), _linear(D, qkv)
        self.conv1d = _Conv(3 * qkv, self.K)
        self.forget_gate = ForgetGate(cfg)
        self.b_proj = _linear(D, H)
        self.g_a_proj = _linear(D, Dk)
        self.g_b_proj = _linear(Dk, qkv)
        self.o_norm = RMSNorm(Dk, cfg.rms_norm_eps)
        self.o_proj = _linear(qkv, D)
        self.register_buffer("in_proj", None, persistent=False)  # fused input projection (prepare)

    def prepare(self) -> None:
        self.in_proj = _fuse(self, [(self.q_proj, "weight"), (self.k_proj, "weight"), (self.v_proj, "weight"),
                                    (self.forget_gate.f_a_proj, "weight"), (self.g_a_proj, "weight"),
                                    (self.b_proj, "weight")])

    def forward(self, x: torch.Tensor, meta: _Meta, state: ModelState) -> torch.Tensor:
        B, S, _ = x.shape
        H, Dk, K = self.H, self.Dk, self.K
        dt = x.dtype
        valid = meta.valid.unsqueeze(-1)  # [B,S,1]
        x = x * valid.to(dt)  # padded tokens read zeros (finite everywhere)
        qkv_dim = H * Dk
        if self.in_proj is not None:  # fused [q|k|v|f_a|g_a|b] projection
            proj = F.linear(x, self.in_proj)
            qkv, fa, ga, bb = proj.split([3 * qkv_dim, Dk, Dk, H], dim=-1)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
            fa, ga, bb = self.forget_gate.f_a_proj(x), self.g_a_proj(x), self.b_proj(x)
        if S == 1 and dt == torch.float32 and fused_kernels(x):
            o = self._decode_fused(qkv, fa, bb, meta, state)  # [B,H,Dv] fp32
            gate = self.g_b_proj(ga).unflatten(-1, (H, Dk))
            o = gated_rms_norm(o.unsqueeze(1), gate, self.o_norm.weight, self.o_norm.eps)  # [B,1,H,Dv]
            return self.o_proj(o.flatten(-2))
        qkv = qkv.transpose(1, 2)  # [B,C,S]
        conv_state = state.conv[self.kda_idx]  # [NS, C, K-1]
        win = conv_state.index_select(0, meta.slot_ids)  # [B,C,K-1]
        win = torch.where(meta.restart[:, None, None], torch.zeros_like(win), win)
        xc = torch.cat([win, qkv], -1)  # [B,C,K-1+S]
        w = self.conv1d.weight.squeeze(1)  # [C, K] fp32
        # depthwise causal conv as multiply-add over the K taps (mkldnn conv is slow at these sizes)
        y = F.silu((xc.to(w.dtype).unfold(-1, K, 1) * w.unsqueeze(1)).sum(-1)).to(dt)  # [B,C,S]
        if S == 1:
            new_win = xc[:, :, 1:]  # decode: num_new is 1, or 0 on padding rows (scratch slot)
        else:  # window after the last VALID token: columns num_new .. num_new+K-2 of xc
            wi = (meta.num_new[:, None] + torch.arange(K - 1, device=x.device)[None, :])[:, None, :]
            new_win = xc.gather(2, wi.expand(B, xc.shape[1], K - 1))
        write_state(state.conv, self.kda_idx, (meta.slot_ids,), new_win)
        q, k, v = y.transpose(1, 2).unflatten(-1, (3 * H, Dk)).split(H, dim=2)  # [B,S,H,Dk] each

        g = self.forget_gate(fa)  # [B,S,H,Dk] fp32
        beta = torch.sigmoid(bb).float()  # [B,S,H]
        g = torch.where(valid.unsqueeze(-1), g, torch.zeros_like(g))  # decay 1 on padding
        beta = torch.where(valid, beta, torch.zeros_like(beta))  # no write on padding
        q = l2norm(q.float()) * (Dk ** -0.5)
        k = l2norm(k.float())
        v = v.float()
        rec = state.kda[self.kda_idx]  # [NS,H,Dk,Dv] fp32
        s0 = rec.index_select(0, meta.slot_ids)
        s0 = torch.where(meta.restart[:, None, None, None], torch.zeros_like(s0), s0)
        if S == 1:
            o, s1 = kda_recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
            o = o.unsqueeze(1)
        elif meta.short:
            o, s1 = kda_unrolled(q, k, v, g, beta, s0)
        else:
            o, s1 = kda_chunked(q, k, v, g, beta, s0)
        write_state(state.kda, self.kda_idx, (meta.slot_ids,), s1)
        gate = self.g_b_proj(ga).unflatten(-1, (H, Dk))
        o = gated_rms_norm(o.to(dt), gate, self.o_norm.weight, self.o_norm.eps)  # [B,S,H,Dv]
        return self.o_proj(o.flatten(-2))

    def _decode_fused(self, qkv, fa, bb, meta: _Meta, state: ModelState) -> torch.Tensor:
        """The conv, gates, norms and recurrence of one decode token in one C++ call (eager, fp32;
        trnrt/models/kernels): same maths as the plain path below, state updated in place."""
        fg = self.forget_gate
        return torch.ops.trnrt.kda_decode(
            qkv[:, 0], fg.f_b_proj(fa)[:, 0], bb[:, 0], state.conv, state.kda, self.kda_idx, meta.slot_ids,
            meta.restart, meta.valid[:, 0], self.conv1d.weight, fg.dt_bias, fg.A_log, fg.lower_bound, self.Dk ** -0.5,
        )  # [B,H,Dv]
