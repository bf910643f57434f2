"""CacheManager: reserved scratch block/slot, all-or-nothing allocation, ref counts, integrity checks."""

import pytest

from trnrt.engine.cache.cache_manager import CacheIntegrityError, CacheManager, NoFreeBlocksError
from trnrt.engine.request import SamplingParams
from trnrt.engine.output.sequence import Sequence


def seq(rid: str, n: int = 4) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams())


def test_scratch_block_and_slot_never_handed_out():
    cm = CacheManager(num_blocks=5, block_size=4, num_slots=3)
    assert (cm.num_free_blocks, cm.num_free_slots) == (4, 2)
    a, b = seq("a"), seq("b")
    cm.allocate_blocks_for(a, 8)  # 2 pages
    cm.allocate_blocks_for(b, 8)
    assert sorted(a.block_ids + b.block_ids) == [1, 2, 3, 4]
    assert {a.slot_id, b.slot_id} == {1, 2}
    assert cm.num_free_blocks == 0 and cm.num_free_slots == 0 and cm.usage == 1.0
    c = seq("c")
    assert not cm.can_allocate_for(c, 1)
    with pytest.raises(NoFreeBlocksError):
        cm.allocate_blocks_for(c, 1)
    cm.check_integrity([a, b])


def test_allocation_is_all_or_nothing_and_grows_by_ceil():
    cm = CacheManager(num_blocks=4, block_size=4, num_slots=4)
    a = seq("a")
    assert cm.allocate_blocks_for(a, 1) == [1]
    assert cm.allocate_blocks_for(a, 4) == []  # still fits in page 1
    assert cm.allocate_blocks_for(a, 5) == [2]
    assert cm.num_new_blocks_needed(a, 13) == 2  # only one page left
    with pytest.raises(NoFreeBlocksError):
        cm.allocate_blocks_for(a, 13)
    assert a.block_ids == [1, 2] and cm.num_free_blocks == 1  # nothing partially taken
    # a slot is needed too: no pages are taken when the slot is missing
    cm2 = CacheManager(num_blocks=4, block_size=4, num_slots=2)
    x, y = seq("x"), seq("y")
    cm2.allocate_blocks_for(x, 4)
    assert not cm2.can_allocate_for(y, 4)
    with pytest.raises(NoFreeBlocksError):
        cm2.allocate_blocks_for(y, 4)
    assert y.block_ids == [] and cm2.num_free_blocks == 2


def test_shared_blocks_are_freed_when_the_last_reference_goes():
    cm = CacheManager(num_blocks=6, block_size=2, num_slots=4)
    a, b = seq("a"), seq("b")
    cm.allocate_blocks_for(a, 6)  # pages 1,2,3
    cm.share_blocks(b, a.block_ids[:2])  # b shares the full prefix pages
    cm.allocate_blocks_for(b, 6)  # and gets its own third page + slot
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    assert [cm.ref_count(x) for x in a.block_ids] == [2, 2, 1]
    cm.check_integrity([a, b])
    cm.free(a)
    assert cm.num_used_blocks == 3 and cm.ref_count(b.block_ids[0]) == 1
    cm.check_integrity([b])
    cm.free(b)
    cm.free(b)  # idempotent
    assert cm.num_used_blocks == 0 and cm.num_used_slots == 0
    cm.check_integrity([])
    with pytest.raises(ValueError):
        cm.share_blocks(seq("c"), [1])  # a free page cannot be shared


def test_check_integrity_catches_leaks_and_double_ownership():
    cm = CacheManager(num_blocks=4, block_size=2, num_slots=3)
    a = seq("a")
    cm.allocate_blocks_for(a, 2)
    cm.check_integrity([a])
    with pytest.raises(CacheIntegrityError):
        cm.check_integrity([])  # a's page and slot are not accounted for: a leak
    ghost = seq("ghost")
    ghost.block_ids = list(a.block_ids)
    with pytest.raises(CacheIntegrityError):
        cm.check_integrity([a, ghost])  # page held by two tables with ref count 1
    cm._free_blocks.append(a.block_ids[0])  # corrupt: a used page in the free list
    with pytest.raises(CacheIntegrityError):
        cm.check_integrity()


def test_constructor_rejects_too_small_pools():
    with pytest.raises(ValueError, match="num_blocks"):
        CacheManager(num_blocks=1, block_size=4, num_slots=2)
    with pytest.raises(ValueError, match="num_slots"):
        CacheManager(num_blocks=4, block_size=4, num_slots=1)
