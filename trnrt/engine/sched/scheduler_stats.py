"""The scheduler's gauges for /v1/stats and its integrity check (the tests' and the engine's debug
check that the page, slot and checkpoint books balance against the live sequences).

A mixin of Scheduler (sched/scheduler.py).
"""

from __future__ import annotations

from trnrt.engine.output.sequence import SequenceStatus


class SchedulerStats:
    def stats(self) -> dict:
        """Scheduler gauges for /v1/stats."""
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preempted_waiting": sum(s.status is SequenceStatus.PREEMPTED for s in self.waiting),
            "num_preemptions_total": self.num_preemptions_total,
            "num_used_blocks": self.cache.num_used_blocks,
            "num_free_blocks": self.cache.num_free_blocks,
            "num_used_slots": self.cache.num_used_slots,
            "cache_usage": self.cache.usage,
            "prefix_cache": self.prefix_cache is not None,
            "num_cached_tokens_total": self.num_cached_tokens_total,
            "cache_hit_rate": self.cache_hit_rate,
        }

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens admitted (first admissions)."""
        n = self.num_prompt_tokens_admitted
        return self.num_cached_tokens_total / n if n else 0.0

    def check_integrity(self) -> None:
        """Cache books balance against the live sequences; queues hold exactly the live ones."""
        pc = self.prefix_cache
        self.cache.check_integrity(self.requests.values(), extra_refs=(pc.device_page_refs() if pc else [])
                                   + [b for g in self._groups.values() for b in g.pages])
        if pc is not None:
            pc.check_integrity()
            pc.checkpoints.check_integrity(
                pc.checkpoint_ids() + [c for _, c in self._pending_snapshots.values()]
                + [c for g in self._groups.values() for c in (g.checkpoint, g.pending_snapshot) if c is not None])
            if pc.has_host_tier:
                pc.host_pages.check_integrity(pc.host_page_ids())
                pc.host_checkpoints.check_integrity(pc.host_checkpoint_ids())
            # every lock is a live running sequence's
            expected: dict[int, int] = {}
            for seq in self.requests.values():
                node = seq.cache_node
                if node is not None:
                    assert seq.status is SequenceStatus.RUNNING, seq
                while node is not None and not node.is_root:
                    expected[node.id] = expected.get(node.id, 0) + 1
                    node = node.parent
            for node in pc._nodes():
                assert node.lock_ref == expected.get(node.id, 0), (node, expected.get(node.id, 0))
        live = set(self.requests)
        held = [f for g in self._groups.values() for f in g.held]
        queued = ([s.request_id for s in self.waiting] + [s.request_id for s in self.running]
                  + [s.request_id for s in held])
        assert len(queued) == len(set(queued)) and set(queued) == live, (queued, live)
        for s in self.waiting:
            assert not s.block_ids and s.slot_id is None and s.num_computed_tokens == 0, s
        for s in self.running:
            assert s.status is SequenceStatus.RUNNING and s.slot_id is not None, s
