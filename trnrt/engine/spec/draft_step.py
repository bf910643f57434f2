"""The `draft` graph: the MTP layer's k draft steps for a decode batch, as one static-shape call.

It is the fixed-shape form of `MTPDrafter.propose` (trnrt.engine.spec.drafter), which runs it
eagerly or compiled whenever a proposal fits the shape: k = the preset's speculative_num_steps
and at most k + 1 positions pending per row (what a verify leaves: the n + 1 tokens it emitted).

    catch-up  one MTP extend over each row's pending positions M .. L-1   -> draft 1, h
              (a short extend: the experts in their per-token form)
    k - 1     MTP decode steps at L .. L+k-2, fed the previous draft and h -> drafts 2 .. k
    restore   the MTP's indexer tail as it was after the catch-up (the drafts are not verified)

Inputs (DRAFT_INPUT_NAMES): input_ids [B, k+1] the pending next tokens (row position p holds
the token at p + 1), start_pos [B] = M, num_new [B] = pending count (0: a padding row),
block_tables [B, mb], slot_ids [B], prev_hidden [B, k+1, D] the target's final hidden states of
the pending positions. Output: draft_ids [B, k] int64 (argmax of each step: deterministic drafts,
so the rejection rule keeps sampled rows exact). State: the MTP layer's own stack (MTPState).

Its module (`DraftModel`) holds only what the draft reads (the MTP layer, the target's embedding
and lm_head), so the graph's weights are those, not the whole model's.
"""

from __future__ import annotations

import torch
from torch import nn

DRAFT_INPUT_NAMES = ("input_ids", "start_pos", "num_new", "block_tables", "slot_ids", "prev_hidden")
DRAFT_OUTPUT_NAMES = ("draft_ids",)
VERIFY_OUTPUT_NAMES = ("token_ids", "num_accepted", "hidden")


class DraftModel(nn.Module):
    """The parts of the serving model a draft reads: `mtp`, `embed_tokens`, `lm_head` (None when
    tied). Same parameter objects as the model's (no copy); `config` is the model's."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if getattr(model, "mtp", None) is None:
            raise ValueError("the draft graph needs the model's MTP layer (load_model(..., load_mtp=True))")
        self.config = model.config
        self.mtp = model.mtp
        self.embed_tokens = model.embed_tokens
        self.lm_head = model.lm_head

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight


class DraftFunction(nn.Module):
    """k MTP steps over `state` (an MTPState) -> draft_ids [B, k] (see the module doc)."""

    def __init__(self, draft_model: DraftModel, state, k: int):
        super().__init__()
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.model = draft_model
        self.state = state
        self.k = int(k)

    def forward(self, input_ids, start_pos, num_new, block_tables, slot_ids, prev_hidden):
        from trnrt.models.glm5_next.batch import ForwardBatch

        mtp, embed, head = self.model.mtp, self.model.embed_tokens.weight, self.model.head_weight()
        out = mtp(ForwardBatch(input_ids, start_pos, num_new, block_tables, slot_ids), prev_hidden, self.state,
                  embed, head, short_extend=True)  # logits [B, V], hidden [B, D] at each row's last pending position
        drafts = [out.logits.argmax(-1)]  # [B]
        h = out.hidden  # [B, D]
        if self.k > 1:
            saved = self.state.tail.index_select(1, slot_ids)  # [1, B, kpool-1, 2, Di]
            live = (num_new > 0).long()  # [B] padding rows stay padding
            end = start_pos + num_new  # [B] L: the target's computed length
            for j in range(1, self.k):
                ids = (drafts[-1] * live)[:, None]  # [B, 1]
                out = mtp(ForwardBatch(ids, end + (j - 1) * live, live, block_tables, slot_ids), h, self.state,
                          embed, head)
                drafts.append(out.logits.argmax(-1))
                h = out.hidden
            self.state.tail.index_copy_(1, slot_ids, saved)
        return (torch.stack(drafts, 1),)  # [B, k]
