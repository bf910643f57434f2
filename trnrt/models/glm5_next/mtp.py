"""The MTP ("nextn") layer of GLM-5.3-Flash as a model component (spec §6).

The checkpoint stores it as one extra decoder layer at index `num_hidden_layers`: a plain
pre-norm layer (MLA + DSA indexer, MoE; NO mHC hyper-connections) plus `enorm`, `hnorm`
(RMSNorm D), `eh_proj` (Linear 2D -> D, no bias), `shared_head.norm` (RMSNorm D) and, optionally,
its own `embed_tokens` / `shared_head.head` (absent: the target's embedding / lm_head are used).

    e      = embed(next_token_ids);  e[positions == 0] = 0
    x      = eh_proj(cat[enorm(e), hnorm(h_prev)])          # embeddings first
    h      = x + MLA(input_layernorm(x))                     # own paged latent + indexer cache
    out    = h + MoE(post_attention_layernorm(h))
    h_next = shared_head.norm(out)                           # -> lm_head, and the next draft's h_prev

Row p of a forward reads the token at p+1 (`next_token_ids`) and the hidden state at p
(`h_prev`: the target's final hidden state after the final norm for the first draft step, the
MTP's own `h_next` for later ones) and is cached at position p, so the MTP cache is addressed by
the target's block tables and slots. Same calling convention as the base model (ForwardBatch,
static shapes, padding rows/tokens write only to scratch block 0 / slot 0, no branch on tensor
values). This module is the layer only: no draft loop, no verification, no graph uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Glm5NextConfig, Glm5NextMTPConfig
from .batch import ForwardBatch, _make_meta
from .layers import RMSNorm, _linear
from .mla import MLAttention
from .moe import MoE
from .state import MTPState


@dataclass
class MTPOutput:
    """logits: [B, V] fp32 at each row's last valid token, or [B, S, V] with all_positions.
    hidden: h_next [B, D] at that token (the next draft step's h_prev), or [B, S, D]."""

    logits: torch.Tensor
    hidden: torch.Tensor


class SharedHead(nn.Module):
    """`shared_head.norm` and, when the checkpoint has one, its own `shared_head.head`."""

    def __init__(self, cfg: Glm5NextConfig, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = _linear(cfg.hidden_size, cfg.vocab_size) if own_head else None


class Glm5NextMTP(nn.Module):
    """The MTP layer over its own `MTPState` (see module doc). Parameter names follow the
    checkpoint's `layers.{num_hidden_layers}.*` names (weights.py maps both namings onto them)."""

    def __init__(self, config: Glm5NextConfig, mtp_config: Glm5NextMTPConfig | None = None,
                 own_embed: bool = False, own_head: bool = False):
        super().__init__()
        cfg = config
        D = cfg.hidden_size
        self.config = cfg
        self.layer_idx = cfg.num_hidden_layers
        # Read from config.json for the draft loop; the forward always runs its own indexer.
        self.index_share = bool(mtp_config and mtp_config.index_share_for_mtp_iteration)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D) if own_embed else None
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = _linear(2 * D, D)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        # Layer 0 of the MTPState stacks: its own latent pages, pooled keys and indexer tail.
        self.self_attn = MLAttention(cfg, self.layer_idx, mla_idx=0, full_idx=0)
        self.mlp = MoE(cfg)
        self.shared_head = SharedHead(cfg, own_head)

    def forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, state: MTPState,
                target_embed: torch.Tensor, target_head: torch.Tensor, all_positions: bool = False,
                short_extend: bool = False) -> MTPOutput:
        """batch.input_ids are the NEXT tokens (row p holds token p+1), start_pos / num_new /
        block_tables / slot_ids as for the target at those positions; prev_hidden [B, S, D] (or
        [B, D] for S == 1) the hidden state at each position. target_embed [V, D] / target_head
        [V, D]: the target's embedding and lm_head, used unless this layer has its own.
        short_extend: a few tokens (the draft's catch-up over k + 1 positions): the experts take
        the per-token form (Glm5NextForServing.forward's short_extend). Updates `state` in place
        (latent, pooled keys, tail); returns MTPOutput."""
        cfg = self.config
        meta = _make_meta(cfg, batch, state.block_size, short_extend)
        B = meta.B
        if prev_hidden.dim() == 2:  # [B, D] decode form
            prev_hidden = prev_hidden.unsqueeze(1)
        emb = target_embed if self.embed_tokens is None else self.embed_tokens.weight
        e = F.embedding(batch.input_ids, emb)  # [B,S,D]
        e = e.masked_fill((meta.pos == 0).unsqueeze(-1), 0.0)  # position 0 has no previous token
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(prev_hidden)], -1))  # [B,S,D] embeddings first
        a, _ = self.self_attn(self.input_layernorm(x), meta, state, None)  # [B,S,D]
        h = x + a
        out = h + self.mlp(self.post_attention_layernorm(h), meta.short)  # [B,S,D]
        head = target_head if self.shared_head.head is None else self.shared_head.head.weight
        if all_positions:
            h_next = self.shared_head.norm(out)  # [B,S,D]
        else:
            last = (meta.num_new - 1).clamp(min=0)  # [B]
            h_next = self.shared_head.norm(out.gather(1, last.view(B, 1, 1).expand(B, 1, out.shape[-1])).squeeze(1))
        return MTPOutput(logits=F.linear(h_next, head).float(), hidden=h_next)
