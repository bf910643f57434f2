"""Eviction strategies of the radix prefix cache (SGLang 0.5.23's `--radix-eviction-policy`). Pure Python.

The tree (trnrt.engine.cache.radix_cache) evicts from the device tier like SGLang's `RadixCache.evict`:
it builds a min-heap of the evictable leaves (device-resident, `lock_ref == 0`, no device-resident
child) keyed by `strategy.key(node)`, pops the smallest, frees its pages, pushes its parent if that
became an evictable leaf, and repeats until enough pages are free. Keys are tuples; equal keys
are possible, so the tree should push `(strategy.key(node), node.id, node)` (TreeNode has no
ordering; node.id makes ties deterministic: the older node first).

Heap keys (smallest evicted first), as SGLang 0.5.23 computes them:

    lru       (last_access_time,)
    lfu       (hit_count, last_access_time)
    slru      (hit_count >= protected_threshold, last_access_time)   config: protected_threshold (2)
    priority  (node.priority, last_access_time)       lower priority values go first, whatever
                                                      --schedule-low-priority-values-first says
    tlru      (-1 if TEL-safe else 0, last_access_time)  config: threshold, next_prompt_estimate (0, 0)
    fifo      (creation_time,)        factory only: SGLang's factory knows them, its CLI does not
    mru       (-last_access_time,)
    filo      (-creation_time,)

Who maintains what: the TREE sets `last_access_time` (on match and insert, along the path),
`creation_time`, `hit_count` (a later request reusing the node) and `priority` (the max request
priority inserted through it); strategies only read those. A strategy's own per-node state lives
in `node.policy_data` (only TLRU has any).

TLRU (tail-optimised LRU, Zhang et al., arXiv:2510.15152): a conversation whose history is L tokens
long and whose next prompt adds about Q tokens (`next_prompt_estimate`) keeps its next prefill
within budget as long as L + Q - `threshold` tokens of it stay cached. Tokens past that are
"TEL-safe": evicting them cannot hurt tail latency, so they are reported as infinitely old (first
segment) and drained before anything else; the rest is plain LRU. For a device-resident leaf the
cached prefix without it is `node.start_pos` tokens (device residency is prefix-closed), so

    budget   = max(L + next_prompt_estimate - threshold, 0)
    TEL-safe = node.start_pos >= budget

L is the high-water history length of the branch: `max(node.end_pos, outstanding)`, where
`outstanding` (policy_data["tlru_history"]) is the longest history ever evicted below the node.
It never shrinks: deriving L from what is still resident would make a trimmed conversation look
over budget again on every pass, and TLRU would walk it down to nothing instead of stopping after
`threshold - next_prompt_estimate` tokens. In particular a tail that was evicted, re-inserted
shorter and evicted again leaves the FULL first history length on its parent (`on_evict` takes
the max, never assigns).
"""

from __future__ import annotations

import math
from typing import Any

from trnrt.engine.cache.radix_node import TreeNode

CLI_EVICTION_POLICIES = ("lru", "lfu", "slru", "priority", "tlru")  # = cache_config.EVICTION_POLICIES
FACTORY_ONLY_EVICTION_POLICIES = ("fifo", "mru", "filo")

TLRU_HISTORY = "tlru_history"  # policy_data key: longest history evicted below the node


class EvictionStrategy:
    """Orders evictable leaves. Subclasses define `key`; the hooks default to no-ops.

    The tree calls, on the engine thread:
        key(node)             -> tuple; the smallest is evicted first
        on_access(node, now)  a match or insert touched `node` (the tree has already set
                              node.last_access_time = now)
        on_insert(node)       `node` was just created (a new edge, or the upper half of a split)
        on_evict(node)        `node` is about to leave the device tier; node.parent is still set
    """

    name: str = ""

    def key(self, node: TreeNode) -> tuple:
        raise NotImplementedError

    def on_access(self, node: TreeNode, now: float) -> None:
        pass

    def on_insert(self, node: TreeNode) -> None:
        pass

    def on_evict(self, node: TreeNode) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRUStrategy(EvictionStrategy):
    name = "lru"

    def key(self, node: TreeNode) -> tuple:
        return (node.last_access_time,)


class LFUStrategy(EvictionStrategy):
    name = "lfu"

    def key(self, node: TreeNode) -> tuple:
        return (node.hit_count, node.last_access_time)


class FIFOStrategy(EvictionStrategy):
    name = "fifo"

    def key(self, node: TreeNode) -> tuple:
        return (node.creation_time,)


class MRUStrategy(EvictionStrategy):
    name = "mru"

    def key(self, node: TreeNode) -> tuple:
        return (-node.last_access_time,)


class FILOStrategy(EvictionStrategy):
    name = "filo"

    def key(self, node: TreeNode) -> tuple:
        return (-node.creation_time,)


class PriorityStrategy(EvictionStrategy):
    name = "priority"

    def key(self, node: TreeNode) -> tuple:
        return (node.priority, node.last_access_time)


class SLRUStrategy(EvictionStrategy):
    """Segmented LRU: probationary nodes (hit_count < protected_threshold) before protected ones."""

    name = "slru"

    def __init__(self, protected_threshold: int = 2):
        self.protected_threshold = protected_threshold

    def key(self, node: TreeNode) -> tuple:
        return (1 if node.hit_count >= self.protected_threshold else 0, node.last_access_time)

    def __repr__(self) -> str:
        return f"SLRUStrategy(protected_threshold={self.protected_threshold})"


class TLRUStrategy(EvictionStrategy):
    """Tail-optimised LRU (see the module docstring). Token counts, not pages."""

    name = "tlru"

    def __init__(self, threshold: float = 0, next_prompt_estimate: float = 0):
        self.threshold = threshold
        self.next_prompt_estimate = next_prompt_estimate

    @staticmethod
    def history_len(node: TreeNode) -> int:
        """L of the branch ending at `node`: its depth, or the longest history evicted below it."""
        return max(node.end_pos, node.policy_data.get(TLRU_HISTORY, 0))

    def is_tel_safe(self, node: TreeNode) -> bool:
        budget = max(self.history_len(node) + self.next_prompt_estimate - self.threshold, 0)
        return node.start_pos >= budget

    def key(self, node: TreeNode) -> tuple:
        return (-1 if self.is_tel_safe(node) else 0, node.last_access_time)

    def on_evict(self, node: TreeNode) -> None:
        parent = node.parent
        if parent is None:
            return
        # max, never assignment: a shorter re-inserted tail must not erase a longer history.
        h = self.history_len(node)
        if h > parent.policy_data.get(TLRU_HISTORY, 0):
            parent.policy_data[TLRU_HISTORY] = h

    def __repr__(self) -> str:
        return f"TLRUStrategy(threshold={self.threshold}, next_prompt_estimate={self.next_prompt_estimate})"


def _int_at_least(policy: str, key: str, lo: int):
    def check(v: Any) -> Any:
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"eviction policy {policy!r}: {key} must be an integer >= {lo}, got {v!r}")
        return v
    return check


def _finite_number(policy: str, key: str):
    def check(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"eviction policy {policy!r}: {key} must be a finite number (tokens), got {v!r}")
        return v
    return check


# name -> (class, {config key: validator})
_POLICIES: dict[str, tuple[type[EvictionStrategy], dict]] = {
    "lru": (LRUStrategy, {}),
    "lfu": (LFUStrategy, {}),
    "slru": (SLRUStrategy, {"protected_threshold": _int_at_least("slru", "protected_threshold", 0)}),
    "priority": (PriorityStrategy, {}),
    "tlru": (TLRUStrategy, {"threshold": _finite_number("tlru", "threshold"),
                            "next_prompt_estimate": _finite_number("tlru", "next_prompt_estimate")}),
    "fifo": (FIFOStrategy, {}),
    "mru": (MRUStrategy, {}),
    "filo": (FILOStrategy, {}),
}

EVICTION_POLICY_CONFIG_KEYS: dict[str, tuple[str, ...]] = {n: tuple(v[1]) for n, v in _POLICIES.items()}


def make_eviction_strategy(name: str, config: dict | None = None) -> EvictionStrategy:
    """Build the strategy `name` with its `config` (--radix-eviction-policy-config, parsed).

    Args:
        name: lru | lfu | slru | priority | tlru (the CLI's), or fifo | mru | filo.
        config: the policy's parameters; keys not listed for the policy are refused (a policy
            without parameters takes only {}). None is {}.
    Raises:
        ValueError: an unknown policy, a config that is not a dict, an unknown config key, or a
            value of the wrong type or range; the message names the policy and the key.
    """
    if name not in _POLICIES:
        known = ", ".join(CLI_EVICTION_POLICIES + FACTORY_ONLY_EVICTION_POLICIES)
        raise ValueError(f"unknown eviction policy {name!r} (known: {known})")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ValueError(f"eviction policy {name!r}: the config must be a JSON object, got {type(config).__name__}")
    cls, validators = _POLICIES[name]
    kwargs = {}
    for key, value in config.items():
        if key not in validators:
            allowed = ", ".join(validators) or "none"
            raise ValueError(f"eviction policy {name!r}: unknown config key {key!r} (allowed: {allowed})")
        kwargs[key] = validators[key](value)
    return cls(**kwargs)
