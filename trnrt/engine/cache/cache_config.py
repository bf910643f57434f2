"""PrefixCacheConfig: the radix prefix cache's host-only settings. Pure Python.

None of these shape a graph (checkpoints and host copies are made outside the step graphs), so they
live here and in SchedulerConfig, never in EngineConfig: `trnrt verify graph-equiv` is unaffected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

EVICTION_POLICIES = ("lru", "lfu", "slru", "priority", "tlru")
WRITE_POLICIES = ("write_through", "write_back")


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Settings of the radix prefix cache (SGLang's flag names in brackets).

    enabled: the cache is on [--disable-radix-cache turns it off].
    checkpoint_interval: tokens between state checkpoints (a multiple of the block size; 0: the
        engine picks `max(block_size, 64)` rounded up to a block). A prefix can be resumed only at a
        checkpoint, so this is the granularity of reuse; prefill chunks are cut at these positions.
    num_checkpoints: device checkpoint pool size (0: the engine picks 2 x its usable slots; a
        checkpoint costs one slot's state, see the start-up log line) [--num-checkpoints].
    eviction_policy: lru | lfu | slru | priority | tlru [--radix-eviction-policy].
    eviction_policy_config: policy parameters [--radix-eviction-policy-config, a JSON object].
    hierarchical: keep pages and checkpoints evicted from the device in a host pool
        [--enable-hierarchical-cache].
    hicache_ratio: host pool size as a multiple of the device pool [--hicache-ratio].
    hicache_size_mb: host pool size in MiB; overrides the ratio when > 0 [--hicache-size, GB there].
    write_policy: write_through (copy to host on insert) | write_back (copy on eviction)
        [--hicache-write-policy].
    """

    enabled: bool = True
    checkpoint_interval: int = 0
    num_checkpoints: int = 0
    eviction_policy: str = "lru"
    eviction_policy_config: dict = field(default_factory=dict)
    hierarchical: bool = False
    hicache_ratio: float = 2.0
    hicache_size_mb: int = 0
    write_policy: str = "write_through"

    def __post_init__(self) -> None:
        for name in ("checkpoint_interval", "num_checkpoints", "hicache_size_mb"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction_policy!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {self.write_policy!r}")
        if not isinstance(self.eviction_policy_config, dict):
            raise ValueError("eviction_policy_config must be a JSON object")
        r = self.hicache_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
            raise ValueError(f"hicache_ratio must be a number > 0, got {r!r}")

    @staticmethod
    def parse_policy_config(text: str | None) -> dict:
        """--radix-eviction-policy-config: a JSON object (or empty)."""
        if not text:
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        return value

    def resolved_interval(self, block_size: int) -> int:
        """The checkpoint interval in tokens: a positive multiple of `block_size`."""
        if self.checkpoint_interval:
            if self.checkpoint_interval % block_size:
                raise ValueError(f"checkpoint_interval ({self.checkpoint_interval}) must be a multiple of "
                                 f"the block size ({block_size})")
            return self.checkpoint_interval
        return -(-max(block_size, 64) // block_size) * block_size
