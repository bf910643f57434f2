"""`--kv-cache-dtype fp8_e4m3`: the MLA latent cache and the indexer's pooled keys and open-pool
tail stored as float8_e4m3fn (scale 1, saturated at +-448: SGLang's default without calibrated
scales; latents are post-RMSNorm and keys post-LayerNorm, so well inside the range).

The attention and indexer forwards below are the default ones (mla.py, indexer.py) with a cast on
every cache write (to FP8) and read (to the activation dtype), and without the fused CPU decode
kernels (they read the cache in the model's dtype). The default modules and their traced lines are
untouched: `use_fp8_kv_cache` re-classes the model's modules only when the flag is given. Keep the
two forwards in step with mla.py / indexer.py. Compiled graphs: `trnrt compile --kv-cache-dtype
fp8_e4m3` (their own folder and hashes; trnrt.compile.manifest.quantization_of).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..batch import _Meta
from ..indexer import Indexer, _decode_selection, index_probe
from ..layers import select_topk, write_state
from ..mla import MLAttention
from ..parallel_blocks import ParallelMLA
from ..state import ModelState
from .blocks import FP8_DTYPE, FP8_MAX


def _store(t: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return t.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype) if cache.dtype == FP8_DTYPE else t.to(cache.dtype)


class Fp8KvMLAttention(MLAttention):
    """MLAttention over an FP8 latent cache (same maths; latents rounded to e4m3 when cached)."""

    def forward(self, x, meta: _Meta, state: ModelState, prev_mask):
        B, S, _ = x.shape
        H, R, Dn = self.H, self.R, self.Dn
        cfg = self.cfg
        if self.in_proj is not None:
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
        c = self.kv_a_layernorm(proj[1])  # [B,S,R]
        pages = state.latent[self.mla_idx]  # [NB, bs, R] FP8
        write_state(state.latent, self.mla_idx, (meta.tok_blk, meta.tok_off), _store(c.reshape(-1, R), pages))
        mask = self.indexer(proj[2], proj[3], proj[4], q_resid, meta, state) if self.indexer is not None else prev_mask
        wkv = self.kv_b_proj.weight.view(H, Dn + self.Dv, R)
        qa = torch.matmul(q.transpose(1, 2), wkv[:, :Dn])  # [B,H,S,R]
        if S == 1:
            B_, H_, _, R_ = qa.shape
            lat = pages[mask.blk, mask.off].to(x.dtype)  # [B,K,R]
            sc = torch.bmm(qa.reshape(B_, H_, R_), lat.transpose(1, 2)) * self.scaling  # [B,H,K]
            sc = sc.masked_fill(~mask.visible.unsqueeze(1), float("-inf"))
            p = torch.softmax(sc, dim=-1, dtype=torch.float32).to(x.dtype)
            ol = torch.bmm(p, lat)  # [B,H,R]
            o = torch.matmul(ol.unsqueeze(2), wkv[:, self.Dn:].transpose(-1, -2))  # [B,H,1,Dv]
            return self.o_proj(o.transpose(1, 2).flatten(-2)), mask
        lat = pages.index_select(0, meta.block_tables.reshape(-1)).view(B, -1, R).to(x.dtype)  # [B,T,R]
        T = lat.shape[1]
        sc = torch.bmm(qa.reshape(B, H * S, R), lat.transpose(1, 2)).view(B, H, S, T) * self.scaling
        sc = sc.masked_fill(~mask.unsqueeze(1), float("-inf"))
        p = torch.softmax(sc, dim=-1, dtype=torch.float32).to(x.dtype)
        ol = torch.bmm(p.view(B, H * S, T), lat).view(B, H, S, R)
        o = torch.matmul(ol, wkv[:, Dn:].transpose(-1, -2))  # [B,H,S,Dv]
        return self.o_proj(o.transpose(1, 2).flatten(-2)), mask


class Fp8KvIndexer(Indexer):
    """Indexer over an FP8 pooled-key cache and tail (same maths; cached values rounded to e4m3)."""

    def forward(self, wk_x, hw_x, gs, q_resid, meta: _Meta, state: ModelState):
        B, S, _ = gs.shape
        Hi, Di, kp = self.Hi, self.Di, self.kp
        k = self.k_norm(wk_x)  # [B,S,Di]
        tail = state.tail[self.full_idx]  # [NS, kp-1, 2, Di] FP8
        old = tail.index_select(0, meta.slot_ids).to(k.dtype)  # [B, kp-1, 2, Di]
        ext = torch.cat([old, torch.stack([k, gs], 2)], 1)  # [B, kp-1+S, 2, Di]
        if S == 1:
            grp = ext.unsqueeze(1)  # [B, 1, kp, 2, Di]
        else:
            grp = ext.gather(1, meta.pool_gather[:, :, None, None].expand(B, -1, 2, Di)).unflatten(1, (-1, kp))
        w = torch.softmax(grp[..., 1, :].float() + self.index_kpool_compress_ape.float(), dim=2).to(k.dtype)
        pooled_new = (w * grp[..., 0, :]).sum(2)  # [B, J, Di]
        pages = state.pooled[self.full_idx]  # [NB, bs/kp, Di] FP8
        write_state(state.pooled, self.full_idx, (meta.pool_blk, meta.pool_off),
                    _store(pooled_new.reshape(-1, Di), pages))
        if S == 1:
            new_tail = ext[:, 1:]
        else:
            new_tail = ext.gather(1, meta.tail_gather[:, :, None, None].expand(B, -1, 2, Di))
        write_state(state.tail, self.full_idx, (meta.slot_ids,), _store(new_tail, tail))
        pk = pages.index_select(0, meta.block_tables.reshape(-1)).view(B, -1, Di)  # [B, P, Di]
        q = self.wq_b(q_resid).unflatten(-1, (Hi, Di))  # [B,S,Hi,Di]
        sc = torch.relu(torch.matmul(q.float(), pk.float().transpose(-1, -2).unsqueeze(1)) * (Di ** -0.5))
        hw = hw_x.float() * (Hi ** -0.5)  # [B,S,Hi]
        iscore = torch.matmul(hw.unsqueeze(-2), sc).squeeze(-2)  # [B,S,P]
        cand = meta.pool_cand
        iscore = iscore.masked_fill(~cand, torch.finfo(iscore.dtype).min)
        sel = select_topk(iscore, min(self.cfg.index_topk // kp, iscore.shape[-1]))[1]  # [B,S,k]
        pool_mask = torch.zeros_like(cand).scatter(-1, sel, cand.gather(-1, sel))  # [B,S,P]
        index_probe(pool_mask, meta)
        if S == 1:
            return _decode_selection(sel, cand.gather(-1, sel), meta, kp)
        P = iscore.shape[-1]
        tok_mask = pool_mask.unsqueeze(-1).expand(B, S, P, kp).reshape(B, S, P * kp)
        return tok_mask | meta.tail_mask | ~meta.valid.unsqueeze(-1)


class Fp8KvParallelMLA(ParallelMLA, Fp8KvMLAttention):
    """A rank's ParallelMLA over an FP8 latent cache (tp_size > 1): ParallelMLA.forward's super()
    is Fp8KvMLAttention.forward here (MRO), so the rank's heads read and write the replicated FP8
    latents and their partial output is all-reduced as without FP8. No code of its own."""


_FP8_KV_CLASS = {MLAttention: Fp8KvMLAttention, Indexer: Fp8KvIndexer, ParallelMLA: Fp8KvParallelMLA}


def use_fp8_kv_cache(model: nn.Module) -> None:
    """Re-class every MLA layer and indexer of `model` (the MTP layer's too) to the FP8-cache forms
    (a rank model's ParallelMLA to Fp8KvParallelMLA; its indexer is replicated, a plain Indexer)."""
    for mod in model.modules():
        new = _FP8_KV_CLASS.get(type(mod))
        if new is not None:
            mod.__class__ = new


def to_fp8_kv_state(state):
    """The same state (ModelState or MTPState) with latent, pooled and tail in float8_e4m3fn;
    the KDA state (fp32) and the conv window keep their dtypes."""
    fp8 = {f: torch.zeros_like(getattr(state, f), dtype=FP8_DTYPE) for f in ("latent", "pooled", "tail")}
    if getattr(state, "mtp", None) is not None:
        fp8["mtp"] = to_fp8_kv_state(state.mtp)
    return dataclasses.replace(state, **fp8)
