"""Verify: the target over k + 1 tokens per sequence, and the acceptance rule, in one call.

A verify row feeds [last token, draft_1 .. draft_k] at positions L .. L+k (L = start_pos, the
tokens already in the cache) as a multi-token extend, the way a prefill chunk runs (the model's
S > 1 path: the dense masked attention over the block table), batched over the decode rows, as
a short extend (the forward's `short_extend`: the KDA recurrence token by token and fp32 experts
gathered per token, cheaper than the chunked and dense forms over k + 1 tokens). Its logits row
j is the target's distribution of position L+1+j, which decides draft j+1
(trnrt.engine.spec.rejection); its hidden row j (the final hidden state after the final norm) is
what the MTP drafter reads at position L+j.

Inputs are the step function's (trnrt.engine.runner.step.STEP_INPUT_NAMES; the runner's `_pack` fills
them): input_ids [B, k+1], num_new = 1 + the row's drafts (0: a padding row). The state is
written for all k + 1 positions; trnrt.engine.spec.rollback undoes the rejected ones.
`extend` is the same forward without the rule (the re-run of the accepted tokens). The
catalogue's `verify` graphs hold `forward` (trnrt.compile.catalogue.speculative_specs).
"""

from __future__ import annotations

from torch import nn

from trnrt.engine.spec.rejection import accept, accept_greedy


class VerifyFunction(nn.Module):
    """model forward over the k + 1 tokens of each row -> the acceptance rule.

    greedy_only: every row is greedy (the argmax rule only: no sort of the vocabulary), as the
    step function's "greedy" sampler; same tokens as the full rule for greedy rows."""

    def __init__(self, model: nn.Module, state, greedy_only: bool = False):
        super().__init__()
        self.model = model
        self.state = state
        self.greedy_only = greedy_only

    def _batch(self, input_ids, start_pos, num_new, block_tables, slot_ids):
        from trnrt.models.glm5_next.batch import ForwardBatch

        return ForwardBatch(input_ids=input_ids, start_pos=start_pos, num_new=num_new, block_tables=block_tables,
                            slot_ids=slot_ids)

    def forward(self, input_ids, start_pos, num_new, block_tables, slot_ids, temperature, top_p, top_k, min_p, seeds,
                sample_pos=None, draft_probs=None):
        """Returns (token_ids [B, k+1] int64: row b emits token_ids[b, :n+1]; num_accepted [B]
        int64; hidden [B, k+1, D]). sample_pos is unused (the rule keys position L+1+j itself);
        draft_probs [B, k, V]: the drafter's q, None for a deterministic drafter."""
        out = self.model(self._batch(input_ids, start_pos, num_new, block_tables, slot_ids), self.state,
                         all_logits=True, short_extend=True)  # logits [B, k+1, V], hidden_all [B, k+1, D]
        drafts = input_ids[:, 1:]  # [B, k]
        num_drafts = (num_new - 1).clamp(min=0)  # [B]
        if self.greedy_only:
            token_ids, n = accept_greedy(out.logits, drafts, num_drafts)
        else:
            token_ids, n = accept(out.logits, drafts, temperature, top_p, top_k, min_p, seeds, start_pos + 1,
                                  num_drafts, draft_probs)
        return token_ids, n, out.hidden_all

    def extend(self, input_ids, start_pos, num_new, block_tables, slot_ids, *_unused) -> None:
        """The target forward alone (state written, logits dropped)."""
        self.model(self._batch(input_ids, start_pos, num_new, block_tables, slot_ids), self.state, short_extend=True)
