"""The variant step: the base step with a chain of logits processors before the sampler.

A variant graph takes the base STEP_INPUT_NAMES inputs, then each processor's inputs (in chain
order), runs the same model forward, applies the processors to the last-token logits [B, V] and
samples with the same sampler. With every processor input neutral it gives the base graph's
tokens and logprobs. Logprobs are of the processed distribution (as vLLM reports them after
logits processors); with neutral inputs that is the raw one.
"""

from __future__ import annotations

import torch

from trnrt.engine.sample.logits_processors import apply_processors, processors_for
from trnrt.engine.runner.step import STEP_INPUT_NAMES, StepFunction

_NUM_BASE = len(STEP_INPUT_NAMES)


class VariantStepFunction(StepFunction):
    """StepFunction + the processors of `flags` (same model, state and sampler kinds)."""

    def __init__(self, model, state, num_top_logprobs: int, flags, sampling: str = "full"):
        super().__init__(model, state, num_top_logprobs, sampling)
        self.processors = processors_for(flags)
        self.extra_input_names = tuple(n for p in self.processors for n in p.input_names)

    def forward(self, *inputs: torch.Tensor):
        base, extra = inputs[:_NUM_BASE], inputs[_NUM_BASE:]
        logits = apply_processors(self.processors, self.logits(*base), extra)  # [B, V]
        return self.sample_logits(logits, *base)


def extra_example_inputs(flags, batch: int, vocab_size: int, device) -> tuple[torch.Tensor, ...]:
    """Neutral values of the extra inputs of the variant of `flags` for a batch of `batch` rows."""
    return tuple(t for p in processors_for(flags) for t in p.example_inputs(batch, vocab_size, device))


def extra_input_names(flags) -> tuple[str, ...]:
    return tuple(n for p in processors_for(flags) for n in p.input_names)
