"""The target prefill of a speculative sequence: the runner's prefill, keeping every position's
hidden state for the drafter.

Each chunk runs exactly as `ModelRunner.execute` runs a prefill row (one sequence, tokens padded
to the chunk's prefill bucket, the same table width, the runner's `_pack`), with all_logits so
the forward also returns the final hidden state of every position. The state it writes is the
runner's, computation for computation; the sampled token is drawn from the last position's
logits computed as the base step computes them (lm_head over the last hidden state) by the same
sampler, so it is the token the runner would return. (`all_hidden`: no logits for the other
positions.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trnrt.engine.outputs import RowInput
from trnrt.engine.sampler import SamplingTensors, sample, sample_greedy


def prefill_chunk(runner, row: RowInput) -> tuple[int, torch.Tensor]:
    """Run one prefill chunk of `row` (start_pos .. start_pos + n - 1) over the runner's state.

    Returns (sampled token id, hidden [n, D] of the chunk's positions); the token is meaningful
    only when the chunk ends the prompt."""
    from trnrt.models.glm5_next.model import ForwardBatch

    cfg, model = runner.cfg, runner.model
    n = len(row.token_ids)
    tokens = cfg.prefill_bucket(n)
    context = cfg.prefill_context_bucket(max(row.start_pos + n, tokens))
    (ids, start, num, tables, slots, temp, top_p, top_k, min_p, seeds, spos) = runner._pack([row], 1, tokens, context)
    with torch.inference_mode():
        out = model(ForwardBatch(ids, start, num, tables, slots), runner.state, all_hidden=True)
        logits = F.linear(out.hidden, model.head_weight()).float()  # [1, V] as the base step's
        if row.temperature <= 0.0:
            tok = sample_greedy(logits, 1)[0]
        else:
            tok = sample(logits, SamplingTensors(temp, top_p, top_k, min_p, seeds, spos), 1)[0]
        return int(tok[0]), out.hidden_all[0, :n].clone()
