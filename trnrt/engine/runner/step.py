"""The step function: model forward + sampler as one static-shape call (one graph per bucket).

This is the unit `trnrt compile` exports and `trnrt verify graph-equiv` hashes, and the unit the
ModelRunner calls eagerly: what runs is what compiles. All inputs are tensors; the model's
paged and per-slot state is updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trnrt.engine.sample.sampler import SamplingTensors, sample, sample_greedy


SAMPLERS = ("full", "greedy")


@dataclass(frozen=True)
class GraphSpec:
    """One static-shape graph: `phase` "decode" (batch x 1 token) or "prefill" (1 x tokens).

    context: decode graphs of `decode_context_buckets` take a block table of `context` tokens
    instead of max_model_len (attention and indexer scan only that many).
    sampling: "full" (temperature, top-k, top-p, min-p, seeds: a sort of the whole vocabulary
    every step) or "greedy" (argmax only; the runner picks it when every row of the batch is
    greedy, as SGLang's and vLLM's samplers branch on all-greedy batches). Both give the same
    tokens and logprobs for greedy rows.
    """

    phase: str
    batch: int
    tokens: int
    variant: str = "base"
    sampling: str = "full"
    context: int = 0  # block-table length in tokens; 0 = max_model_len (EngineConfig.table_blocks)

    @property
    def graph_id(self) -> str:
        ctx = f"-c{self.context}" if self.context else ""
        gid = f"{self.phase}-b{self.batch}-t{self.tokens}{ctx}-{self.variant}"
        return gid if self.sampling == "full" else f"{gid}-{self.sampling}"


STEP_INPUT_NAMES = (
    "input_ids",  # [B, S] int64
    "start_pos",  # [B] int64: tokens already in the cache (num_computed_tokens)
    "num_new",  # [B] int64: valid tokens in each row (0 = padding row)
    "block_tables",  # [B, max_blocks_per_seq] int64
    "slot_ids",  # [B] int64
    "temperature",  # [B] fp32
    "top_p",  # [B] fp32
    "top_k",  # [B] int64
    "min_p",  # [B] fp32
    "seeds",  # [B] int64
    "sample_pos",  # [B] int64: position of the token being sampled (keys the noise)
)
STEP_OUTPUT_NAMES = ("token_ids", "token_logprobs", "top_ids", "top_logprobs")


class StepFunction(nn.Module):
    """model(forward over state) -> sampler, for one padded batch.

    sampling "greedy" ignores the sampling inputs (they stay graph inputs so both kinds of graph
    take the same arguments)."""

    def __init__(self, model: nn.Module, state, num_top_logprobs: int, sampling: str = "full"):
        super().__init__()
        if sampling not in SAMPLERS:
            raise ValueError(f"sampling must be one of {SAMPLERS}, got {sampling!r}")
        self.model = model
        self.state = state
        self.num_top_logprobs = num_top_logprobs
        self.sampling = sampling

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_new: torch.Tensor,
        block_tables: torch.Tensor,
        slot_ids: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        top_k: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
        sample_pos: torch.Tensor,
    ):
        logits = self.logits(input_ids, start_pos, num_new, block_tables, slot_ids)
        return self.sample_logits(logits, input_ids, start_pos, num_new, block_tables, slot_ids, temperature, top_p,
                                  top_k, min_p, seeds, sample_pos)

    def logits(self, input_ids, start_pos, num_new, block_tables, slot_ids, *_unused) -> torch.Tensor:
        """The model forward over the state: each row's last-token logits [B, V]."""
        from trnrt.models.glm5_next.batch import ForwardBatch

        batch = ForwardBatch(
            input_ids=input_ids, start_pos=start_pos, num_new=num_new, block_tables=block_tables, slot_ids=slot_ids
        )
        return self.model(batch, self.state).logits

    def sample_logits(self, logits, input_ids, start_pos, num_new, block_tables, slot_ids, temperature, top_p, top_k,
                      min_p, seeds, sample_pos):
        """The sampler of this step's kind over logits [B, V] (variants call it after their processors)."""
        if self.sampling == "greedy":
            return sample_greedy(logits, self.num_top_logprobs)
        st = SamplingTensors(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seeds=seeds, positions=sample_pos)
        return sample(logits, st, self.num_top_logprobs)


def example_inputs(spec: GraphSpec, max_blocks_per_seq: int, vocab_size: int, device="cpu") -> tuple[torch.Tensor, ...]:
    """Dummy inputs of the exact shapes and dtypes of `spec` (padding rows: num_new 0, greedy)."""
    b, s = spec.batch, spec.tokens
    i64 = dict(dtype=torch.int64, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    return (
        torch.zeros((b, s), **i64),
        torch.zeros((b,), **i64),
        torch.zeros((b,), **i64),
        torch.zeros((b, max_blocks_per_seq), **i64),
        torch.zeros((b,), **i64),
        torch.zeros((b,), **f32),
        torch.ones((b,), **f32),
        torch.full((b,), vocab_size, **i64),
        torch.zeros((b,), **f32),
        torch.zeros((b,), **i64),
        torch.zeros((b,), **i64),
    )
