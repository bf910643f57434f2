"""The scheduler's side of the prefix cache: match a waiting request's prefix, resume it through
the match (pages shared, checkpoint restored), plan and commit the state snapshots that make new
checkpoints, and evict when pages run short.

A mixin of Scheduler (sched/scheduler.py); `self.prefix_cache` is a RadixCache or None.
"""

from __future__ import annotations

from trnrt.engine.output.outputs import CacheOp, SchedulerOutput
from trnrt.engine.output.sequence import Sequence


class PrefixMatching:
    def _match_for_policy(self, seq: Sequence):
        """(matched tokens, node) for the cache-aware policies; touches nothing, locks nothing."""
        if seq.num_tokens < 2 or seq.sampling_params.prompt_logprobs is not None:
            return 0, None
        m = self.prefix_cache.match(seq.token_slice(0, seq.num_tokens - 1), touch=False,
                                    namespace=seq.cache_namespace)
        return m.num_tokens, m.node

    def _can_allocate_for(self, seq: Sequence, num_tokens_total: int, *, extra_pages: int = 0,
                          shared=None) -> bool:
        """CacheManager.can_allocate_for, after evicting unlocked cached pages if that helps.

        `shared`: a PrefixMatch the sequence will resume through (its pages are shared, not new);
        `extra_pages`: pages to allocate besides the block table's growth (host-tier loads).
        """
        c = self.cache
        skip = shared.num_tokens // c.block_size if shared is not None else 0
        need = max(0, c.num_blocks_for(num_tokens_total) - max(len(seq.block_ids), skip)) + extra_pages
        need_slot = 1 if seq.slot_id is None else 0
        if c.can_allocate(need, need_slot):
            return True
        if self.prefix_cache is not None and need > c.num_free_blocks:
            self.prefix_cache.evict(need)
        return c.can_allocate(need, need_slot)

    def _match(self, seq: Sequence):
        """The usable cached prefix of a waiting sequence (locked, so that evictions made for its
        own pages cannot take it), or None. Sets num_computed_tokens to the resume position so
        that the chunk size is computed from there; `_unmatch` undoes both."""
        if self.prefix_cache is None or seq.num_computed_tokens or seq.num_tokens < 2 or seq.speculative:
            return None
        if seq.sampling_params.prompt_logprobs is not None:
            return None  # every prompt position must be computed for its logprob
        m = self.prefix_cache.match(seq.token_slice(0, seq.num_tokens - 1), namespace=seq.cache_namespace)
        if m.num_tokens == 0:
            return None
        self.prefix_cache.lock(m.node)
        seq.num_computed_tokens = m.num_tokens
        return m

    def _unmatch(self, seq: Sequence, match) -> None:
        if match is not None:
            self.prefix_cache.unlock(match.node)
            seq.num_computed_tokens = 0

    def _resume(self, seq: Sequence, m, first: bool) -> None:
        """Admit `seq` through the locked match `m`: load host-only nodes back, share the path's
        pages, and queue the restore of the checkpoint into the slot (allocated in _schedule_seq)."""
        pc = self.prefix_cache
        host_tokens = m.host_tokens  # before the load makes them device-resident
        pc.load_to_device(m)
        pc.record_hit(m)
        for node in m.path:
            self.cache.share_blocks(seq, node.device_pages)
        seq.cache_node = m.node
        if first:
            seq.num_cached_tokens = m.num_tokens
            seq.num_cached_tokens_host = host_tokens
            self.num_cached_tokens_total += m.num_tokens
            self.num_cached_tokens_host_total += host_tokens
            self.num_prefix_hits += 1

    def _plan_snapshot(self, seq: Sequence, end: int, out: SchedulerOutput) -> None:
        """After this step `seq`'s slot holds the state at `end`: keep it if `end` is a checkpoint
        position the tree lacks and a checkpoint id can be had."""
        pc = self.prefix_cache
        if pc is None or end % self.checkpoint_interval or end == 0:
            return
        if pc.has_checkpoint_at(seq.token_slice(0, end), seq.cache_namespace):
            return
        ids = pc.checkpoints.allocate(1)
        if ids is None:
            pc.evict(num_checkpoints=1)
            ids = pc.checkpoints.allocate(1)
            if ids is None:
                return  # every checkpoint is in use by a running request's path: skip this one
        self._pending_snapshots[seq.request_id] = (end, ids[0])
        out.snapshot_ops.append(CacheOp("save_slot", (seq.slot_id,), (ids[0],)))

    def _drop_snapshot(self, request_id: str) -> None:
        pending = self._pending_snapshots.pop(request_id, None)
        if pending is not None:
            self.prefix_cache.checkpoints.free([pending[1]])

    def _commit_snapshot(self, seq: Sequence) -> None:
        """The step that snapshotted `seq` succeeded: insert its prefix with the checkpoint."""
        end, ckpt = self._pending_snapshots.pop(seq.request_id)
        pc = self.prefix_cache
        node, adopted = pc.insert(seq.token_slice(0, end), seq.block_ids, ckpt, priority=seq.priority or 0,
                                  namespace=seq.cache_namespace)
        if not adopted:
            pc.checkpoints.free([ckpt])
        pc.lock(node)
        if seq.cache_node is not None:
            pc.unlock(seq.cache_node)
        seq.cache_node = node

    def _release_cache_node(self, seq: Sequence) -> None:
        if seq.cache_node is not None:
            self.prefix_cache.unlock(seq.cache_node)
            seq.cache_node = None
        if self._pending_snapshots:
            self._drop_snapshot(seq.request_id)

    def flush_prefix_cache(self) -> None:
        """Idle only: drop every cached page and checkpoint (both tiers)."""
        if self.prefix_cache is not None:
            assert not self.requests, "flush_prefix_cache with live requests"
            self.prefix_cache.reset()
