"""TreeNode: one edge of the radix prefix cache (trnrt.engine.cache.radix_cache), and PrefixMatch,
the path a match found. Pure Python.

Kept in its own module so the eviction policies (trnrt.engine.cache.eviction_policy) and the scheduling
policies (trnrt.engine.sched.schedule_policy) can read nodes without importing the tree.

A node's `key` is the token ids of its edge, a whole number of pages. Its data lives in up to two
tiers:
- device: `device_pages` (page ids of the paged state, one per page of `key`) and, when the node's
  END position carries a state checkpoint (KDA state, conv window, indexer tail at exactly
  `end_pos`), `checkpoint` (a device checkpoint id);
- host (the hierarchical cache): `host_pages` and `host_checkpoint`, the same data copied to host
  memory.
A node whose `device_pages` is None was evicted from the device (its data may still be on host).
Device residency is prefix-closed: a device-resident node's parent is device-resident.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

_node_ids = itertools.count()


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...] = ()
    parent: Optional["TreeNode"] = None
    # children keyed by their first page's tokens (a tuple of page_size ids)
    children: dict[tuple[int, ...], "TreeNode"] = field(default_factory=dict)
    start_pos: int = 0  # tokens from the root to this node's start
    device_pages: list[int] | None = None
    host_pages: list[int] | None = None
    checkpoint: int | None = None  # device checkpoint id of the state at end_pos
    host_checkpoint: int | None = None  # host checkpoint id of the state at end_pos
    lock_ref: int = 0  # running sequences resumed through (or inserted at) this node or below
    creation_time: float = 0.0
    last_access_time: float = 0.0
    hit_count: int = 0  # requests that reused this node (a match through it, or a re-insert)
    priority: int = 0  # the highest request priority that inserted through this node
    # Free-form per-policy data (e.g. TLRU's outstanding history length); the tree never reads it.
    policy_data: dict[str, Any] = field(default_factory=dict)
    id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def end_pos(self) -> int:
        """Tokens from the root to this node's end (the position a checkpoint here resumes at)."""
        return self.start_pos + len(self.key)

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def on_host(self) -> bool:
        return self.host_pages is not None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def has_checkpoint(self) -> bool:
        return self.checkpoint is not None or self.host_checkpoint is not None

    def __repr__(self) -> str:
        return (f"TreeNode(#{self.id}, [{self.start_pos}:{self.end_pos}], dev={self.device_pages}, "
                f"host={self.host_pages}, ckpt={self.checkpoint}/{self.host_checkpoint}, lock={self.lock_ref})")


@dataclass
class PrefixMatch:
    """Result of `RadixCache.match`: resume at `node` (the root when nothing is usable).

    path: the nodes from the root's child down to `node`, in order. `device_tokens` of them are
    device-resident; the rest (`host_nodes`) are only in host memory and must be loaded back.
    """

    node: TreeNode
    path: list[TreeNode] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.node.end_pos

    @property
    def host_nodes(self) -> list[TreeNode]:
        return [n for n in self.path if not n.on_device]

    @property
    def device_tokens(self) -> int:
        return sum(n.num_tokens for n in self.path if n.on_device)

    @property
    def host_tokens(self) -> int:
        return sum(n.num_tokens for n in self.path if not n.on_device)

    @property
    def num_host_pages(self) -> int:
        return sum(len(n.host_pages or ()) for n in self.path if not n.on_device)
