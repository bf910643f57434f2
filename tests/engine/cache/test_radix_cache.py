"""RadixCache unit tests on fabricated data (no scheduler, no runner, no torch).

A real CacheManager with a small page pool holds the pages; IdPools hold checkpoints and the host
tier. A "sequence" here is just pages taken with allocate_raw (one reference, the sequence's),
inserted, and released when the test says the sequence ended.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from trnrt.engine.cache.cache_manager import CacheManager, IdPool
from trnrt.engine.cache.eviction_policy import (
    TLRU_HISTORY,
    EvictionStrategy,
    LRUStrategy,
    TLRUStrategy,
    make_eviction_strategy,
)
from trnrt.engine.output.outputs import CacheOp
from trnrt.engine.cache.radix_cache import RadixCache


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> float:
        self.t += dt
        return self.t


def make_tree(*, ps=4, num_blocks=33, n_ckpt=16, host=None, host_ckpt=None, strategy=None,
              write_policy="write_through"):
    cm = CacheManager(num_blocks, ps, 4)
    ck = IdPool(n_ckpt, "checkpoint")
    hp = hc = None
    if host is not None:
        hp = IdPool(host, "host page")
        hc = IdPool(host if host_ckpt is None else host_ckpt, "host checkpoint")
    clock = Clock()
    tree = RadixCache(cm, ck, host_pages=hp, host_checkpoints=hc, strategy=strategy,
                      write_policy=write_policy, clock=clock)
    return tree, cm, clock


def seq_insert(tree: RadixCache, tokens, *, ckpt=True, priority=0, keep=False):
    """A sequence computed `tokens` into fresh pages, snapshotted at the end and inserted.
    Returns (node, adopted, pages, checkpoint id). The sequence's references are dropped unless
    `keep` (then the caller releases `pages`)."""
    cm = tree.pages
    pages = cm.allocate_raw(len(tokens) // tree.page_size)
    c = tree.checkpoints.allocate(1)[0] if ckpt else None
    node, adopted = tree.insert(tokens, pages, c, priority=priority)
    if c is not None and not adopted:
        tree.checkpoints.free([c])
    if not keep:
        cm.release(pages)
    tree.check_integrity()
    return node, adopted, pages, c


def books(tree: RadixCache, live_pages=()):
    """Every page's ref count = tree references + live sequences'; every pool = its owners."""
    seqs = [SimpleNamespace(block_ids=list(p), slot_id=None, request_id=f"s{i}") for i, p in enumerate(live_pages)]
    tree.pages.check_integrity(seqs, extra_refs=tree.device_page_refs())
    tree.checkpoints.check_integrity(tree.checkpoint_ids())
    if tree.has_host_tier:
        tree.host_pages.check_integrity(tree.host_page_ids())
        tree.host_checkpoints.check_integrity(tree.host_checkpoint_ids())
    tree.check_integrity()


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def prefixes(tree: RadixCache) -> dict[tuple[int, ...], object]:
    """Brute force: every checkpointed prefix the tree holds (root -> node keys concatenated)."""
    out = {}
    stack = [(c, c.key) for c in tree.root.children.values()]
    while stack:
        n, k = stack.pop()
        if n.has_checkpoint:
            out[tuple(k)] = n
        stack.extend((c, k + c.key) for c in n.children.values())
    return out


# -- match ----------------------------------------------------------------------------------------


def test_empty_tree_and_short_queries_match_the_root():
    tree, _, _ = make_tree()
    m = tree.match(toks(0, 20))
    assert m.node is tree.root and m.path == [] and m.num_tokens == 0
    seq_insert(tree, toks(0, 8))
    for q in ([], [0], [0, 1, 2]):  # less than a page
        assert tree.match(q).node is tree.root


def test_match_returns_deepest_checkpointed_node_not_deepest_match():
    tree, _, _ = make_tree()
    a, _, _, _ = seq_insert(tree, toks(0, 8))
    b, adopted, _, _ = seq_insert(tree, toks(0, 16), ckpt=False)
    assert not adopted and b.checkpoint is None and b.parent is a
    m = tree.match(toks(0, 20))
    assert m.node is a and m.num_tokens == 8 and m.path == [a]
    # deeper again with a checkpoint: now that one
    c, _, _, _ = seq_insert(tree, toks(0, 24))
    m = tree.match(toks(0, 30))
    assert m.node is c and m.path == [a, b, c] and m.num_tokens == 24
    # a query that stops inside c's edge resumes at a (b has no checkpoint)
    assert tree.match(toks(0, 23)).node is a
    assert tree.has_checkpoint_at(toks(0, 8)) and tree.has_checkpoint_at(toks(0, 24))
    assert not tree.has_checkpoint_at(toks(0, 16)) and not tree.has_checkpoint_at(toks(0, 12))


@pytest.mark.parametrize("diff_at, expect_end", [
    (0, 0),    # first token of the first page
    (3, 0),    # last token of the first page
    (4, 4),    # page start of the second node
    (6, 4),    # mid-page
    (7, 4),    # last token of a page
    (8, 8),    # start of the multi-page edge
    (12, 8),   # page start inside the multi-page edge
    (13, 8),   # mid-page inside it
    (15, 8),   # the very last token of the edge
    (None, 16),
])
def test_match_never_crosses_a_differing_token(diff_at, expect_end):
    tree, _, _ = make_tree()
    seq_insert(tree, toks(100, 4))
    seq_insert(tree, toks(100, 8))
    seq_insert(tree, toks(100, 16))  # [8:16] is one 2-page edge
    q = toks(100, 20)
    if diff_at is not None:
        q[diff_at] = 9999
    m = tree.match(q)
    assert m.num_tokens == expect_end
    assert q[:m.num_tokens] == toks(100, expect_end)
    assert [n.end_pos for n in m.path] == [4, 8, 16][:len(m.path)]


def test_match_touch_refreshes_access_times_along_the_path_only():
    tree, _, clock = make_tree()
    seq_insert(tree, toks(0, 8))
    seq_insert(tree, toks(0, 16))
    other, _, _, _ = seq_insert(tree, toks(50, 8))
    clock.t = 5.0
    m = tree.match(toks(0, 12), touch=False)
    assert all(n.last_access_time == 0.0 for n in tree._nodes())
    m = tree.match(toks(0, 12))
    assert [n.last_access_time for n in m.path] == [5.0]
    assert other.last_access_time == 0.0
    assert [n for n in tree._nodes() if n.last_access_time == 5.0] == m.path


# -- insert ---------------------------------------------------------------------------------------


def test_insert_creates_then_extends():
    tree, cm, _ = make_tree()
    a, adopted, p1, c1 = seq_insert(tree, toks(0, 8), keep=True)
    assert adopted and a.key == tuple(toks(0, 8)) and a.start_pos == 0 and a.device_pages == p1
    assert a.checkpoint == c1 and a.parent is tree.root and list(tree.root.children) == [tuple(toks(0, 4))]
    assert [cm.ref_count(b) for b in p1] == [2, 2]  # sequence + tree
    cm.release(p1)
    assert [cm.ref_count(b) for b in p1] == [1, 1]
    b, adopted, p2, c2 = seq_insert(tree, toks(0, 16), keep=True)
    assert adopted and b.parent is a and b.key == tuple(toks(8, 8)) and b.start_pos == 8
    assert b.device_pages == p2[2:] and a.device_pages == p1 and a.checkpoint == c1 and b.checkpoint == c2
    # the sequence's duplicates of a's pages are not adopted
    assert [cm.ref_count(x) for x in p2] == [1, 1, 2, 2]
    cm.release(p2)
    assert [cm.ref_count(x) for x in p2] == [0, 0, 1, 1] and [cm.ref_count(x) for x in p1] == [1, 1]
    assert list(a.children) == [tuple(toks(8, 4))]
    books(tree)


def test_insert_splits_at_a_page_boundary_keeping_checkpoint_below_and_locks_on_both():
    tree, cm, _ = make_tree()
    low, _, p, c1 = seq_insert(tree, toks(0, 16))
    tree.lock(low)
    upper, adopted, p2, c2 = seq_insert(tree, toks(0, 8))
    assert upper is not low and adopted
    assert upper.key == tuple(toks(0, 8)) and upper.start_pos == 0 and upper.device_pages == p[:2]
    assert low.key == tuple(toks(8, 8)) and low.start_pos == 8 and low.device_pages == p[2:]
    assert low.parent is upper and upper.parent is tree.root
    assert tree.root.children[tuple(toks(0, 4))] is upper and upper.children[tuple(toks(8, 4))] is low
    assert low.checkpoint == c1 and upper.checkpoint == c2  # split keeps c1 at position 16
    assert upper.lock_ref == 1 and low.lock_ref == 1
    assert [cm.ref_count(x) for x in p] == [1] * 4 and [cm.ref_count(x) for x in p2] == [0, 0]
    tree.unlock(low)
    assert upper.lock_ref == 0 and low.lock_ref == 0
    books(tree)


def test_divergent_insert_splits_and_adds_a_sibling():
    tree, cm, _ = make_tree()
    a, _, p, c1 = seq_insert(tree, toks(0, 16))
    q = toks(0, 8) + toks(200, 8)
    b, adopted, pb, c2 = seq_insert(tree, q)
    assert adopted and b.key == tuple(toks(200, 8)) and b.start_pos == 8 and b.device_pages == pb[2:]
    up = b.parent
    assert up is a.parent and up.key == tuple(toks(0, 8)) and up.checkpoint is None
    assert set(up.children) == {tuple(toks(8, 4)), tuple(toks(200, 4))}
    assert up.device_pages == p[:2] and a.device_pages == p[2:] and a.checkpoint == c1
    assert tree.match(toks(0, 16) + [1]).node is a and tree.match(q + [1]).node is b
    assert tree.match(toks(0, 8) + [7] * 8).node is tree.root  # the split node has no checkpoint
    books(tree)


def test_reinsert_of_a_cached_prefix_adopts_nothing():
    tree, cm, _ = make_tree()
    a, _, p, c1 = seq_insert(tree, toks(0, 8))
    before = (cm.num_free_blocks, tree.checkpoints.num_free)
    pages = cm.allocate_raw(2)
    c2 = tree.checkpoints.allocate(1)[0]
    node, adopted = tree.insert(toks(0, 8), pages, c2)
    assert node is a and adopted is False and a.checkpoint == c1 and a.device_pages == p
    assert [cm.ref_count(x) for x in pages] == [1, 1]  # only the sequence's
    tree.checkpoints.free([c2])
    cm.release(pages)
    assert (cm.num_free_blocks, tree.checkpoints.num_free) == before
    # a checkpoint-less re-insert onto a node without one adopts nothing either
    n2, adopted = tree.insert(toks(0, 8), cm.allocate_raw(2), None)
    assert n2 is a and adopted is False
    with pytest.raises(ValueError):
        tree.insert(toks(0, 6), [1, 2], None)  # not whole pages
    with pytest.raises(ValueError):
        tree.insert(toks(0, 8), [1], None)  # too few pages


def test_insert_adopts_checkpoint_on_a_node_without_one():
    tree, _, _ = make_tree()
    seq_insert(tree, toks(0, 8), ckpt=False)
    assert tree.match(toks(0, 12)).node is tree.root
    node, adopted, _, c = seq_insert(tree, toks(0, 8))
    assert adopted and node.checkpoint == c
    assert tree.match(toks(0, 12)).node is node


def test_lock_unlock_along_the_path():
    tree, _, _ = make_tree()
    a, _, _, _ = seq_insert(tree, toks(0, 8))
    b, _, _, _ = seq_insert(tree, toks(0, 16))
    c, _, _, _ = seq_insert(tree, toks(0, 8) + toks(300, 4))
    tree.lock(b)
    tree.lock(c)
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (2, 1, 1)
    tree.lock(None)
    tree.lock(tree.root)
    assert tree.root.lock_ref == 0
    tree.evict(10**6)  # everything evictable goes; nothing locked does
    assert tree.match(toks(0, 20)).node is b and tree.match(toks(0, 8) + toks(300, 5)).node is c
    tree.unlock(c)
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (1, 1, 0)
    with pytest.raises(AssertionError):
        tree.unlock(c)
    tree.unlock(b)
    with pytest.raises(AssertionError):
        tree.unlock(a)
    books(tree)


# -- eviction -------------------------------------------------------------------------------------


def _four_leaves(tree, clock):
    """A: 1 page, t=1, 3 hits, prio 5; B: 3 pages, t=2, 0 hits, prio 1;
    C: 1 page, t=3, 1 hit, prio 0;  D: 3 pages, t=4, 2 hits, prio 2 (all root children)."""
    spec = {"A": (1, 3, 5), "B": (3, 0, 1), "C": (1, 1, 0), "D": (3, 2, 2)}
    nodes = {}
    for i, (name, (n_pages, hits, prio)) in enumerate(spec.items()):
        clock.t = i + 1.0
        t = toks(1000 * (i + 1), 4 * n_pages)
        node, _, _, _ = seq_insert(tree, t, priority=prio)
        for _ in range(hits):
            tree.record_hit(tree.match(t, touch=False))
        nodes[name] = node
    return nodes


EXPECTED_ORDER = {
    "lru": "ABCD",       # access time
    "lfu": "BCDA",       # hits, then time
    "slru": "BCAD",      # probationary (hits < 2) first, then time
    "priority": "CBDA",  # priority, then time
    "tlru": "ACBD",      # TEL-safe (4-token leaves, threshold 8) first, then time
}


@pytest.mark.parametrize("policy", sorted(EXPECTED_ORDER))
def test_evict_order_follows_each_strategy(policy):
    cfg = {"threshold": 8} if policy == "tlru" else {}
    tree, cm, clock = make_tree(strategy=make_eviction_strategy(policy, cfg))
    nodes = _four_leaves(tree, clock)
    name_of = {n.id: k for k, n in nodes.items()}
    clock.t = 100.0
    order = []
    while tree.root.children:
        alive = {n.id for n in tree.root.children.values()}
        freed = tree.evict(cm.num_free_blocks + 1)  # one more page than free: one leaf
        gone = alive - {n.id for n in tree.root.children.values()}
        assert len(gone) == 1, "evict went past the pages it was asked for"
        (g,) = gone
        assert freed == len(nodes[name_of[g]].key) // 4
        order.append(name_of[g])
        books(tree)
    assert "".join(order) == EXPECTED_ORDER[policy]
    assert cm.num_free_blocks == cm.num_usable_blocks


def test_evict_pushes_a_parent_once_it_becomes_a_leaf():
    tree, cm, clock = make_tree()
    clock.t = 1
    seq_insert(tree, toks(0, 8))
    x, _, _, _ = seq_insert(tree, toks(0, 8) + toks(100, 4))
    clock.t = 2
    y, _, _, _ = seq_insert(tree, toks(0, 8) + toks(200, 4))  # P touched at 2
    p = y.parent
    clock.t = 3
    z, _, _, _ = seq_insert(tree, toks(500, 8))
    evicted = []
    spy_evict = tree._evict_device

    def spy(node):
        evicted.append(node)
        return spy_evict(node)

    tree._evict_device = spy
    freed = tree.evict(10**6)
    assert evicted == [x, y, p, z]
    assert freed == 1 + 1 + 2 + 2 and cm.num_free_blocks == cm.num_usable_blocks
    assert not tree.root.children
    books(tree)


def test_evict_stops_when_enough_pages_are_free_and_skips_locked():
    tree, cm, clock = make_tree(num_blocks=13)  # 12 usable pages
    made = []
    for i in range(5):
        clock.t = i
        made.append(seq_insert(tree, toks(100 * (i + 1), 8))[0])  # 2 pages each -> 10 used
    assert cm.num_free_blocks == 2
    tree.lock(made[0])
    freed = tree.evict(5)  # needs 3 more: two leaves (the oldest unlocked)
    assert freed == 4 and cm.num_free_blocks == 6
    alive = set(n.id for n in tree.root.children.values())
    assert alive == {made[0].id, made[3].id, made[4].id}
    assert tree.evict(6) == 0  # already enough
    assert tree.evictable_pages() == 4
    tree.evict(10**6)
    assert set(n.id for n in tree.root.children.values()) == {made[0].id}
    tree.unlock(made[0])
    books(tree)


def test_evict_does_not_free_pages_a_sequence_still_holds():
    tree, cm, _ = make_tree()
    a, _, p, _ = seq_insert(tree, toks(0, 8), keep=True)
    assert tree.evict(10**6) == 0  # the reference goes, the pages stay the sequence's
    assert not tree.root.children and [cm.ref_count(x) for x in p] == [1, 1]
    books(tree, live_pages=[p])
    cm.release(p)
    books(tree)


def test_evict_for_checkpoints():
    tree, cm, clock = make_tree(n_ckpt=2)
    clock.t = 1
    a, _, _, _ = seq_insert(tree, toks(0, 4))
    clock.t = 2
    b, _, _, _ = seq_insert(tree, toks(100, 4))
    assert tree.checkpoints.num_free == 0
    tree.evict(num_checkpoints=1)
    assert tree.checkpoints.num_free == 1
    assert list(tree.root.children.values()) == [b]
    tree.evict(num_checkpoints=1)  # already one free
    assert list(tree.root.children.values()) == [b]
    books(tree)


def test_reset_releases_everything():
    tree, cm, clock = make_tree(host=8, host_ckpt=4)
    for i in range(4):
        seq_insert(tree, toks(100 * i, 8))
    tree.evict(cm.num_free_blocks + 2)  # one host-only node
    assert any(not n.on_device for n in tree._nodes())
    tree.reset()
    assert not tree.root.children and tree.take_ops() == []
    assert cm.num_free_blocks == cm.num_usable_blocks
    for pool in (tree.checkpoints, tree.host_pages, tree.host_checkpoints):
        assert pool.num_free == pool.size and pool.num_used == 0
    cm.reset()  # only an all-free manager resets
    books(tree)


# -- hooks ----------------------------------------------------------------------------------------


class Spy(EvictionStrategy):
    def __init__(self):
        self.calls = []

    def key(self, node):
        return (node.last_access_time,)

    def on_access(self, node, now):
        assert node.last_access_time == now
        self.calls.append(("access", node.id))

    def on_insert(self, node):
        self.calls.append(("insert", node.id))

    def on_evict(self, node):
        assert node.parent is not None and node.on_device  # before removal
        self.calls.append(("evict", node.id))


def test_strategy_hooks_on_insert_match_evict():
    spy = Spy()
    tree, _, clock = make_tree(strategy=spy)
    a, _, _, _ = seq_insert(tree, toks(0, 8))
    assert spy.calls == [("insert", a.id), ("access", a.id)]
    spy.calls.clear()
    clock.t = 1
    b, _, _, _ = seq_insert(tree, toks(0, 16))
    assert spy.calls == [("access", a.id), ("insert", b.id), ("access", b.id)]
    spy.calls.clear()
    tree.match(toks(0, 16))
    assert spy.calls == [("access", a.id), ("access", b.id)]
    spy.calls.clear()
    tree.match(toks(0, 16), touch=False)
    assert spy.calls == []
    tree.evict(10**6)
    assert spy.calls == [("evict", b.id), ("evict", a.id)]


def test_split_upper_half_reported_to_on_insert():
    spy = Spy()
    tree, _, _ = make_tree(strategy=spy)
    low, _, _, _ = seq_insert(tree, toks(0, 16))
    spy.calls.clear()
    upper, _, _, _ = seq_insert(tree, toks(0, 8))
    assert ("insert", upper.id) in spy.calls


@pytest.mark.parametrize("host", [None, 16])
def test_tlru_partial_regrowth_keeps_the_full_history(host):
    """4-token pages: prefix [0:4], tail [4:12]; evict the tail, re-insert only [4:8], evict again:
    the prefix's history stays 12 (on_evict takes the max, the tree calls it before removal)."""
    tlru = TLRUStrategy(threshold=4)
    tree, cm, clock = make_tree(strategy=tlru, host=host, write_policy="write_back")
    prefix, _, _, _ = seq_insert(tree, toks(0, 4))
    tail, _, _, _ = seq_insert(tree, toks(0, 12))
    assert tail.parent is prefix and tail.key == tuple(toks(4, 8))
    tree.lock(prefix)  # only the tail can go
    tree.evict(10**6)
    assert not tail.on_device
    assert prefix.policy_data[TLRU_HISTORY] == 12 and TLRUStrategy.history_len(prefix) == 12
    clock.t = 1
    short, _, _, _ = seq_insert(tree, toks(0, 8))
    assert short.parent is prefix and short.key == tuple(toks(4, 4)) and short.on_device
    assert TLRUStrategy.history_len(short) >= 8
    tree.evict(10**6)
    assert not short.on_device
    assert TLRUStrategy.history_len(prefix) == 12
    assert prefix.policy_data[TLRU_HISTORY] == 12
    # the prefix (start 0) is within budget 12 - 4 = 8: not TEL-safe
    assert not tlru.is_tel_safe(prefix)
    tree.unlock(prefix)
    books(tree)


# -- host tier ------------------------------------------------------------------------------------


def test_write_through_copies_at_insert():
    tree, cm, _ = make_tree(host=8, host_ckpt=4)
    a, _, p, c = seq_insert(tree, toks(0, 8))
    ops = tree.take_ops()
    assert ops == [CacheOp("pages_to_host", tuple(p), tuple(a.host_pages)),
                   CacheOp("ckpt_to_host", (c,), (a.host_checkpoint,))]
    assert a.host_pages == [0, 1] and a.host_checkpoint == 0
    assert tree.take_ops() == []
    # extending: only the new node is copied
    b, _, p2, c2 = seq_insert(tree, toks(0, 16))
    assert tree.take_ops() == [CacheOp("pages_to_host", tuple(p2[2:]), (2, 3)), CacheOp("ckpt_to_host", (c2,), (1,))]
    # eviction copies nothing more
    tree.evict(10**6)
    assert tree.take_ops() == []
    assert not a.on_device and not b.on_device and a.on_host and b.on_host
    assert tree.num_host_written_pages == 4
    books(tree)


def test_write_back_copies_only_at_eviction_and_match_finds_host_nodes():
    tree, cm, _ = make_tree(host=8, host_ckpt=4, write_policy="write_back")
    a, _, p, c = seq_insert(tree, toks(0, 8))
    b, _, p2, c2 = seq_insert(tree, toks(0, 16))
    assert tree.take_ops() == [] and a.host_pages is None
    tree.evict(cm.num_free_blocks + 1)  # b only
    ops = tree.take_ops()
    assert ops == [CacheOp("pages_to_host", tuple(p2[2:]), tuple(b.host_pages)),
                   CacheOp("ckpt_to_host", (c2,), (b.host_checkpoint,))]
    assert b.device_pages is None and b.checkpoint is None and a.on_device
    assert [cm.ref_count(x) for x in p2[2:]] == [0, 0]
    m = tree.match(toks(0, 20))
    assert m.node is b and m.path == [a, b]
    assert m.host_nodes == [b] and m.host_tokens == 8 and m.num_host_pages == 2 and m.device_tokens == 8
    tree.evict(10**6)
    m = tree.match(toks(0, 20))
    assert m.node is b and m.host_nodes == [a, b] and m.host_tokens == 16 and m.num_host_pages == 4
    books(tree)


def test_load_to_device_allocates_pages_and_queues_copies():
    tree, cm, _ = make_tree(host=8, host_ckpt=4, write_policy="write_back")
    seq_insert(tree, toks(0, 8))
    seq_insert(tree, toks(0, 16))
    tree.evict(10**6)
    tree.take_ops()
    m = tree.match(toks(0, 20))
    tree.lock(m.node)
    free = cm.num_free_blocks
    assert tree.load_to_device(m) == 4
    ops = tree.take_ops()
    a, b = m.path
    assert ops == [CacheOp("pages_to_device", tuple(a.host_pages), tuple(a.device_pages)),
                   CacheOp("pages_to_device", tuple(b.host_pages), tuple(b.device_pages))]
    assert cm.num_free_blocks == free - 4 and all(cm.ref_count(x) == 1 for x in a.device_pages + b.device_pages)
    assert tree.num_host_loaded_pages == 4
    assert b.checkpoint is None and b.host_checkpoint is not None  # restored from host by the scheduler
    assert m.host_nodes == [] and tree.match(toks(0, 20)).node is b
    books(tree)
    # evicted again: the host copy is kept, nothing is copied twice
    tree.unlock(m.node)
    tree.evict(10**6)
    assert tree.take_ops() == [] and tree.match(toks(0, 20)).node is b
    books(tree)


def test_host_pool_full_evicts_host_leaves_by_strategy():
    tree, cm, clock = make_tree(host=4, host_ckpt=4)
    clock.t = 1
    x, _, _, _ = seq_insert(tree, toks(100, 8))
    clock.t = 2
    y, _, _, _ = seq_insert(tree, toks(200, 8))
    tree.evict(10**6)  # both host-only
    tree.take_ops()
    assert tree.host_pages.num_free == 0
    clock.t = 3
    z, _, _, _ = seq_insert(tree, toks(300, 8))  # write-through needs 2 host pages: x goes (older)
    assert z.on_host and x.parent is None and y.parent is tree.root
    assert tree.match(toks(100, 9)).node is tree.root and tree.match(toks(200, 9)).node is y
    assert [o.kind for o in tree.take_ops()] == ["pages_to_host", "ckpt_to_host"]
    books(tree)


def test_host_pool_full_of_device_copies_node_without_host_copy_is_deleted_with_subtree():
    tree, cm, clock = make_tree(host=2, host_ckpt=2)
    x, _, _, _ = seq_insert(tree, toks(100, 8))  # takes the whole host pool, stays on device
    tree.lock(x)
    y, _, _, _ = seq_insert(tree, toks(200, 8), ckpt=False)
    y2, _, _, _ = seq_insert(tree, toks(200, 12))
    assert y.host_pages is None and y2.host_pages is None
    tree.evict(10**6)
    assert y.parent is None and y2.parent is None and y.device_pages is None
    assert list(tree.root.children.values()) == [x]
    assert tree.match(toks(200, 13)).node is tree.root
    tree.unlock(x)
    books(tree)
    # a host-only child of a node that cannot be copied goes with it
    tree2, cm2, clock2 = make_tree(host=1, host_ckpt=1, write_policy="write_back")
    p, _, _, _ = seq_insert(tree2, toks(0, 12))  # 3 pages: never fits the host
    clock2.t = 1
    ch, _, _, _ = seq_insert(tree2, toks(0, 16))
    tree2.evict(10**6)
    assert not tree2.root.children and p.parent is None and ch.parent is None
    assert cm2.num_free_blocks == cm2.num_usable_blocks
    books(tree2)


def test_reinsert_through_a_host_only_node_takes_the_sequence_pages():
    tree, cm, _ = make_tree(host=8, host_ckpt=4, write_policy="write_back")
    a, _, _, _ = seq_insert(tree, toks(0, 16))
    tree.evict(10**6)
    tree.take_ops()
    assert not a.on_device and a.on_host
    node, adopted, p, c = seq_insert(tree, toks(0, 16), keep=True)
    assert node is a and adopted and a.device_pages == p and a.checkpoint == c
    assert [cm.ref_count(x) for x in p] == [2] * 4
    cm.release(p)
    # a shorter one splits the host-only node, the upper half takes the pages
    tree.evict(10**6)
    up, adopted, p2, c2 = seq_insert(tree, toks(0, 8))
    assert up.device_pages == p2 and not a.on_device and a.parent is up and a.host_pages is not None
    assert [cm.ref_count(x) for x in p2] == [1, 1]
    books(tree)


# -- randomized integrity -------------------------------------------------------------------------


@pytest.mark.parametrize("policy, host, write_policy, seed", [
    ("lru", None, "write_through", 0),
    ("lfu", 10, "write_through", 1),
    ("slru", 10, "write_back", 2),
    ("priority", 6, "write_through", 3),
    ("tlru", 10, "write_back", 4),
])
def test_randomized_integrity_against_a_brute_force_model(policy, host, write_policy, seed):
    rng = random.Random(seed)
    ps = 4
    cfg = {"threshold": 8, "next_prompt_estimate": 4} if policy == "tlru" else {}
    tree, cm, clock = make_tree(ps=ps, num_blocks=25, n_ckpt=6, host=host, host_ckpt=4 if host else None,
                                strategy=make_eviction_strategy(policy, cfg), write_policy=write_policy)
    bases = [[rng.randrange(50) for _ in range(32)] for _ in range(3)]
    live: list[list[int]] = []   # pages of "sequences" still running
    locks: list[object] = []     # nodes locked by matches
    model: set[tuple[int, ...]] = set()  # checkpointed prefixes the tree may hold

    def query():
        b = list(rng.choice(bases))
        n = rng.randrange(1, 33)
        q = b[:n]
        if rng.random() < 0.3 and q:
            q[rng.randrange(len(q))] = rng.randrange(50)
        return q + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]

    def check():
        books(tree, live)
        have = prefixes(tree)
        assert set(have) <= model, "the tree holds a prefix nobody inserted"
        model.intersection_update(have)
        for n in locks:  # locked nodes stay, with their checkpoint
            assert n.parent is not None and n.has_checkpoint
        for _ in range(3):
            q = query()
            best = max((k for k in model if len(k) <= len(q) and tuple(q[:len(k)]) == k), key=len, default=())
            m = tree.match(q, touch=False)
            assert m.num_tokens == len(best), (q, best, m)
            if best:
                assert m.node is have[best]

    for step in range(300):
        clock.tick()
        op = rng.random()
        if op < 0.4:  # a sequence inserts a checkpointed prefix
            q = query()
            n = len(q) // ps * ps
            if n == 0:
                continue
            t = q[:n]
            need = n // ps
            if cm.num_free_blocks < need:
                tree.evict(need)
            if cm.num_free_blocks < need:
                continue
            pages = cm.allocate_raw(need)
            c = tree.checkpoints.allocate(1)
            if c is None:
                tree.evict(num_checkpoints=1)
                c = tree.checkpoints.allocate(1)
            ck = c[0] if c else None
            node, adopted = tree.insert(t, pages, ck, priority=rng.randrange(3))
            if ck is not None and not adopted:
                tree.checkpoints.free([ck])
            assert node.end_pos == n and node.on_device
            if node.has_checkpoint:
                model.add(tuple(t))
            if rng.random() < 0.5:
                live.append(pages)
            else:
                cm.release(pages)
        elif op < 0.55:  # match, lock, maybe load from host
            m = tree.match(query())
            if m.node is tree.root:
                continue
            tree.lock(m.node)
            if m.host_nodes:
                need = m.num_host_pages
                if cm.num_free_blocks < need:
                    tree.evict(need)
                if cm.num_free_blocks >= need:
                    assert tree.load_to_device(m) == need
                    assert all(n.on_device for n in m.path)
                    tree.record_hit(m)
                    locks.append(m.node)
                else:
                    tree.unlock(m.node)
            else:
                tree.record_hit(m)
                locks.append(m.node)
        elif op < 0.7 and locks:
            tree.unlock(locks.pop(rng.randrange(len(locks))))
        elif op < 0.8 and live:
            cm.release(live.pop(rng.randrange(len(live))))
        elif op < 0.95:
            if rng.random() < 0.5:
                tree.evict(rng.randrange(1, 25))
            else:
                tree.evict(num_checkpoints=rng.randrange(1, 4))
        else:
            tree.take_ops()
        check()
    for n in locks:
        tree.unlock(n)
    for p in live:
        cm.release(p)
    tree.reset()
    assert cm.num_free_blocks == cm.num_usable_blocks and tree.checkpoints.num_free == 6
    books(tree)
