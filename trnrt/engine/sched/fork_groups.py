"""`n` > 1 requests: the choices of one prompt fork from their leader's checkpointed prompt state.

A mixin of Scheduler (sched/scheduler.py): the methods read and write the scheduler's queues,
cache manager and radix cache; they live here so that the scheduler's main loop reads alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trnrt.engine.output.outputs import CacheOp, SchedulerOutput
from trnrt.engine.output.sequence import Sequence


@dataclass(eq=False)
class _ForkGroup:
    """The choices of one `n` > 1 request (GenerateRequest.prefix_group): the leader computes the
    shared prompt up to `fork_pos` (= prompt length - 1), its slot is checkpointed there and the
    followers, held out of the waiting queue until then, fork from it: they share its full pages,
    get a copy of the partial last page and the checkpoint, and compute only the last prompt token
    (each samples its own first token)."""

    name: str
    leader: Sequence
    fork_pos: int
    held: list[Sequence] = field(default_factory=list)  # followers not yet forked, arrival order
    ready: bool = False
    checkpoint: int | None = None  # the leader's state at fork_pos
    pages: list[int] = field(default_factory=list)  # the leader's pages covering [0, fork_pos), retained
    pending_snapshot: int | None = None  # checkpoint id of a save_slot scheduled this step


class ForkGroups:
    def _group_of(self, seq: Sequence) -> "_ForkGroup | None":
        name = getattr(seq, "fork_group", None)
        return self._groups.get(name) if name is not None else None

    def _release_group(self, name: str, *, requeue: bool) -> None:
        """Drop a group's fork state; with `requeue`, its held followers go to the waiting front
        as ordinary requests (the leader is gone before the fork: each computes its prompt)."""
        g = self._groups.pop(name)
        if g.pages:
            self.cache.release(g.pages)
            g.pages = []
        if g.checkpoint is not None:
            self.prefix_cache.checkpoints.free([g.checkpoint])
            g.checkpoint = None
        if g.pending_snapshot is not None:
            self.prefix_cache.checkpoints.free([g.pending_snapshot])
            g.pending_snapshot = None
        for f in reversed(g.held):
            f.fork_group = None
            if requeue:
                self.waiting.appendleft(f)
        g.held = []

    def _plan_fork_snapshot(self, seq: Sequence, end: int, out: SchedulerOutput) -> None:
        g = self._group_of(seq)
        if g is None or g.leader is not seq or g.ready or g.pending_snapshot is not None:
            return
        if end > g.fork_pos:
            # chunks that start before fork_pos are cut there, so the leader started past it (its
            # prompt came from the cache): the others will find it there too
            self._release_group(g.name, requeue=True)
            seq.fork_group = None
            return
        if end != g.fork_pos:
            return
        ids = self.prefix_cache.checkpoints.allocate(1)
        if ids is None:
            self.prefix_cache.evict(num_checkpoints=1)
            ids = self.prefix_cache.checkpoints.allocate(1)
        if ids is None:  # no checkpoint to fork from: the choices compute their prompts each
            self._release_group(g.name, requeue=True)
            seq.fork_group = None
            return
        g.pending_snapshot = ids[0]
        out.snapshot_ops.append(CacheOp("save_slot", (seq.slot_id,), (ids[0],)))

    def _commit_fork(self, seq: Sequence) -> None:
        """The leader's state at fork_pos is checkpointed: its followers may fork."""
        g = self._group_of(seq)
        if g is None or g.pending_snapshot is None or g.leader is not seq:
            return
        g.checkpoint, g.pending_snapshot = g.pending_snapshot, None
        n_pages = self.cache.num_blocks_for(g.fork_pos)
        g.pages = list(seq.block_ids[:n_pages])
        self.cache.retain(g.pages)
        g.ready = True
        for f in reversed(g.held):  # they arrived with the leader: they go first
            self.waiting.appendleft(f)
        g.held = []

    def _fork(self, seq: Sequence, g: "_ForkGroup") -> None:
        """Admit follower `seq` at the group's fork position (the caller checked the page)."""
        bs = self.cache.block_size
        full = g.fork_pos // bs
        self.cache.share_blocks(seq, g.pages[:full])
        if g.fork_pos % bs:
            (page,) = self.cache.allocate_raw(1)
            seq.block_ids.append(page)
            self.prefix_cache._ops.append(CacheOp("copy_pages", (g.pages[full],), (page,)))
        seq.num_computed_tokens = g.fork_pos
        seq.fork_source = g.checkpoint
        seq.num_cached_tokens = g.fork_pos
        self.num_cached_tokens_total += g.fork_pos
        self.num_forked += 1

    def _leave_group(self, seq: Sequence) -> None:
        """`seq` finishes or is preempted: a held follower leaves its group; a leader that has not
        forked yet gives its followers back to the queue as ordinary requests; a group whose last
        follower leaves is dropped."""
        g = self._group_of(seq)
        if g is None:
            return
        name = seq.fork_group
        if seq in g.held:
            g.held.remove(seq)
            seq.fork_group = None
            if not g.held and g.ready:
                self._release_group(name, requeue=False)
            return
        if g.leader is seq and not g.ready:
            self._release_group(name, requeue=True)
            seq.fork_group = None
        elif g.leader is not seq:
            seq.fork_group = None
            if g.ready and not any(getattr(w, "fork_group", None) == name for w in self.waiting):
                self._release_group(name, requeue=False)
        else:
            seq.fork_group = None  # a ready group's leader: its followers keep their fork
