"""How one tensor is cut into per-rank shards (and put back), model-agnostic.

A rule is a tuple of `Split`s, at most one per dim; the empty tuple replicates. A Split views
its dim as `parts` equal consecutive parts (the q|k|v thirds of a merged conv, the gate|up
halves of a merged expert) and gives rank r the r-th of `size` equal chunks OF EACH PART,
concatenated in part order. `parts=1` on such a merged dim would be the contiguous split that
silently mixes q/k/v channels (tensor_parallel.md §8.7): the rule tables must say `parts`.

`unit` is the granularity a chunk must be a whole number of (a head's rows): the split refuses
a size it cannot divide so, naming the tensor.

Reading goes through a getter `get(index) -> Tensor`, index a tuple of slices, one per dim: a
full tensor's `t.__getitem__`, or a safetensors `safe_open(..).get_slice(name).__getitem__`, so
a loader reads only the rank's slices, never the whole tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .context import AXES, ParallelContext


class ShardingError(ValueError):
    """A tensor without a rule, or one its rule cannot cut; `.tensor` names it."""

    def __init__(self, tensor: str, message: str):
        super().__init__(f"sharding of tensor {tensor!r}: {message}")
        self.tensor = tensor


@dataclass(frozen=True)
class Split:
    """Cut `dim` over the ranks of `axis` ('tp' | 'moe_tp' | 'ep'), each of `parts` parts on its own."""

    dim: int
    axis: str = "tp"
    parts: int = 1
    unit: int = 1

    def __post_init__(self):
        if self.axis not in AXES:
            raise ValueError(f"unknown sharding axis {self.axis!r} (one of {', '.join(AXES)})")


Rule = tuple[Split, ...]
REPLICATE: Rule = ()
Getter = Callable[[tuple[slice, ...]], torch.Tensor]


def shard_slices(rule: Rule, shape: Sequence[int], ctx: ParallelContext, name: str = "?") -> list[list[slice]]:
    """Per dim, the slices of the full tensor whose concatenation (in order) is the rank's shard."""
    per_dim = [[slice(0, n)] for n in shape]
    seen: set[int] = set()
    for s in rule:
        if not 0 <= s.dim < len(shape) or s.dim in seen:
            raise ShardingError(name, f"rule splits dim {s.dim} of a {len(shape)}-d tensor (or twice)")
        seen.add(s.dim)
        size, rank = ctx.axis(s.axis)
        full = shape[s.dim]
        if full % s.parts or (full // s.parts) % (size * s.unit):
            raise ShardingError(name, f"dim {s.dim} of size {full} ({s.parts} part(s)) does not split "
                                      f"into {size} chunks of whole units of {s.unit} ({s.axis} size {size})")
        part = full // s.parts
        chunk = part // size
        per_dim[s.dim] = [slice(p * part + rank * chunk, p * part + (rank + 1) * chunk) for p in range(s.parts)]
    return per_dim


def shard_shape(rule: Rule, shape: Sequence[int], ctx: ParallelContext, name: str = "?") -> tuple[int, ...]:
    """The shape of the rank's shard."""
    return tuple(sum(s.stop - s.start for s in sl) for sl in shard_slices(rule, shape, ctx, name))


def read_shard(get: Getter, shape: Sequence[int], rule: Rule, ctx: ParallelContext, name: str = "?") -> torch.Tensor:
    """The rank's shard, read as the few rectangular blocks of `shard_slices` through `get`."""
    per_dim = shard_slices(rule, shape, ctx, name)

    def assemble(d: int, prefix: tuple[slice, ...]) -> torch.Tensor:
        if d == len(per_dim):
            return get(prefix)
        pieces = [assemble(d + 1, prefix + (s,)) for s in per_dim[d]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)

    out = assemble(0, ())
    return out.contiguous() if rule else out


def shard_tensor(t: torch.Tensor, rule: Rule, ctx: ParallelContext, name: str = "?") -> torch.Tensor:
    """The rank's shard of a full tensor (a copy when split; the tensor itself when replicated)."""
    return read_shard(t.__getitem__, t.shape, rule, ctx, name)


def unshard(shards: Sequence[tuple[ParallelContext, torch.Tensor]], rule: Rule, shape: Sequence[int],
            name: str = "?") -> torch.Tensor:
    """The full tensor from every rank's (context, shard). Every element must be covered, and
    ranks holding the same element (replicas) must agree: else ShardingError."""
    first = shards[0][1]
    full = torch.zeros(tuple(shape), dtype=first.dtype)
    covered = torch.zeros(tuple(shape), dtype=torch.bool)
    for ctx, shard in shards:
        per_dim = shard_slices(rule, shape, ctx, name)
        if tuple(shard.shape) != tuple(sum(s.stop - s.start for s in sl) for sl in per_dim):
            raise ShardingError(name, f"rank {ctx.tp_rank}'s shard has shape {tuple(shard.shape)}")
        offsets = [list(itertools.accumulate((s.stop - s.start for s in sl), initial=0)) for sl in per_dim]
        for cell in itertools.product(*(range(len(sl)) for sl in per_dim)):
            idx = tuple(per_dim[d][c] for d, c in enumerate(cell))
            sidx = tuple(slice(offsets[d][c], offsets[d][c + 1]) for d, c in enumerate(cell))
            block = shard[sidx].to(full.dtype)
            again = covered[idx]
            if again.any() and not torch.equal(full[idx][again], block[again]):
                raise ShardingError(name, f"rank {ctx.tp_rank} disagrees with another rank on a replicated block")
            full[idx] = block
            covered[idx] = True
    if not covered.all():
        raise ShardingError(name, f"{int((~covered).sum())} elements are on no rank")
    return full
