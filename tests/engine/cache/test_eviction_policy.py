"""Eviction strategies: each policy's eviction order over fabricated TreeNodes, TLRU's history
bookkeeping through a tiny fake tree (that calls the hooks as the radix tree does), the factory."""

from __future__ import annotations

import heapq
import math

import pytest

from trnrt.engine.cache.cache_config import EVICTION_POLICIES
from trnrt.engine.cache.eviction_policy import (
    TLRU_HISTORY,
    TLRUStrategy,
    make_eviction_strategy,
)
from trnrt.engine.cache.radix_node import TreeNode

PAGE = 4


def node(**kw) -> TreeNode:
    kw.setdefault("key", tuple(range(PAGE)))
    kw.setdefault("device_pages", [0])
    return TreeNode(**kw)


def order(strategy, nodes) -> list[TreeNode]:
    """Pop order of a min-heap of (key, id, node), as the tree builds it."""
    heap = [(strategy.key(n), n.id, n) for n in nodes]
    heapq.heapify(heap)
    return [heapq.heappop(heap)[2] for _ in range(len(heap))]


def names(nodes) -> list[str]:
    return [n.policy_data["name"] for n in nodes]


def named(name, **kw) -> TreeNode:
    n = node(**kw)
    n.policy_data["name"] = name
    return n


# -- fake tree ------------------------------------------------------------------------------------


class FakeTree:
    """A device-only radix tree over whole pages, enough to drive the hooks like the real one:
    insert refreshes last_access_time (and hit_count) along the matched path, creates one node for
    the unmatched rest, splits edges at page boundaries; evict pops evictable leaves by key and
    pushes a parent that becomes a leaf; an evicted node leaves the tree."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.root = TreeNode(device_pages=[])
        self.now = 0.0
        self.evicted: list[TreeNode] = []

    def insert(self, tokens: list[int], priority: int = 0) -> TreeNode:
        assert len(tokens) % PAGE == 0
        self.now += 1
        cur, pos = self.root, 0
        while pos < len(tokens):
            first = tuple(tokens[pos : pos + PAGE])
            child = cur.children.get(first)
            if child is None:
                new = TreeNode(key=tuple(tokens[pos:]), parent=cur, start_pos=pos, device_pages=[0],
                               creation_time=self.now, last_access_time=self.now, priority=priority)
                cur.children[first] = new
                self.strategy.on_insert(new)
                self.strategy.on_access(new, self.now)
                return new
            k = 0
            while k < len(child.key) and pos + k < len(tokens) and child.key[k : k + PAGE] == tuple(tokens[pos + k : pos + k + PAGE]):
                k += PAGE
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access_time = self.now
            child.hit_count += 1
            child.priority = max(child.priority, priority)
            self.strategy.on_access(child, self.now)
            cur, pos = child, pos + k
        return cur

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        parent = child.parent
        upper = TreeNode(key=child.key[:k], parent=parent, start_pos=child.start_pos, device_pages=[0],
                         creation_time=child.creation_time, last_access_time=child.last_access_time,
                         hit_count=child.hit_count, priority=child.priority)
        parent.children[child.key[:PAGE]] = upper
        child.key = child.key[k:]
        child.start_pos += k
        child.parent = upper
        upper.children[child.key[:PAGE]] = child
        self.strategy.on_insert(upper)
        return upper

    def evict(self, num_nodes: int) -> list[TreeNode]:
        heap = []

        def push(n):
            if n is not self.root and not n.children and n.lock_ref == 0:
                heapq.heappush(heap, (self.strategy.key(n), n.id, n))

        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            push(n)
        out = []
        while heap and len(out) < num_nodes:
            _, _, n = heapq.heappop(heap)
            self.strategy.on_evict(n)
            del n.parent.children[n.key[:PAGE]]
            n.device_pages = None
            out.append(n)
            push(n.parent)
        self.evicted += out
        return out

    def find(self, tokens: list[int]) -> TreeNode:
        cur, pos = self.root, 0
        while pos < len(tokens):
            cur = cur.children[tuple(tokens[pos : pos + PAGE])]
            pos += len(cur.key)
        assert pos == len(tokens), "not a node boundary"
        return cur


def conv(tag: int, n_pages: int) -> list[int]:
    return [tag * 1000 + i for i in range(n_pages * PAGE)]


# -- order of every policy --------------------------------------------------------------------------


def test_lru_order_and_mru_reverse():
    ns = [named("c", last_access_time=3), named("a", last_access_time=1), named("b", last_access_time=2)]
    assert names(order(make_eviction_strategy("lru", {}), ns)) == ["a", "b", "c"]
    assert names(order(make_eviction_strategy("mru", {}), ns)) == ["c", "b", "a"]


def test_lfu_order_hit_count_then_recency():
    ns = [named("hot_old", hit_count=5, last_access_time=1), named("cold_new", hit_count=0, last_access_time=9),
          named("warm_old", hit_count=2, last_access_time=2), named("warm_new", hit_count=2, last_access_time=8)]
    assert names(order(make_eviction_strategy("lfu", {}), ns)) == ["cold_new", "warm_old", "warm_new", "hot_old"]


@pytest.mark.parametrize("threshold,expected", [
    (None, ["p0", "p1", "hit5_oldest", "hit2_old"]),   # default 2: hit counts 2 and 5 protected
    (4, ["hit2_old", "p0", "p1", "hit5_oldest"]),      # only hit count 5 protected
    (0, ["hit5_oldest", "hit2_old", "p0", "p1"]),      # everything protected: plain LRU
])
def test_slru_probationary_before_protected(threshold, expected):
    ns = [named("p0", hit_count=0, last_access_time=5), named("p1", hit_count=1, last_access_time=6),
          named("hit2_old", hit_count=2, last_access_time=1), named("hit5_oldest", hit_count=5, last_access_time=0)]
    cfg = {} if threshold is None else {"protected_threshold": threshold}
    assert names(order(make_eviction_strategy("slru", cfg), ns)) == expected


def test_priority_order_low_priority_first_then_lru():
    ns = [named("hi", priority=10, last_access_time=1), named("lo_new", priority=-3, last_access_time=9),
          named("mid_new", priority=0, last_access_time=8), named("mid_old", priority=0, last_access_time=2)]
    assert names(order(make_eviction_strategy("priority", {}), ns)) == ["lo_new", "mid_old", "mid_new", "hi"]


def test_fifo_and_filo_by_creation_time():
    ns = [named("second", creation_time=2, last_access_time=50), named("first", creation_time=1, last_access_time=99),
          named("third", creation_time=3, last_access_time=0)]
    assert names(order(make_eviction_strategy("fifo", {}), ns)) == ["first", "second", "third"]
    assert names(order(make_eviction_strategy("filo", {}), ns)) == ["third", "second", "first"]


def test_tlru_order_tel_safe_first_then_lru():
    s = make_eviction_strategy("tlru", {"threshold": 8, "next_prompt_estimate": 0})
    # budget = max(end_pos - 8, 0) (no evicted history): TEL-safe iff start_pos >= budget
    ns = [named("safe_new", start_pos=12, key=tuple(range(4)), last_access_time=9),       # 12 >= 16 - 8
          named("safe_old", start_pos=4, key=tuple(range(4)), last_access_time=1),        # 4 >= max(8 - 8, 0)
          named("protected_old", start_pos=4, key=tuple(range(12)), last_access_time=2)]  # 4 < 16 - 8
    assert [s.key(n)[0] for n in ns] == [-1, -1, 0]
    assert names(order(s, ns)) == ["safe_old", "safe_new", "protected_old"]


def test_tlru_with_default_config_is_lru():
    s = make_eviction_strategy("tlru", {})
    ns = [named("b", start_pos=8, last_access_time=2), named("a", start_pos=0, last_access_time=1),
          named("c", start_pos=40, last_access_time=3)]
    assert all(s.key(n)[0] == 0 for n in ns)  # budget = L > start_pos for any real node
    assert names(order(s, ns)) == ["a", "b", "c"]


# -- TLRU through the fake tree ---------------------------------------------------------------------


def test_tlru_remembers_full_history_after_shorter_reinsert():
    """Evict an 8-token tail below a 4-token prefix, re-insert only the first page of the tail,
    evict that again: the prefix must still count the 12-token history (not 8)."""
    s = make_eviction_strategy("tlru", {"threshold": 8, "next_prompt_estimate": 0})
    t = FakeTree(s)
    c = conv(1, 3)
    t.insert(c[:4])                      # prefix P [0:4]
    t.insert(c)                          # tail T [4:12]
    p = t.find(c[:4])
    (tail,) = t.evict(1)
    assert (tail.start_pos, tail.end_pos) == (4, 12)
    assert TLRUStrategy.history_len(p) == 12
    t.insert(c[:8])                      # only the tail's first page comes back: T' [4:8]
    (tail2,) = t.evict(1)
    assert (tail2.start_pos, tail2.end_pos) == (4, 8)
    assert TLRUStrategy.history_len(p) == 12
    assert p.policy_data[TLRU_HISTORY] == 12
    # budget 12 + 0 - 8 = 4 > 0 cached tokens without P: P is protected (not TEL-safe)
    assert s.key(p)[0] == 0
    # ... so a newer leaf of a short conversation (TEL-safe) goes before the older P
    t.insert(conv(2, 1))
    assert [n.key[0] for n in t.evict(2)] == [2000, 1000]


def test_tlru_trims_each_conversation_by_threshold_then_falls_back_to_lru():
    s = make_eviction_strategy("tlru", {"threshold": 8, "next_prompt_estimate": 0})
    t = FakeTree(s)
    for tag in (1, 2):                   # conversation 1 is the older; each is a chain of 4 pages
        c = conv(tag, 4)
        for k in range(1, 5):
            t.insert(c[: k * PAGE])
    got = [(n.key[0] // 1000, n.start_pos) for n in t.evict(8)]
    # first the TEL-safe 8 tokens of each (older conversation first), then plain LRU
    assert got == [(1, 12), (1, 8), (2, 12), (2, 8), (1, 4), (1, 0), (2, 4), (2, 0)]
    lru = FakeTree(make_eviction_strategy("lru", {}))
    for tag in (1, 2):
        c = conv(tag, 4)
        for k in range(1, 5):
            lru.insert(c[: k * PAGE])
    assert [(n.key[0] // 1000, n.start_pos) for n in lru.evict(8)][:4] == [(1, 12), (1, 8), (1, 4), (1, 0)]


def test_tlru_next_prompt_estimate_protects_more():
    s = make_eviction_strategy("tlru", {"threshold": 8, "next_prompt_estimate": 4})
    t = FakeTree(s)
    c = conv(1, 4)
    for k in range(1, 5):
        t.insert(c[: k * PAGE])
    leaf = t.find(c)
    # budget 16 + 4 - 8 = 12: the last page (start 12) is safe; after it goes, [8:12] is not
    assert s.key(leaf)[0] == -1
    t.evict(1)
    assert s.key(t.find(c[:12]))[0] == 0
    assert TLRUStrategy.history_len(t.find(c[:12])) == 16


def test_tlru_history_survives_a_split_above_it():
    s = make_eviction_strategy("tlru", {"threshold": 4})
    t = FakeTree(s)
    c = conv(1, 4)
    t.insert(c[:8])
    t.insert(c)                              # [0:8] -> [8:16]
    t.evict(1)                               # [0:8] remembers 16
    t.insert(c[:4] + conv(3, 1))             # splits [0:8] into [0:4] + [4:8]
    lower = t.find(c[:8])
    assert (lower.start_pos, TLRUStrategy.history_len(lower)) == (4, 16)
    t.evict(10)
    assert TLRUStrategy.history_len(t.root) == 16


def test_lru_through_tree_refreshes_the_matched_path():
    t = FakeTree(make_eviction_strategy("lru", {}))
    a, b = conv(1, 2), conv(2, 2)
    t.insert(a)
    t.insert(b)
    t.insert(a)                             # a is touched again: b is now the least recent
    assert [n.key[0] for n in t.evict(2)] == [2000, 1000]


def test_lfu_through_tree_counts_reuse():
    t = FakeTree(make_eviction_strategy("lfu", {}))
    a, b = conv(1, 1), conv(2, 1)
    t.insert(a)
    t.insert(a)
    t.insert(b)
    t.insert(b)
    t.insert(b)                              # b reused twice, a once
    t.insert(a)                              # a reused twice too, and more recently: b goes first
    assert [n.key[0] for n in t.evict(2)] == [2000, 1000]


# -- factory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(EVICTION_POLICIES) + ["fifo", "mru", "filo"])
def test_factory_knows_every_policy(name):
    s = make_eviction_strategy(name, {})
    assert s.name == name
    assert isinstance(s.key(node()), tuple)
    assert make_eviction_strategy(name, None).name == name


def test_factory_config_values():
    assert make_eviction_strategy("slru", {"protected_threshold": 4}).protected_threshold == 4
    s = make_eviction_strategy("tlru", {"threshold": 1.5, "next_prompt_estimate": 200})
    assert (s.threshold, s.next_prompt_estimate) == (1.5, 200)


@pytest.mark.parametrize("name,config,match", [
    ("lru2", {}, "unknown eviction policy 'lru2'"),
    ("", {}, "unknown eviction policy"),
    ("lru", {"protected_threshold": 2}, "unknown config key 'protected_threshold'"),
    ("slru", {"threshold": 2}, "unknown config key 'threshold'"),
    ("tlru", {"protected_threshold": 2}, "unknown config key 'protected_threshold'"),
    ("slru", {"protected_threshold": True}, "protected_threshold must be an integer"),
    ("slru", {"protected_threshold": 2.0}, "protected_threshold must be an integer"),
    ("slru", {"protected_threshold": -1}, "protected_threshold must be an integer >= 0"),
    ("tlru", {"threshold": "8"}, "threshold must be a finite number"),
    ("tlru", {"next_prompt_estimate": False}, "next_prompt_estimate must be a finite number"),
    ("tlru", {"threshold": math.nan}, "threshold must be a finite number"),
    ("lfu", [], "must be a JSON object"),
])
def test_factory_refuses(name, config, match):
    with pytest.raises(ValueError, match=match):
        make_eviction_strategy(name, config)
