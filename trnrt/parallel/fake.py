"""A fake process group of any world size in ONE process (torch's "fake" backend).

For shapes, tracing and export without N processes: a collective on it returns a tensor of
the right shape and does no communication (its values are garbage). torch.export records a
collective's group by its NAME (`_c10d_functional.all_reduce(x, 'sum', '0')`), and the default
group is named '0' for the fake backend as for gloo / nccl, so a graph exported here is the
graph each rank of a real group of the same size would export (tests/parallel/test_tp_compile.py
checks that against 2 gloo ranks).
"""

from __future__ import annotations

from .context import ParallelContext


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """init_process_group('fake') of `world_size` ranks, as `rank`; raises if a group exists."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a default process group already exists (destroy it first)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def fake_context(tp_size: int, ep_size: int = 1, tp_rank: int = 0) -> ParallelContext:
    """A ParallelContext on a new fake world of tp_size ranks (TP=1: ParallelContext.single())."""
    if tp_size == 1:
        return ParallelContext(ep_size=ep_size)
    init_fake_world(tp_size, tp_rank)
    return ParallelContext.from_group(None, ep_size)


def destroy_world() -> None:
    """Destroy the default process group if there is one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
