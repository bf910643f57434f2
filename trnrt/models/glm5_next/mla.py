"""Multi-head latent attention (MLA) of glm5_next in the absorbed latent form over the paged latent
cache: dense over the indexer's mask in an extend, sparse over its `Selection` in a decode step.

The absorbed form is a deliberate re-formulation of transformers' MLA (same maths, different
rounding, checked to 1e-4 in fp32).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .batch import _Meta
from .config import Glm5NextConfig
from .indexer import Indexer, Selection
from .layers import RMSNorm, _fuse, _linear, fused_kernels, write_state
from .state import ModelState


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
