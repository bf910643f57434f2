"""GLM-5.3-Flash (`glm5_next`) text decoder for serving: a forward over explicit state.

One `forward` serves both graphs of the design:
* extend  (S > 1): a chunk of new tokens per row, each row at its own `start_pos` (chunked prefill);
* decode  (S == 1): one token for each of B rows.
The only Python branches are on static shapes and the config, never on tensor values, so each
(phase, bucket) traces into one graph. Padded rows/tokens are masked, never branched on, and
write only to the reserved scratch block 0 / slot 0 (see state.py).

Numerics follow transformers 5.23 (`modeling_glm5_next.py`) and ../shared/reference/glm5_next.md,
with two deliberate re-formulations (same maths, different rounding, checked to 1e-4 in fp32):
MLA runs in the absorbed latent form, and chunked KDA solves the intra-chunk triangular system
with `torch.linalg.solve_triangular` instead of a row loop.

MoE: decode gathers the chosen experts' weights per token and runs batched matvecs (reads only
the experts it uses: what matters at the HBM floor). Extend in bf16 sorts (token, k) pairs by
expert and runs `torch._grouped_mm` (static shapes, chosen experts' FLOPs only); extend in fp32
runs every expert densely over the chunk, weighted by a dense [T, E] routing matrix, because
`_grouped_mm`'s export kernel accepts bf16 only. The dense form costs E/top_k times the FLOPs:
fine for the tiny model on the CPU, not for the real 288-expert model in fp32.

Eager cost on the tiny model is op dispatch, not FLOPs: a decode step is ~2.7k aten ops
(transformers' forward: ~3.1k), of which the 12 truncated Sinkhorn loops are ~940 (see `sinkhorn`). Fused input projections (see `prepare`) save ~30 GEMMs.

State writes are one multi-index `index_put_` on each whole stacked state tensor (`write_state`),
never a mutation of a per-layer view: AOTInductor re-inplaces the former and copies the whole
input for the latter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from trnrt.models import kernels

from .config import INDEXED, LINEAR, Glm5NextConfig
from .state import ModelState

# Chunk length of the chunked KDA form (as transformers / FLA).
KDA_CHUNK = 64


@dataclass
class ForwardBatch:
    """Padded inputs of one forward (extend if S > 1, decode if S == 1).

    input_ids    [B, S] int64  new tokens, right-padded (pad value is irrelevant)
    start_pos    [B]    int64  tokens already in the cache (num_computed_tokens); 0 = fresh start:
                               the row starts from zero KDA/conv/tail state whatever its slot held
    num_new      [B]    int64  valid new tokens of each row (0 for padding rows)
    block_tables [B, MB] int   physical block of each logical block (padded with 0)
    slot_ids     [B]    int64  per-sequence state slot (0 for padding rows)

    Rows are right-padded: tokens s >= num_new of a row are padding. Padding rows (num_new 0) must
    point at slot 0 and may carry any start_pos / block table (zeros is natural). In a decode
    batch (S == 1) a real row has num_new == 1: the decode graph shifts the conv window and the
    indexer tail by exactly one token (static slices), so num_new == 0 is only for padding rows.
    Every block a row's valid tokens touch (positions < start_pos + num_new) must be in its block
    table; the table's remaining entries may be 0.
    """

    input_ids: torch.Tensor
    start_pos: torch.Tensor
    num_new: torch.Tensor
    block_tables: torch.Tensor
    slot_ids: torch.Tensor


@dataclass
class ModelOutput:
    """logits: [B, V] fp32 at each row's last valid token, or [B, S, V] with all_logits.
    hidden: [B, D] final hidden state (after the mHC mean collapse and final norm) at that token.
    hidden_all: [B, S, D] that state at every position with all_logits (speculative verify feeds
    it to the MTP drafter), else None."""

    logits: torch.Tensor
    hidden: torch.Tensor
    hidden_all: torch.Tensor | None = None


# ----------------------------------------------------------------------------- primitives
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast to the input dtype, then times `weight`."""
    if weight.dtype == x.dtype and fused_kernels(x):
        return torch.ops.trnrt.rms_norm(x, weight, eps)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, kind: str) -> torch.Tensor:
    """Clamped SwiGLU used by every MLP (dense, shared and routed; spec lesson 1).

    `kind` ('dense' | 'shared' | 'routed') is unused here; tests patch this function to check
    that the clamp is reached in each kind of MLP.
    """
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


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


def fused_kernels(x: torch.Tensor) -> bool:
    """Whether the eager step may use trnrt's fused C++ CPU kernels (trnrt/models/kernels) for x.

    Static facts only (loaded library, device, export or not), never tensor values. Under
    torch.export / torch.compile the plain PyTorch path is traced, so graphs never hold the ops."""
    return kernels.available() and x.device.type == "cpu" and not torch.compiler.is_compiling()


def select_topk(x: torch.Tensor, k: int, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1) -> (values, indices).

    Under torch.export / torch.compile and for k <= 2 (the tiny model's router and indexer; the
    real model selects 8 experts and 128 pools), as k max passes instead: Inductor fuses them
    into the surrounding kernels, where each extern topk call of a compiled CPU step costs ~4 us
    (14 of them in a batch-8 decode step). Values best first, ties to the lowest index; a row
    needs k values above -inf (true at both call sites: a kept expert group holds more than k
    experts, non-candidate pools are finfo.min). `sorted` False: the order of the k
    picks is unspecified (topk's sorted=False); the max passes give it sorted anyway.
    """
    if k > 2 or not torch.compiler.is_compiling():
        r = x.topk(k, dim=-1, sorted=sorted)
        return r.values, r.indices
    i1 = x.argmax(-1, keepdim=True)  # [.., 1]
    v1 = x.gather(-1, i1)
    if k == 1:
        return v1, i1
    ar = torch.arange(x.shape[-1], device=x.device)
    x2 = x.masked_fill(ar == i1, float("-inf"))
    i2 = x2.argmax(-1, keepdim=True)
    return torch.cat([v1, x2.gather(-1, i2)], -1), torch.cat([i1, i2], -1)


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


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def _fuse(owner: nn.Module, parts: list[tuple[nn.Module, str]]) -> torch.Tensor:
    """Concatenate weights that read the same input into one [sum(out), in] matrix, and re-point
    the original parameters at views of it (no extra memory, state_dict unchanged). One GEMM
    instead of several: decode on a small model is bound by op count, not FLOPs."""
    fused = torch.cat([getattr(m, n).detach() for m, n in parts], 0)
    off = 0
    for m, n in parts:
        rows = getattr(m, n).shape[0]
        setattr(m, n, nn.Parameter(fused[off: off + rows], requires_grad=False))
        off += rows
    return fused


def write_state(stacked: torch.Tensor, layer: int, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
    """stacked[layer][index] = values, as ONE index_put_ on the whole stacked state tensor.

    Why not `stacked[layer].index_copy_(...)`: that mutates a *view* of a graph input, and
    AOTInductor then clones the whole input, scatters into the clone and copies it back (measured:
    three passes over each MLA layer's entire latent pool per decode step). A multi-index
    `index_put_` on the input itself is re-inplaced: only the written rows are touched.
    Duplicate targets occur only in scratch block 0 / slot 0 (padding), whose contents are never read.
    """
    lead = torch.full_like(index[0], layer)
    stacked.index_put_((lead, *index), values)


# ----------------------------------------------------------------------------- per-forward metadata
@dataclass
class _Meta:
    """Index tensors shared by all layers of one forward (computed once)."""

    B: int
    S: int
    T: int  # gathered key length = max_blocks * block_size
    valid: torch.Tensor  # [B, S] bool, token s < num_new
    pos: torch.Tensor  # [B, S] absolute position of each new token
    restart: torch.Tensor  # [B] bool, start_pos == 0
    num_new: torch.Tensor  # [B]
    slot_ids: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, MB] int64
    tok_blk: torch.Tensor  # [B*S] physical block of each new token's latent; padded tokens -> block 0
    tok_off: torch.Tensor  # [B*S] offset of each new token in its block
    # indexer pooling (per forward, shared by all full-indexer layers)
    pool_gather: torch.Tensor | None  # [B, J*kpool] (extend only) ext index of each candidate pool's tokens
    pool_blk: torch.Tensor  # [B*J] block of each candidate pool's key; incomplete pools -> block 0
    pool_off: torch.Tensor  # [B*J] pool index within its block
    tail_gather: torch.Tensor | None  # [B, kpool-1] (extend only) index into ext of the new right-aligned tail
    pool_cand: torch.Tensor  # [B, S, P] bool, pool complete and its last token visible
    tail_mask: torch.Tensor  # [B, S, T] bool, visible open-pool tokens (always selected)
    # a short extend (a speculative verify or draft catch-up, S = k + 1): the KDA recurrence token
    # by token, experts gathered per token (forward's short_extend); a Python flag, fixed at trace time
    short: bool = False

    @property
    def block_size(self) -> int:
        return self.T // self.block_tables.shape[1]


def _make_meta(cfg: Glm5NextConfig, batch: ForwardBatch, block_size: int, short: bool = False) -> _Meta:
    ids = batch.input_ids
    B, S = ids.shape
    dev = ids.device
    kp = cfg.index_kpool
    bt = batch.block_tables.long()
    MB = bt.shape[1]
    T = MB * block_size
    start = batch.start_pos.long()
    num_new = batch.num_new.long()
    ar = torch.arange(S, device=dev)
    valid = ar[None, :] < num_new[:, None]  # [B, S]
    pos = start[:, None] + ar[None, :]  # [B, S]
    # latent write targets; padded tokens write into scratch block 0
    blk = bt.gather(1, (pos // block_size).clamp(max=MB - 1))
    blk = torch.where(valid, blk, torch.zeros_like(blk))
    tok_blk, tok_off = blk.reshape(-1), (pos % block_size).reshape(-1)

    # pools completed by this chunk: candidates j = 0..J-1 starting at the open pool P0
    J = (kp - 1 + S + kp - 1) // kp
    tail_len = start % kp  # [B] tokens already in the open pool
    p0 = start - tail_len  # [B] first position of the open pool
    jj = torch.arange(J, device=dev)
    mm = torch.arange(kp, device=dev)
    # ext index of position p is p - start + kp - 1
    if S > 1:  # decode reads static slices instead (see Indexer.forward)
        g = (jj[:, None] * kp + mm[None, :]).reshape(-1)[None, :] + (kp - 1 - tail_len)[:, None]  # [B, J*kp]
        pool_gather = g.clamp(max=kp - 2 + S)
        tail_gather = num_new[:, None] + torch.arange(kp - 1, device=dev)[None, :]  # [B, kp-1]
    else:
        pool_gather = tail_gather = None
    pool_start = p0[:, None] + jj[None, :] * kp  # [B, J]
    complete = pool_start + kp <= (start + num_new)[:, None]  # [B, J]
    pblk = bt.gather(1, (pool_start // block_size).clamp(max=MB - 1))
    pool_blk = torch.where(complete, pblk, torch.zeros_like(pblk)).reshape(-1)
    pool_off = ((pool_start % block_size) // kp).reshape(-1)

    P = T // kp
    pool_end = torch.arange(P, device=dev) * kp + (kp - 1)  # [P]
    pool_cand = pool_end[None, None, :] <= pos[:, :, None]  # [B, S, P]
    kpos = torch.arange(T, device=dev)
    tail_start = (pos + 1) // kp * kp  # [B, S]
    tail_mask = (kpos[None, None, :] >= tail_start[:, :, None]) & (kpos[None, None, :] <= pos[:, :, None])
    return _Meta(
        B=B, S=S, T=T, valid=valid, pos=pos, restart=start == 0, num_new=num_new,
        slot_ids=batch.slot_ids.long(), block_tables=bt, tok_blk=tok_blk, tok_off=tok_off,
        pool_gather=pool_gather, pool_blk=pool_blk, pool_off=pool_off, tail_gather=tail_gather,
        pool_cand=pool_cand, tail_mask=tail_mask, short=short and S > 1,
    )


# ----------------------------------------------------------------------------- KDA
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


# ----------------------------------------------------------------------------- MLA + indexer
class Indexer(nn.Module):
    """DSA indexer with k-pool compression; pooled keys paged, open-pool tail per slot."""

    def __init__(self, cfg: Glm5NextConfig, full_idx: int):
        super().__init__()
        D, Hi, Di, kp = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        self.cfg, self.full_idx = cfg, full_idx
        self.Hi, self.Di, self.kp = Hi, Di, kp
        self.wq_b = _linear(cfg.q_lora_rank, Hi * Di)
        self.wk = _linear(D, Di)
        self.k_norm = nn.LayerNorm(Di, eps=1e-6)
        self.weights_proj = _linear(D, Hi)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(kp, Di))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(Di, D))

    def forward(self, wk_x, hw_x, gs, q_resid, meta: _Meta, state: ModelState) -> torch.Tensor:
        """wk_x = wk(x), hw_x = weights_proj(x), gs = x @ compress_gate^T (per-channel gate score),
        each [B,S,*]. Returns the attention mask [B, S, T] bool over the gathered key positions."""
        B, S, _ = gs.shape
        Hi, Di, kp = self.Hi, self.Di, self.kp
        k = self.k_norm(wk_x)  # [B,S,Di]
        if S == 1 and k.dtype == torch.float32 and fused_kernels(k):
            return self._decode_fused(k, hw_x, gs, q_resid, meta, state)
        tail = state.tail[self.full_idx]  # [NS, kp-1, 2, Di]
        old = tail.index_select(0, meta.slot_ids)  # [B, kp-1, 2, Di]
        # ext[i] holds position start-(kp-1)+i. Tail entries older than the open pool (or left by a
        # previous sequence, on restart) are never read: the pool gather starts at kp-1-tail_len.
        ext = torch.cat([old, torch.stack([k, gs], 2)], 1)  # [B, kp-1+S, 2, Di]
        # new pooled keys of the pools this chunk completes
        if S == 1:  # decode: the only pool that can complete is ext[0:kp]; otherwise it goes to scratch
            grp = ext.unsqueeze(1)  # [B, 1, kp, 2, Di]
        else:
            grp = ext.gather(1, meta.pool_gather[:, :, None, None].expand(B, -1, 2, Di))  # [B, J*kp, 2, Di]
            grp = grp.unflatten(1, (-1, kp))  # [B, J, kp, 2, Di]
        w = torch.softmax(grp[..., 1, :].float() + self.index_kpool_compress_ape.float(), dim=2).to(k.dtype)
        pooled_new = (w * grp[..., 0, :]).sum(2)  # [B, J, Di]
        pages = state.pooled[self.full_idx]  # [NB, bs/kp, Di]
        write_state(state.pooled, self.full_idx, (meta.pool_blk, meta.pool_off), pooled_new.reshape(-1, Di))
        if S == 1:
            new_tail = ext[:, 1:]  # decode: num_new is 1 (0 only on padding rows -> scratch slot)
        else:
            new_tail = ext.gather(1, meta.tail_gather[:, :, None, None].expand(B, -1, 2, Di))
        write_state(state.tail, self.full_idx, (meta.slot_ids,), new_tail)

        # score every complete pool of the row (gathered through the block table)
        pk = pages.index_select(0, meta.block_tables.reshape(-1)).view(B, -1, Di)  # [B, P, Di]
        q = self.wq_b(q_resid).unflatten(-1, (Hi, Di))  # [B,S,Hi,Di]
        sc = torch.relu(torch.matmul(q.float(), pk.float().transpose(-1, -2).unsqueeze(1)) * (Di ** -0.5))  # [B,S,Hi,P]
        hw = hw_x.float() * (Hi ** -0.5)  # [B,S,Hi]
        iscore = torch.matmul(hw.unsqueeze(-2), sc).squeeze(-2)  # [B,S,P]
        cand = meta.pool_cand
        iscore = iscore.masked_fill(~cand, torch.finfo(iscore.dtype).min)
        P = iscore.shape[-1]
        sel = select_topk(iscore, min(self.cfg.index_topk // kp, P))[1]  # [B,S,k]
        pool_mask = torch.zeros_like(cand).scatter(-1, sel, cand.gather(-1, sel))  # [B,S,P]
        index_probe(pool_mask, meta)
        if S == 1:
            return _decode_selection(sel, cand.gather(-1, sel), meta, kp)
        tok_mask = pool_mask.unsqueeze(-1).expand(B, S, P, kp).reshape(B, S, P * kp)
        return tok_mask | meta.tail_mask | ~meta.valid.unsqueeze(-1)  # padded queries: anything finite

    def _decode_fused(self, k, hw_x, gs, q_resid, meta: _Meta, state: ModelState) -> "Selection":
        """Pool, tail shift, scoring, top-k and the selection of one decode token in one C++ call
        (eager, fp32; trnrt/models/kernels): same maths as the plain path above."""
        q = self.wq_b(q_resid)[:, 0].unflatten(-1, (self.Hi, self.Di))  # [B,Hi,Di]
        blk, off, visible, pool_mask = torch.ops.trnrt.indexer_decode(
            k[:, 0], gs[:, 0], q, hw_x[:, 0], state.tail, state.pooled, self.full_idx,
            self.index_kpool_compress_ape, meta.block_tables, meta.slot_ids, meta.pos[:, 0], meta.valid[:, 0],
            meta.pool_blk, meta.pool_off, self.cfg.index_topk // self.kp, meta.block_size,
        )
        index_probe(pool_mask, meta)
        return Selection(blk=blk, off=off, visible=visible)


@dataclass
class Selection:
    """A decode step's sparse attention set: K = topk pools x kpool tokens + (kpool - 1) open-pool
    tokens per row; the same keys the dense mask of a prefill would make visible."""

    blk: torch.Tensor  # [B, K] physical block of each selected token
    off: torch.Tensor  # [B, K] offset in the block
    visible: torch.Tensor  # [B, K] bool


def _decode_selection(sel: torch.Tensor, sel_ok: torch.Tensor, meta: _Meta, kp: int) -> Selection:
    """sel [B,1,k] pool indices from the indexer's topk, sel_ok [B,1,k] whether each is a real
    candidate -> the Selection of the decode row (its tokens' blocks and offsets, and visibility).

    Selected pools are complete and the open pool is not, so the two token sets never overlap;
    a row with fewer candidates than k has its surplus picks marked invisible. Padding rows see
    everything they gathered (any finite row will do: their outputs are never read)."""
    B, bs = sel.shape[0], meta.block_size
    ar = torch.arange(kp, device=sel.device)
    pool_tok = (sel[:, 0, :, None] * kp + ar).reshape(B, -1)  # [B, k*kp]
    pool_vis = sel_ok[:, 0, :, None].expand(-1, -1, kp).reshape(B, -1)
    pos = meta.pos[:, 0]  # [B]
    tail_tok = ((pos + 1) // kp * kp)[:, None] + ar[None, : kp - 1]  # [B, kp-1], open pool from its start
    tail_vis = tail_tok <= pos[:, None]
    tok = torch.cat([pool_tok, tail_tok.clamp(max=meta.T - 1)], 1)  # [B, K]
    visible = torch.cat([pool_vis, tail_vis], 1) | ~meta.valid  # [B, K]
    blk = meta.block_tables.gather(1, tok // bs)
    return Selection(blk=blk, off=tok % bs, visible=visible)


def index_probe(pool_mask: torch.Tensor, meta: _Meta) -> None:
    """No-op hook; tests patch it to check the indexer really drops visible positions."""


class MLAttention(nn.Module):
    """NoPE MLA in the absorbed latent form over the paged latent cache."""

    def __init__(self, cfg: Glm5NextConfig, layer_idx: int, mla_idx: int, full_idx: int | None):
        super().__init__()
        D, H, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        self.cfg, self.layer_idx, self.mla_idx = cfg, layer_idx, mla_idx
        self.H, self.R, self.Dn, self.Dv = H, R, cfg.qk_nope_head_dim, cfg.v_head_dim
        self.q_a_proj = _linear(D, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = _linear(cfg.q_lora_rank, H * self.Dn)
        self.kv_a_proj_with_mqa = _linear(D, R)
        self.kv_a_layernorm = RMSNorm(R, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(R, H * (self.Dn + self.Dv))
        self.o_proj = _linear(H * self.Dv, D)
        self.indexer = Indexer(cfg, full_idx) if full_idx is not None else None
        self.scaling = self.Dn ** -0.5
        self.register_buffer("in_proj", None, persistent=False)  # fused input projection (prepare)

    def prepare(self) -> None:
        parts = [(self.q_a_proj, "weight"), (self.kv_a_proj_with_mqa, "weight")]
        if self.indexer is not None:
            ix = self.indexer
            parts += [(ix.wk, "weight"), (ix.weights_proj, "weight"), (ix, "index_kpool_compress_gate")]
        self.in_proj = _fuse(self, parts)

    def forward(self, x, meta: _Meta, state: ModelState, prev_mask):
        B, S, _ = x.shape
        H, R, Dn = self.H, self.R, self.Dn
        cfg = self.cfg
        if self.in_proj is not None:  # fused [q_a | kv_a | indexer wk | weights_proj | compress_gate]
            sizes = [cfg.q_lora_rank, R]
            if self.indexer is not None:
                sizes += [cfg.index_head_dim, cfg.index_n_heads, cfg.index_head_dim]
            proj = F.linear(x, self.in_proj).split(sizes, dim=-1)
        else:
            proj = [self.q_a_proj(x), self.kv_a_proj_with_mqa(x)]
            if self.indexer is not None:
                ix = self.indexer
                proj += [ix.wk(x), ix.weights_proj(x), F.linear(x, ix.index_kpool_compress_gate)]
        q_resid = self.q_a_layernorm(proj[0])  # [B,S,Lq]
        q = self.q_b_proj(q_resid).unflatten(-1, (H, Dn))  # [B,S,H,Dn]
        c = self.kv_a_layernorm(proj[1])  # [B,S,R] the cached latent
        pages = state.latent[self.mla_idx]  # [NB, bs, R]
        write_state(state.latent, self.mla_idx, (meta.tok_blk, meta.tok_off), c.reshape(-1, R))
        if self.indexer is not None:
            mask = self.indexer(proj[2], proj[3], proj[4], q_resid, meta, state)
        else:
            mask = prev_mask  # shared layer: the previous full layer's selection, verbatim
        wkv = self.kv_b_proj.weight.view(H, Dn + self.Dv, R)  # per head [W_UK (Dn rows) | W_UV (Dv rows)]
        qa = torch.matmul(q.transpose(1, 2), wkv[:, :Dn])  # absorbed query [B,H,S,R]
        if S == 1:
            return self._decode_sparse(qa, pages, state.latent, mask, wkv, x.dtype), mask
        lat = pages.index_select(0, meta.block_tables.reshape(-1)).view(B, -1, R)  # [B,T,R]
        T = lat.shape[1]
        # One latent head serves every query head (MQA): fold heads into the rows of a bmm
        # instead of broadcasting the latents over heads, which would copy [B,H,T,R].
        sc = torch.bmm(qa.reshape(B, H * S, R), lat.transpose(1, 2)).view(B, H, S, T) * self.scaling  # [B,H,S,T]
        sc = sc.masked_fill(~mask.unsqueeze(1), float("-inf"))
        p = torch.softmax(sc, dim=-1, dtype=torch.float32).to(x.dtype)
        ol = torch.bmm(p.view(B, H * S, T), lat).view(B, H, S, R)  # latent-space output [B,H,S,R]
        o = torch.matmul(ol, wkv[:, Dn:].transpose(-1, -2))  # [B,H,S,Dv]
        return self.o_proj(o.transpose(1, 2).flatten(-2)), mask

    def _decode_sparse(self, qa, pages, state_latent, sel: Selection, wkv, dtype) -> torch.Tensor:
        """Decode attention over the indexer's selection only (DSA's sparse form): gathers K
        latents per row instead of the whole block table, so the cost follows index_topk, not
        the context length. Same keys and weights as the dense mask; qa [B,H,1,R] -> [B,1,D]."""
        B, H, _, R = qa.shape
        if dtype == torch.float32 and fused_kernels(qa):
            ol = torch.ops.trnrt.mla_decode_attn(qa[:, :, 0], state_latent, self.mla_idx, sel.blk, sel.off,
                                                 sel.visible, self.scaling)  # [B,H,R]
        else:
            lat = pages[sel.blk, sel.off]  # [B,K,R]
            sc = torch.bmm(qa.reshape(B, H, R), lat.transpose(1, 2)) * self.scaling  # [B,H,K]
            sc = sc.masked_fill(~sel.visible.unsqueeze(1), float("-inf"))
            p = torch.softmax(sc, dim=-1, dtype=torch.float32).to(dtype)
            ol = torch.bmm(p, lat)  # latent-space output [B,H,R]
        o = torch.matmul(ol.unsqueeze(2), wkv[:, self.Dn:].transpose(-1, -2))  # [B,H,1,Dv]
        return self.o_proj(o.transpose(1, 2).flatten(-2))


# ----------------------------------------------------------------------------- MLPs
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


# ----------------------------------------------------------------------------- layers / model
class DecoderLayer(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, i: int, kind_idx: int, full_idx: int | None):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == LINEAR:
            self.self_attn = KDAttention(cfg, i, kind_idx)
        else:
            self.self_attn = MLAttention(cfg, i, kind_idx, full_idx)
        self.mlp = MoE(cfg) if cfg.mlp_layer_types[i] == "sparse" else DenseMLP(cfg, cfg.intermediate_size, "dense")

    def forward(self, streams, meta: _Meta, state: ModelState, prev_mask):
        post, comb, x = self.attn_hc.collapse(streams)
        x = self.input_layernorm(x)
        mask = None
        if self.kind == LINEAR:
            x = self.self_attn(x, meta, state)
        else:
            x, mask = self.self_attn(x, meta, state, prev_mask)
        streams = hc_expand(post, comb, x, streams)
        post, comb, x = self.ffn_hc.collapse(streams)
        x = self.post_attention_layernorm(x)
        x = self.mlp(x, meta.short) if isinstance(self.mlp, MoE) else self.mlp(x)
        return hc_expand(post, comb, x, streams), mask


class Glm5NextForServing(nn.Module):
    """The GLM-5.3-Flash text decoder over explicit, caller-owned state (see ForwardBatch)."""

    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        self.config = config
        cfg = config
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = []
        counters = {LINEAR: 0, INDEXED: 0}
        full = 0
        for i, t in enumerate(cfg.layer_types):
            full_idx = None
            if t == INDEXED and cfg.indexer_types[i] == "full":
                full_idx, full = full, full + 1
            layers.append(DecoderLayer(cfg, i, counters[t], full_idx))
            counters[t] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size)
        # The MTP layer (mtp.Glm5NextMTP), attached only by load_model(..., load_mtp=True); the
        # base forward never reads it.
        self.mtp = None

    def prepare(self) -> None:
        """Fuse projections that read the same input (call once after the weights are loaded;
        `load_model` does). Parameters become views of the fused matrices: no extra memory."""
        for mod in self.modules():
            if mod is not self and hasattr(mod, "prepare"):
                mod.prepare()
        if self.embed_tokens.weight.device.type == "cpu":
            kernels.load()  # built once per machine; plain PyTorch if it cannot be built

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def allocate_state(self, num_blocks: int, block_size: int, num_slots: int, mtp: bool = False) -> ModelState:
        """ModelState in this model's dtype and device. mtp: also the MTP layer's own stack
        (`state.mtp`); needs a model loaded with its MTP layer."""
        if mtp and self.mtp is None:
            raise ValueError("allocate_state(mtp=True) needs a model with its MTP layer "
                             "(load_model(..., load_mtp=True))")
        w = self.embed_tokens.weight
        return ModelState.allocate(self.config, num_blocks, block_size, num_slots, w.dtype, w.device, mtp=mtp)

    def forward_mtp(self, batch: ForwardBatch, prev_hidden: torch.Tensor, state: ModelState,
                    all_positions: bool = False):
        """The MTP layer over `state.mtp`, with this model's embedding and lm_head unless the
        layer has its own (see mtp.Glm5NextMTP.forward). Not part of any graph."""
        if self.mtp is None or state.mtp is None:
            raise ValueError("forward_mtp needs the MTP layer (load_mtp=True) and its state (allocate_state(mtp=True))")
        return self.mtp(batch, prev_hidden, state.mtp, self.embed_tokens.weight, self.head_weight(), all_positions)

    def forward(self, batch: ForwardBatch, state: ModelState, all_logits: bool = False,
                all_hidden: bool = False, short_extend: bool = False) -> ModelOutput:
        """Run S new tokens of B rows; updates `state` in place. See ForwardBatch / ModelOutput.
        all_hidden: hidden_all [B, S, D] as with all_logits, logits at the last token only (the
        speculative prefill: the drafter reads every position, only the last one samples).
        short_extend: S is a speculative verify's k + 1 tokens (a few): the KDA recurrence runs
        token by token instead of chunked, and fp32 experts are gathered per token instead of
        dense (kda_unrolled, MoE.forward); same maths, another graph (prefill graphs keep theirs).

        Inference only: `load_model` freezes the parameters, so no autograd graph is built. (No
        `@torch.no_grad` here on purpose: it would wrap the body in a higher-order op under
        torch.export and hide the state mutations from the graph signature.)"""
        meta = _make_meta(self.config, batch, state.block_size, short_extend)
        B, S = meta.B, meta.S
        e = F.embedding(batch.input_ids, self.embed_tokens.weight)  # [B,S,D]
        streams = e.unsqueeze(2).expand(B, S, self.config.hc_mult, e.shape[-1]).contiguous()  # [B,S,N,D]
        mask = None
        for layer in self.layers:
            streams, m = layer(streams, meta, state, mask)
            mask = m  # only the layer directly after a full one may reuse it (validated)
        last = (meta.num_new - 1).clamp(min=0)  # [B]
        head = self.head_weight()
        if all_logits or all_hidden:
            h = self.norm(streams.mean(2))  # [B,S,D]
            hidden = h.gather(1, last.view(B, 1, 1).expand(B, 1, h.shape[-1])).squeeze(1)  # [B,D]
            logits = F.linear(h if all_logits else hidden, head).float()  # [B,S,V] or [B,V]
            return ModelOutput(logits=logits, hidden=hidden, hidden_all=h)
        else:
            st = streams.gather(1, last.view(B, 1, 1, 1).expand(B, 1, *streams.shape[2:])).squeeze(1)  # [B,N,D]
            hidden = self.norm(st.mean(1))  # [B,D]
            logits = F.linear(hidden, head).float()
        return ModelOutput(logits=logits, hidden=hidden)


class TensorForward(nn.Module):
    """Tensors-only wrapper for torch.export: (input_ids, start_pos, num_new, block_tables,
    slot_ids, latent, pooled, kda, conv, tail) -> (logits, hidden). The five state tensors are
    updated in place (after `run_decompositions()` they appear as mutated user inputs)."""

    def __init__(self, model: Glm5NextForServing, block_size: int, all_logits: bool = False):
        super().__init__()
        self.model, self.block_size, self.all_logits = model, block_size, all_logits

    def forward(self, input_ids, start_pos, num_new, block_tables, slot_ids, latent, pooled, kda, conv, tail):
        state = ModelState(latent, pooled, kda, conv, tail, self.block_size, self.model.config.index_kpool)
        out = self.model(ForwardBatch(input_ids, start_pos, num_new, block_tables, slot_ids), state, self.all_logits)
        return out.logits, out.hidden
