"""ParallelConfig: how many rank processes one engine runs and where they meet (pure Python).

`trnrt serve --tp-size N [--ep-size M] [--nnodes K --node-rank R --dist-init-addr HOST:PORT]`
(SGLang's flags) fill it. Rank 0 is the engine (HTTP, tokenizer, scheduler, the engine thread);
ranks 1..N-1 are workers that mirror its runner calls (trnrt.engine.core.tp_runner). The N ranks
are spread evenly over the K nodes: node R runs ranks R*N/K .. (R+1)*N/K - 1, so node 0 holds rank 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Steps between two agreement checks (every rank's running digest of its sampled tokens is
# gathered on rank 0 and compared); also checked once at shutdown. 0: only at shutdown.
CHECK_EVERY_ENV = "TRNRT_TP_CHECK_EVERY"
DEFAULT_CHECK_EVERY = 64
# Seconds a collective of the model's group may wait for a peer before it raises (a rank that
# hangs, or a remote rank that vanished without closing its sockets, fails the step instead of
# hanging the others; a local rank that dies is seen by rank 0's watchdog at once).
PG_TIMEOUT_ENV = "TRNRT_TP_TIMEOUT_S"
DEFAULT_PG_TIMEOUT_S = 120.0
# Exit status of an engine (or a node launcher) whose rank died.
RANK_DIED_EXIT_CODE = 3


@dataclass(frozen=True)
class ParallelConfig:
    """tp_size ranks (ep_size of them expert-parallel) over nnodes nodes; this is node node_rank.

    dist_init_addr: HOST:PORT of rank 0's rendezvous (torch.distributed's TCP store); None on
    one node: 127.0.0.1 on a free port. check_every: steps between agreement checks (None: from
    $TRNRT_TP_CHECK_EVERY, else DEFAULT_CHECK_EVERY).
    """

    tp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    check_every: int | None = None

    def __post_init__(self):
        for name in ("tp_size", "ep_size", "nnodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"--ep-size ({self.ep_size}) must divide --tp-size ({self.tp_size})")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--nnodes ({self.nnodes}) must divide --tp-size ({self.tp_size})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank ({self.node_rank}) must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr:
            split_addr(self.dist_init_addr)

    @property
    def enabled(self) -> bool:
        """More than one rank: the rank processes and the broadcast run (TP=1 takes today's path)."""
        return self.tp_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def node_ranks(self, node_rank: int | None = None) -> range:
        """The global ranks node `node_rank` (default: this node) runs."""
        r = self.node_rank if node_rank is None else node_rank
        return range(r * self.ranks_per_node, (r + 1) * self.ranks_per_node)

    def resolved_check_every(self) -> int:
        if self.check_every is not None:
            return max(0, int(self.check_every))
        env = os.environ.get(CHECK_EVERY_ENV, "").strip()
        return max(0, int(env)) if env else DEFAULT_CHECK_EVERY

    def pg_timeout_s(self) -> float:
        env = os.environ.get(PG_TIMEOUT_ENV, "").strip()
        return float(env) if env else DEFAULT_PG_TIMEOUT_S

    def reported(self) -> dict:
        """What /server_info and /v1/stats say of the layout."""
        return {"tp_size": self.tp_size, "ep_size": self.ep_size, "nnodes": self.nnodes}


def split_addr(addr: str) -> tuple[str, int]:
    """HOST:PORT ([v6]:PORT too) -> (host, port); ValueError naming --dist-init-addr otherwise."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host, int(port)
