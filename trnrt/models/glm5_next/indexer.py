"""The DSA indexer of glm5_next's full-indexer MLA layers: k-pool compression of the keys (pooled
keys paged, the open pool's tail per slot), scoring of every complete pool, and the top-k
selection: a dense token mask for an extend, a `Selection` of the chosen tokens for a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .batch import _Meta
from .config import Glm5NextConfig
from .layers import _linear, fused_kernels, select_topk, write_state
from .state import ModelState


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
