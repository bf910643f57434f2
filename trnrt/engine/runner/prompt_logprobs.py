"""Prompt logprobs (`--prompt-logprobs`, issue 17 item 5): the prefill step that also returns every
position's logprob.

`PromptLogprobsStepFunction` is the prefill step with one more input and three more outputs. It
runs the model with all-position logits [B, S, V] and returns, besides the base step's four
outputs (the next token sampled exactly as the base graph samples it: from the last token's
hidden state through the same head and sampler), for every position i of the chunk:

- `prompt_token_logprobs` [B, S] fp32: log p(next_ids[b, i] | tokens <= i), the raw distribution
  (log-softmax of the fp32 logits, as the sampler's logprobs);
- `prompt_top_ids` [B, S, N] int64 and `prompt_top_logprobs` [B, S, N] fp32: the N most likely
  tokens at i (N = EngineConfig's top-logprob width, as decode's top-N);
- `prompt_token_ranks` [B, S] int64: 1 + the number of tokens more likely than next_ids[b, i]
  (vLLM's `rank`; a [B, S, V] compare-and-count, no sort).

`next_ids` [B, S] int64 is the token each position predicts: the prompt shifted by one, and at
a chunk's last position the first token of the next chunk (the engine knows the whole prompt),
so a chunked prompt gets every position's logprob with no branch in the graph. Positions with no
next prompt token (the prompt's last, padding) carry any id and are ignored by the engine.
"""

from __future__ import annotations

import torch

from trnrt.engine.runner.step import STEP_INPUT_NAMES, StepFunction

_NUM_BASE = len(STEP_INPUT_NAMES)

from trnrt.engine.sample.logits_processors import PROMPT_LOGPROBS, apply_processors, processor_flags, processors_for  # noqa: E402,F401
PROMPT_INPUT_NAMES = ("next_ids",)  # [B, S] int64, after STEP_INPUT_NAMES
PROMPT_OUTPUT_NAMES = ("prompt_token_logprobs", "prompt_top_ids", "prompt_top_logprobs", "prompt_token_ranks")  # after STEP_OUTPUT_NAMES


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, num_top: int):
    """logits [B, S, V] fp32, next_ids [B, S] -> (token logprobs [B, S], top ids [B, S, N],
    top logprobs [B, S, N], token ranks [B, S]); N = num_top clamped to [1, V], as the
    sampler's top-N."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, S, V]
    tok = logp.gather(-1, next_ids.clamp(0, logp.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)  # [B, S]
    n = max(1, min(num_top, logp.shape[-1]))
    top_lp, top_ids = torch.topk(logp, n, dim=-1)  # [B, S, N]
    rank = (logp > tok.unsqueeze(-1)).sum(-1) + 1  # [B, S] int64
    return tok, top_ids, top_lp, rank


class PromptLogprobsStepFunction(StepFunction):
    """The prefill StepFunction + every position's logprobs (see the module docstring).

    `flags`: the logits processors' flags also enabled (structured outputs, penalties): their
    processors run on the sampled token's logits as in their own variant (inputs after the base
    inputs, in chain order, then `next_ids`); the prompt logprobs are of the raw distribution."""

    def __init__(self, model, state, num_top_logprobs: int, sampling: str = "full", flags=()):
        super().__init__(model, state, num_top_logprobs, sampling)
        self.processors = processors_for(processor_flags(flags))

    def forward(self, *inputs: torch.Tensor):
        from trnrt.models.glm5_next.batch import ForwardBatch

        base, extra, next_ids = inputs[:_NUM_BASE], inputs[_NUM_BASE:-1], inputs[-1]
        input_ids, start_pos, num_new, block_tables, slot_ids = base[:5]
        batch = ForwardBatch(input_ids=input_ids, start_pos=start_pos, num_new=num_new, block_tables=block_tables,
                             slot_ids=slot_ids)
        out = self.model(batch, self.state, all_logits=True)  # logits [B, S, V], hidden [B, D] at the last token
        # the sampled token: the base graph's arithmetic (last hidden state -> head), not a row
        # of the all-position GEMM, so it samples exactly what the base prefill samples
        # (head_logits: at TP > 1 the rank's vocabulary slice all-gathered to [B, V])
        last = self.model.head_logits(out.hidden)  # [B, V]
        last = apply_processors(self.processors, last, extra)
        sampled = self.sample_logits(last, *base)
        return (*sampled, *prompt_logprobs(out.logits, next_ids, self.num_top_logprobs))


def prompt_extra_input_names(flags) -> tuple[str, ...]:
    """The extra inputs of the prompt-logprobs variant of `flags`: the processors', then next_ids."""
    from trnrt.engine.runner.variant_step import extra_input_names

    return extra_input_names(processor_flags(flags)) + PROMPT_INPUT_NAMES


def prompt_extra_example_inputs(flags, batch: int, tokens: int, vocab_size: int, device) -> tuple[torch.Tensor, ...]:
    """Neutral extra inputs of that variant (every processor neutral, next_ids 0)."""
    from trnrt.engine.runner.variant_step import extra_example_inputs

    return (extra_example_inputs(processor_flags(flags), batch, vocab_size, device)
            + (torch.zeros((batch, tokens), dtype=torch.int64, device=device),))
