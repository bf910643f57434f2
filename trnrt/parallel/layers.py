"""Parallel linear layers over plain weight shards, and the vocab-parallel embedding / lm_head.

Functions take the rank's shard of a weight (cut by `trnrt.parallel.shard`) and the context:

* column-parallel: W's output rows split over the ranks; y_r = x W_r^T is this rank's slice of
  the output (no collective, unless gathered);
* row-parallel: W's input columns split; y = sum_r x_r W_r^T, one all-reduce;
* vocab-parallel embedding: rank r holds rows [start_r, start_r + V/t); ids outside are masked
  to zero and the rows summed over the ranks (one all-reduce; exact: one non-zero term);
* vocab-parallel lm_head: each rank's [.., V/t] fp32 logits all-gathered to [.., V].

At TP=1 every function is the plain op (the collectives are the identity). The vocab offset is a
buffer of the module (data), never the rank as a Python constant (see context.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .collectives import all_gather, all_reduce
from .context import ParallelContext


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, ctx: ParallelContext,
                           gather_output: bool = False) -> torch.Tensor:
    """x [.., In] @ W_r^T -> [.., Out/t] (this rank's output slice), or [.., Out] gathered."""
    y = F.linear(x, weight)
    return all_gather(y, ctx, -1) if gather_output else y


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, ctx: ParallelContext,
                        reduce: bool = True) -> torch.Tensor:
    """x [.., In/t] (this rank's input slice) @ W_r^T -> [.., Out], summed over the ranks
    (reduce False: the rank's partial sum, for a caller that adds more before one all-reduce)."""
    y = F.linear(x, weight)
    return all_reduce(y, ctx) if reduce else y


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_start: torch.Tensor,
                             ctx: ParallelContext) -> torch.Tensor:
    """ids [..] int64 over the full vocabulary, weight [V/t, D] the rank's rows from vocab_start
    (a 0-dim int64 tensor) -> [.., D] as F.embedding over the full table."""
    if ctx.tp_size == 1:
        return F.embedding(ids, weight)
    n = weight.shape[0]
    local = ids - vocab_start  # [..]
    inside = (local >= 0) & (local < n)
    e = F.embedding(local.clamp(0, n - 1), weight)  # [.., D]; rows of other ranks masked below
    return all_reduce(e.masked_fill(~inside.unsqueeze(-1), 0.0), ctx)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """hidden [.., D], weight [V/t, D] -> fp32 logits [.., V] (the rank's slices all-gathered)."""
    return all_gather(F.linear(hidden, weight).float(), ctx, -1)


def _vocab_shard(vocab_size: int, ctx: ParallelContext) -> int:
    if vocab_size % ctx.tp_size:
        raise ValueError(f"vocab_size {vocab_size} is not divisible by tp_size {ctx.tp_size}")
    return vocab_size // ctx.tp_size


class VocabParallelEmbedding(nn.Module):
    """The rank's [V/t, D] rows of an embedding table; `weight` is the state-dict name, so the
    rank's shard of `embed_tokens.weight` loads as is. vocab_start: a non-persistent buffer."""

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelContext):
        super().__init__()
        n = _vocab_shard(vocab_size, ctx)
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(n, dim))
        self.register_buffer("vocab_start", torch.tensor(ctx.tp_rank * n, dtype=torch.int64), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.vocab_start, self.ctx)


class ParallelLMHead(nn.Module):
    """The rank's [V/t, D] rows of an lm_head; forward returns the full fp32 logits [.., V]."""

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(_vocab_shard(vocab_size, ctx), dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden, self.weight, self.ctx)
