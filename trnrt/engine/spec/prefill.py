"""The target prefill of a speculative sequence: the runner's prefill, keeping every position's
hidden state for the drafter.

`SpecPrefillFunction` is the prefill step function (trnrt.engine.runner.step.StepFunction, full
sampler) whose forward also returns the final hidden state of every fed position: the catalogue's
`spec_prefill` graph (one per prefill token bucket x context, as the plain prefill graphs), which
`prefill_chunk` runs compiled where the runner loaded it and eagerly otherwise. The state it
writes is the plain prefill's, computation for computation, and the token is drawn from the last
position's logits as the plain prefill step draws it (lm_head over the last hidden state, the
full sampler: greedy rows take the argmax), so it is the token the runner would return.
(`all_hidden`: no logits for the other positions.)
"""

from __future__ import annotations

import torch

from trnrt.engine.output.outputs import RowInput
from trnrt.engine.runner.step import STEP_OUTPUT_NAMES, GraphSpec, StepFunction

SPEC_PREFILL_OUTPUT_NAMES = STEP_OUTPUT_NAMES + ("hidden",)


class SpecPrefillFunction(StepFunction):
    """The prefill step + hidden [B, S, D] of every position (after the final norm).

    Inputs: STEP_INPUT_NAMES (one prefill row: input_ids [1, S]). Outputs: the step's
    (token_ids, token_logprobs, top_ids, top_logprobs), then hidden."""

    def __init__(self, model: torch.nn.Module, state, num_top_logprobs: int):
        super().__init__(model, state, num_top_logprobs, "full")

    def forward(self, input_ids, start_pos, num_new, block_tables, slot_ids, temperature, top_p, top_k, min_p, seeds,
                sample_pos):
        from trnrt.models.glm5_next.batch import ForwardBatch

        out = self.model(ForwardBatch(input_ids, start_pos, num_new, block_tables, slot_ids), self.state,
                         all_hidden=True)  # logits [B, V] at the last valid token, hidden_all [B, S, D]
        sampled = self.sample_logits(out.logits, input_ids, start_pos, num_new, block_tables, slot_ids, temperature,
                                     top_p, top_k, min_p, seeds, sample_pos)
        return (*sampled, out.hidden_all)


def spec_prefill_spec(runner, row: RowInput) -> GraphSpec:
    """The `spec_prefill` graph a prompt chunk runs in: the plain prefill's bucket and context."""
    cfg = runner.cfg
    n = len(row.token_ids)
    tokens = cfg.prefill_bucket(n)
    return GraphSpec("spec_prefill", 1, tokens, "base", "full",
                     cfg.prefill_context_bucket(max(row.start_pos + n, tokens)))


def prefill_chunk(runner, row: RowInput) -> tuple[int, torch.Tensor]:
    """Run one prefill chunk of `row` (start_pos .. start_pos + n - 1) over the runner's state,
    in the runner's compiled `spec_prefill` graph of the chunk's shape, else eagerly.

    Returns (sampled token id, hidden [n, D] of the chunk's positions); the token is meaningful
    only when the chunk ends the prompt."""
    spec = spec_prefill_spec(runner, row)
    fn = runner.compiled.get(spec)
    if fn is None:  # the eager module, made once per runner
        fn = getattr(runner, "_spec_prefill_fn", None)
        if fn is None:
            fn = runner._spec_prefill_fn = SpecPrefillFunction(runner.model, runner.state,
                                                               runner.cfg.max_top_logprobs)
    else:
        runner.num_graph_calls[spec.graph_id] = runner.num_graph_calls.get(spec.graph_id, 0) + 1
    inputs = runner._pack([row], 1, spec.tokens, spec.context)
    with torch.inference_mode():
        out = fn(*inputs)
        tok, hidden = out[0], out[4]
        return int(tok[0]), hidden[0, : len(row.token_ids)].clone()
