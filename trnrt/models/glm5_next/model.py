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

Eager cost on the tiny model is op dispatch, not FLOPs: a decode step is ~2.7k aten ops
(transformers' forward: ~3.1k), of which the 12 truncated Sinkhorn loops are ~940 (see
`hyper.sinkhorn`). Fused input projections (see `prepare`) save ~30 GEMMs.

This module holds the decoder layer, the model and its export wrapper; the blocks live apart:
`batch` (ForwardBatch, ModelOutput, per-forward metadata), `layers` (RMSNorm, shared helpers,
state writes), `hyper` (mHC), `kda` (linear attention), `mla` + `indexer` (MLA and the DSA
indexer), `moe` (MLPs, router, experts).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from trnrt.models import kernels

from .batch import ForwardBatch, ModelOutput, _make_meta, _Meta
from .config import INDEXED, LINEAR, Glm5NextConfig
from .hyper import HyperConnection, hc_expand
from .kda import KDAttention
from .layers import RMSNorm, _linear
from .mla import MLAttention
from .moe import DenseMLP, MoE
from .state import ModelState


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

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., D] -> fp32 logits [.., V] over the whole vocabulary, for a caller outside
        the forward (the prompt-logprobs step samples from the last hidden state): a rank model
        (rank_model.RankForServing) overrides it to all-gather its vocabulary slice."""
        return F.linear(hidden, self.head_weight()).float()

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
