"""The collectives of the parallel layer, written as torch's functional collectives.

`torch.distributed._functional_collectives` ops return new tensors and trace as
`_c10d_functional.*` + `wait_tensor` nodes (what torch.export / AOTInductor and PyTorch/XLA
accept; tensor_parallel.md §4). At TP=1 each function returns its input object itself: no op
is emitted, so no collective can ever enter a TP=1 graph.

Every collective goes through `_issue`, which counts it on the context (`counts.CollectiveCounts`:
calls, bytes and wall seconds per kind, for /v1/stats' `parallel` section). Counting and timing
are Python side effects, so they happen on eager calls only: under torch.export / torch.compile
`_issue` runs the op alone and nothing is counted (a compiled graph's collectives are fixed by the
graph and are counted from it). At TP=1 `_issue` is never reached.

Eager calls wait at once (the AsyncCollectiveTensor is resolved before returning): no
overlap yet, and callers get a plain tensor they may hand to custom ops. A traced graph names the
group by its name, so every rank must create its groups in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .context import ParallelContext


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum of x over the TP group; x itself at TP=1."""
    if ctx.tp_size == 1:
        return x
    from torch.distributed import _functional_collectives as fc

    return _issue(ctx, "all_reduce", x, lambda: fc.all_reduce(x, "sum", ctx.group))


def all_gather(x: torch.Tensor, ctx: ParallelContext, dim: int) -> torch.Tensor:
    """The ranks' x concatenated along `dim` in rank order; x itself at TP=1."""
    if ctx.tp_size == 1:
        return x
    from torch.distributed import _functional_collectives as fc

    return _issue(ctx, "all_gather", x, lambda: fc.all_gather_single(x, dim % x.dim(), ctx.group))


def _issue(ctx: ParallelContext, kind: str, x: torch.Tensor, op: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The one place a collective is issued: refuse a group-less context, run, wait, count.

    Eager calls are counted with their wall time (issue to the end of the wait: on a CPU group
    that includes waiting for the slower rank); traced calls run `op` alone, so no timing or
    counting code is ever seen by torch.compile / torch.export."""
    if ctx.group is None:
        raise RuntimeError(f"{kind} at tp_size {ctx.tp_size} needs a process group "
                           "(this context only cuts shards: ParallelContext.for_rank)")
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if torch.compiler.is_compiling():
        y = op()
        return y.wait() if isinstance(y, AsyncCollectiveTensor) else y  # traced: already a plain tensor + wait node
    t0 = time.perf_counter()
    y = op()
    y = y.wait() if isinstance(y, AsyncCollectiveTensor) else y
    ctx.stats.record(kind, x.numel() * x.element_size(), time.perf_counter() - t0)
    return y
