"""Who this rank is in the tensor-parallel group, and what it owns of the MoE.

One group (the TP group) carries every collective: with TP attention the tokens are already
replicated on every rank, so expert parallelism over the same ranks needs no all-to-all (the
all-reduce that ends the MoE combines the experts' partial sums too; tensor_parallel.md §1d, §7.1).

Ranks of the MoE: with `ep_size` e dividing `tp_size` t, `moe_tp_size = t / e` ranks share each
expert group; `ep_rank = tp_rank // moe_tp_size` picks the group of E / e experts (consecutive
ranks own the same experts), `moe_tp_rank = tp_rank % moe_tp_size` its slice of I inside them.
e = 1: every rank holds every expert, I / t of it (TP mode); e = t: experts owned whole (EP mode).

The rank is a Python int here, used only to pick what to load. Forward code never reads it:
where a forward needs a rank-dependent value (the vocab or expert offset) it is a buffer the
layer holds, so the traced graphs of all ranks are the same program.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from .counts import CollectiveCounts

AXES = ("tp", "moe_tp", "ep")


@dataclass(frozen=True)
class ParallelContext:
    """tp_size / tp_rank of this process in `group`, and the expert-parallel degree `ep_size`.

    group: the torch.distributed ProcessGroup of the TP ranks; None for TP=1 (`single()`) and for
    sharding-only contexts (`for_rank`: a loader or a test cutting rank r's weights in one
    process), where a collective at tp_size > 1 raises. stats: this context's collective counts.
    """

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    group: Any = field(default=None, compare=False)
    stats: CollectiveCounts = field(default_factory=CollectiveCounts, compare=False, repr=False)

    def __post_init__(self):
        for name in ("tp_size", "tp_rank", "ep_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size})")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def single(cls) -> "ParallelContext":
        """TP=1, EP=1: no process group; every collective is the identity."""
        return cls()

    @classmethod
    def for_rank(cls, tp_size: int, tp_rank: int, ep_size: int = 1) -> "ParallelContext":
        """Rank `tp_rank`'s context without a process group: for cutting its shard in any process."""
        return cls(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size)

    @classmethod
    def from_group(cls, group: Any = None, ep_size: int = 1) -> "ParallelContext":
        """This process's context in an initialised process group (None: the default group)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ParallelContext.from_group needs torch.distributed initialised "
                               "(ParallelContext.single() for TP=1)")
        group = group if group is not None else dist.group.WORLD
        return cls(tp_size=dist.get_world_size(group), tp_rank=dist.get_rank(group), ep_size=ep_size, group=group)

    @classmethod
    def initialise(cls, rank: int, world_size: int, ep_size: int = 1, backend: str = "gloo",
                   timeout_s: float = 60.0, init_method: str = "env://") -> "ParallelContext":
        """init_process_group with a timeout (a dead rank fails every collective after timeout_s
        instead of hanging the others; tensor_parallel.md §8.8) and this rank's context.
        env:// reads MASTER_ADDR / MASTER_PORT."""
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls.from_group(None, ep_size)

    # ------------------------------------------------------------------ derived ranks
    @property
    def moe_tp_size(self) -> int:
        """Ranks sharing one expert group (the routed experts' I is split over them)."""
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        """Which E / ep_size experts this rank holds."""
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        """This rank's slice of I within its expert group."""
        return self.tp_rank % self.moe_tp_size

    def axis(self, name: str) -> tuple[int, int]:
        """(size, rank) along a sharding axis: 'tp' (attention heads, dense and shared MLPs,
        vocab), 'moe_tp' (the routed experts' I) or 'ep' (the routed experts' E)."""
        if name == "tp":
            return self.tp_size, self.tp_rank
        if name == "moe_tp":
            return self.moe_tp_size, self.moe_tp_rank
        if name == "ep":
            return self.ep_size, self.ep_rank
        raise ValueError(f"unknown sharding axis {name!r} (one of {', '.join(AXES)})")
