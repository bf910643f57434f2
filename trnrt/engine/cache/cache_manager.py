"""CacheManager: pages of the paged state and slots of the per-sequence state. Pure Python.

GLM-5.3-Flash keeps two kinds of state per sequence:
- paged: MLA latents and the indexer's pooled keys. Both live in pages of `block_size` tokens and
  share ONE block table per sequence (page i of the latents and of the pooled keys hold the same
  token range), so one allocator serves both.
- per-sequence: the KDA recurrent state, the conv window and the indexer's open-pool tail. These
  are fixed-size, so each running sequence owns one slot.

NOTE: block 0 and slot 0 are scratch targets for the model's padding rows; they are never handed
out, so usable blocks are 1..num_blocks-1 and usable slots 1..num_slots-1.

Blocks carry reference counts so that a prefix cache (or `n` > 1 forks) can share full pages
between sequences: `share_blocks` increments, `free` decrements, a page returns to the free list
at zero. Slots are never shared (recurrent state is overwritten in place).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from trnrt.engine.output.sequence import Sequence

SCRATCH_BLOCK_ID = 0
SCRATCH_SLOT_ID = 0


class NoFreeBlocksError(RuntimeError):
    """An allocation was attempted without checking can_allocate first (a scheduler bug)."""


class CacheIntegrityError(AssertionError):
    """check_integrity found an inconsistency (a leaked, double-freed or double-owned page/slot)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class IdPool:
    """A free list of integer ids 0..size-1 (state checkpoints, host pages, host checkpoints).

    Unlike pages, these are never shared: each id has one owner (the prefix cache, or a snapshot in
    flight), so there are no reference counts.
    """

    def __init__(self, size: int, name: str = "id"):
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{name} pool size must be an integer >= 0, got {size!r}")
        self.size = size
        self.name = name
        self._free: deque[int] = deque(range(size))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int = 1) -> list[int] | None:
        """n ids, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise CacheIntegrityError(f"{self.name} {i}: freed but not in use")
            self._used.remove(i)
            self._free.append(i)

    def used_ids(self) -> set[int]:
        return set(self._used)

    def reset(self) -> None:
        self._free = deque(range(self.size))
        self._used = set()

    def check_integrity(self, owned: Iterable[int] | None = None) -> None:
        """Free + used partition the ids; with `owned` (every id some owner holds, with repeats)
        the used set equals it exactly, each id once."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._used or len(free) + len(self._used) != self.size:
            raise CacheIntegrityError(f"{self.name} pool: free/used lists inconsistent")
        if owned is None:
            return
        owned = list(owned)
        if len(owned) != len(set(owned)):
            raise CacheIntegrityError(f"{self.name} pool: an id has two owners: {sorted(owned)}")
        if set(owned) != self._used:
            raise CacheIntegrityError(
                f"{self.name} pool: used {sorted(self._used)} but owned {sorted(owned)} (leak or double use)")


class CacheManager:
    """Allocates pages (blocks) and slots to sequences.

    Args:
        num_blocks: pages in the paged cache, including the reserved scratch block 0.
        block_size: tokens per page.
        num_slots: per-sequence state slots, including the reserved scratch slot 0.
    """

    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        for name, v, lo in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1), ("num_slots", num_slots, 2)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo} (block 0 / slot 0 are reserved), got {v!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_slots
        self._free_blocks: deque[int] = deque(range(1, num_blocks))
        self._ref_counts = [0] * num_blocks
        self._free_slots: deque[int] = deque(range(1, num_slots))
        self._slot_owner: dict[int, str] = {}

    # -- counts ------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_usable_slots(self) -> int:
        return self.num_slots - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free_blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_slots(self) -> int:
        return self.num_usable_slots - len(self._free_slots)

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use (the KV-cache usage gauge)."""
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def max_num_tokens_per_seq(self) -> int:
        """Tokens one sequence could hold if it had every usable page."""
        return self.num_usable_blocks * self.block_size

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- sizing ------------------------------------------------------------------------------

    def num_blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks_needed(self, seq: Sequence, num_tokens_total: int) -> int:
        """Extra pages `seq` needs so its block table covers `num_tokens_total` tokens."""
        return max(0, self.num_blocks_for(num_tokens_total) - len(seq.block_ids))

    def can_allocate(self, num_blocks: int, num_slots: int = 0) -> bool:
        """Whether `num_blocks` pages and `num_slots` slots are free right now."""
        return num_blocks <= len(self._free_blocks) and num_slots <= len(self._free_slots)

    def can_allocate_for(self, seq: Sequence, num_tokens_total: int) -> bool:
        """Whether allocate_blocks_for(seq, num_tokens_total) would succeed."""
        need_slot = 1 if seq.slot_id is None else 0
        return self.can_allocate(self.num_new_blocks_needed(seq, num_tokens_total), need_slot)

    # -- allocation --------------------------------------------------------------------------

    def allocate_blocks_for(self, seq: Sequence, num_tokens_total: int) -> list[int]:
        """Grow `seq`'s block table to cover `num_tokens_total` tokens; give it a slot if it has none.

        All or nothing: on failure nothing is allocated.

        Returns:
            The newly allocated block ids (appended to seq.block_ids).
        Raises:
            NoFreeBlocksError: not enough free pages or slots (check can_allocate_for first).
        """
        n = self.num_new_blocks_needed(seq, num_tokens_total)
        need_slot = seq.slot_id is None
        if not self.can_allocate(n, 1 if need_slot else 0):
            raise NoFreeBlocksError(
                f"{seq.request_id}: need {n} pages{' and a slot' if need_slot else ''}, "
                f"{self.num_free_blocks} pages / {self.num_free_slots} slots free"
            )
        if need_slot:
            self.allocate_slot(seq)
        new = [self._free_blocks.popleft() for _ in range(n)]
        for b in new:
            self._ref_counts[b] = 1
        seq.block_ids.extend(new)
        return new

    def allocate_slot(self, seq: Sequence) -> int:
        """Give `seq` a slot (a no-op if it has one)."""
        if seq.slot_id is not None:
            return seq.slot_id
        if not self._free_slots:
            raise NoFreeBlocksError(f"{seq.request_id}: no free slot")
        slot = self._free_slots.popleft()
        self._slot_owner[slot] = seq.request_id
        seq.slot_id = slot
        return slot

    def share_blocks(self, seq: Sequence, block_ids: Iterable[int]) -> None:
        """Append already-allocated pages to `seq`'s block table, taking a reference on each.

        For prefix sharing: the pages must be full (a partially filled page would be written by
        both owners), which the caller (prefix cache / fork) guarantees.
        """
        block_ids = list(block_ids)
        for b in block_ids:
            if not (0 < b < self.num_blocks) or self._ref_counts[b] <= 0:
                raise ValueError(f"cannot share block {b}: not allocated")
        for b in block_ids:
            self._ref_counts[b] += 1
        seq.block_ids.extend(block_ids)

    def allocate_raw(self, n: int) -> list[int]:
        """n pages owned by the caller (the prefix cache), each with one reference, or raise."""
        if n > len(self._free_blocks):
            raise NoFreeBlocksError(f"need {n} pages, {self.num_free_blocks} free")
        new = [self._free_blocks.popleft() for _ in range(n)]
        for b in new:
            self._ref_counts[b] = 1
        return new

    def retain(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on allocated pages (the prefix cache adopting a sequence's pages)."""
        block_ids = list(block_ids)
        for b in block_ids:
            if not (0 < b < self.num_blocks) or self._ref_counts[b] <= 0:
                raise CacheIntegrityError(f"cannot retain block {b}: not allocated")
        for b in block_ids:
            self._ref_counts[b] += 1

    def release(self, block_ids: Iterable[int]) -> int:
        """Drop one reference on each page (the prefix cache evicting). Returns pages freed."""
        freed = 0
        for b in block_ids:
            rc = self._ref_counts[b]
            if rc <= 0:
                raise CacheIntegrityError(f"double release of block {b}")
            self._ref_counts[b] = rc - 1
            if rc == 1:
                self._free_blocks.append(b)
                freed += 1
        return freed

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references on its pages and release its slot. Idempotent."""
        # Reverse order: the tail pages (least likely to be shared) go back first, and a later
        # prefix cache can evict from the same end.
        for b in reversed(seq.block_ids):
            rc = self._ref_counts[b]
            if rc <= 0:
                raise CacheIntegrityError(f"{seq.request_id}: double free of block {b}")
            self._ref_counts[b] = rc - 1
            if rc == 1:
                self._free_blocks.append(b)
        seq.block_ids.clear()
        if seq.slot_id is not None:
            owner = self._slot_owner.pop(seq.slot_id, None)
            if owner != seq.request_id:
                raise CacheIntegrityError(f"{seq.request_id}: slot {seq.slot_id} owned by {owner!r}")
            self._free_slots.append(seq.slot_id)
            seq.slot_id = None

    def reset(self) -> None:
        """Put every page and slot back in its initial free order (an idle engine's cache flush,
        so that allocation after a flush is as after start-up).

        Raises:
            CacheIntegrityError: a page or slot is still in use (only an idle cache resets).
        """
        if self.num_used_blocks or self.num_used_slots or self._slot_owner:
            raise CacheIntegrityError(
                f"cannot reset: {self.num_used_blocks} pages and {self.num_used_slots} slots in use")
        self._free_blocks = deque(range(1, self.num_blocks))
        self._ref_counts = [0] * self.num_blocks
        self._free_slots = deque(range(1, self.num_slots))

    # -- checks ------------------------------------------------------------------------------

    def check_integrity(self, live_seqs: Iterable[Sequence] | None = None,
                        extra_refs: Iterable[int] = ()) -> None:
        """Raise CacheIntegrityError unless the allocator's books balance.

        Always checked: scratch block/slot never free nor used, no duplicate in a free list,
        free + used == usable, a page is free iff its ref count is 0. With `live_seqs` (every
        sequence that holds resources) also: each page's ref count equals the number of block
        tables that hold it (plus its count in `extra_refs`: the prefix cache's pages), and each
        used slot belongs to exactly one of them.
        """
        def fail(msg: str) -> None:
            raise CacheIntegrityError(msg)

        free_blocks = set(self._free_blocks)
        if len(free_blocks) != len(self._free_blocks):
            fail("duplicate block in the free list")
        if SCRATCH_BLOCK_ID in free_blocks or self._ref_counts[SCRATCH_BLOCK_ID] != 0:
            fail("scratch block 0 is in the free list or referenced")
        for b in range(1, self.num_blocks):
            rc = self._ref_counts[b]
            if rc < 0:
                fail(f"block {b} has ref count {rc}")
            if (rc == 0) != (b in free_blocks):
                fail(f"block {b}: ref count {rc} but {'in' if b in free_blocks else 'not in'} the free list")
        free_slots = set(self._free_slots)
        if len(free_slots) != len(self._free_slots):
            fail("duplicate slot in the free list")
        if SCRATCH_SLOT_ID in free_slots or SCRATCH_SLOT_ID in self._slot_owner:
            fail("scratch slot 0 is free or owned")
        if free_slots & set(self._slot_owner):
            fail("a slot is both free and owned")
        if len(free_slots) + len(self._slot_owner) != self.num_usable_slots:
            fail(f"slots leak: {len(free_slots)} free + {len(self._slot_owner)} owned != {self.num_usable_slots}")
        if live_seqs is None:
            return
        counts = [0] * self.num_blocks
        for b in extra_refs:
            counts[b] += 1
        owners: dict[int, str] = {}
        for seq in live_seqs:
            for b in seq.block_ids:
                if b == SCRATCH_BLOCK_ID:
                    fail(f"{seq.request_id} holds scratch block 0")
                counts[b] += 1
            if seq.slot_id is not None:
                if seq.slot_id in owners:
                    fail(f"slot {seq.slot_id} held by {owners[seq.slot_id]!r} and {seq.request_id!r}")
                owners[seq.slot_id] = seq.request_id
        for b in range(1, self.num_blocks):
            if counts[b] != self._ref_counts[b]:
                fail(f"block {b}: ref count {self._ref_counts[b]} but held {counts[b]} times (block tables + prefix cache)")
        if owners != self._slot_owner:
            fail(f"slot owners {self._slot_owner} differ from the live sequences' slots {owners}")
