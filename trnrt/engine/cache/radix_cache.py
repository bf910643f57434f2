"""RadixCache: the prefix cache of paged state plus recurrent-state checkpoints. Pure Python.

GLM-5.3-Flash's paged state (MLA latents, pooled indexer keys) can be shared page by page, but its
per-sequence state (KDA recurrent state, conv window, indexer open-pool tail) is only right at the
exact position where it was taken. So a cached prefix is usable only up to a node whose end carries
a **state checkpoint**: `match()` returns the deepest such node along the request's tokens, and the
request resumes there (its pages are shared, the checkpoint is copied into its slot, the rest is
prefilled). Checkpoints are taken at multiples of the checkpoint interval (the scheduler cuts
prefill chunks there), so every node boundary the tree creates at insert is such a position.

Tree (SGLang's radix tree at page granularity): every edge holds a whole number of pages; children
are keyed by their first page's token ids. A node's data lives on the device (`device_pages`,
`checkpoint`) and, with the hierarchical cache, also in host memory (`host_pages`,
`host_checkpoint`). Device residency is prefix-closed; eviction takes device leaves first, by the
eviction strategy's key (trnrt.engine.cache.eviction_policy), and with a host tier keeps a host copy.

Resources are not owned here: device pages are reference-counted by the CacheManager (the tree
holds one reference per page of a device-resident node), checkpoint ids and host ids come from
IdPools. Copies between tiers are data the runner executes (`CacheOp`s, collected by `take_ops`).

Locks: a running sequence that resumed through (or inserted at) a node holds a lock on it, which
counts on every node from there to the root (`lock_ref`); locked nodes are never evicted.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, Iterable, Sequence as Seq

from trnrt.engine.cache.cache_manager import CacheManager, IdPool
from trnrt.engine.cache.eviction_policy import LRUStrategy
from trnrt.engine.output.outputs import CacheOp
from trnrt.engine.cache.radix_node import PrefixMatch, TreeNode
from trnrt.engine.cache.host_tier import HostTier

__all__ = ["PrefixMatch", "RadixCache"]


class RadixCache(HostTier):
    """The radix prefix cache (see the module docstring); its host tier's methods are in
    cache/host_tier.py.

    Args:
        pages: the CacheManager whose pages the tree references.
        checkpoints: device checkpoint ids.
        host_pages / host_checkpoints: the host tier's ids (None: no host tier).
        strategy: eviction strategy (key/on_access/on_insert/on_evict); None: LRU.
        write_policy: "write_through" (copy new nodes to host at insert) or "write_back" (copy
            when evicted from the device).
        clock: time source for access times.
    """

    def __init__(self, pages: CacheManager, checkpoints: IdPool, *, host_pages: IdPool | None = None,
                 host_checkpoints: IdPool | None = None, strategy=None, write_policy: str = "write_through",
                 clock: Callable[[], float] = time.monotonic):
        self.pages = pages
        self.page_size = pages.block_size
        self.checkpoints = checkpoints
        self.host_pages = host_pages
        self.host_checkpoints = host_checkpoints
        self.strategy = strategy if strategy is not None else LRUStrategy()
        self.write_policy = write_policy
        self.clock = clock
        # one tree per namespace (SGLang's extra_key / cache_salt): requests of different namespaces
        # never share a prefix. None is the default namespace; others are created on first insert
        # and dropped when they empty.
        self._roots: dict[str | None, TreeNode] = {None: TreeNode(device_pages=[])}
        self._ops: list[CacheOp] = []
        # device pages of unlocked nodes (what eviction can free), kept up to date on every change
        # so that the per-step load gauges need no walk of the tree
        self._evictable = 0
        self._device_pages = 0  # device pages held by the tree (the load gauge reads it every step)
        # counters (cumulative)
        self.num_evicted_pages = 0
        self.num_host_loaded_pages = 0
        self.num_host_written_pages = 0

    @property
    def root(self) -> TreeNode:
        """The default namespace's root."""
        return self._roots[None]

    def _root(self, namespace: str | None, create: bool = False) -> TreeNode | None:
        r = self._roots.get(namespace)
        if r is None and create:
            r = self._roots[namespace] = TreeNode(device_pages=[])
        return r

    @property
    def has_host_tier(self) -> bool:
        return self.host_pages is not None and self.host_checkpoints is not None

    # -- ops -----------------------------------------------------------------------------------

    def take_ops(self) -> list[CacheOp]:
        """The tier copies queued since the last call, in order (the runner runs them before the
        step in which the scheduler took them)."""
        ops, self._ops = self._ops, []
        return ops

    # -- lookup --------------------------------------------------------------------------------

    def _page_keys(self, token_ids: Seq[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        n = len(token_ids) // ps
        return [tuple(token_ids[i * ps:(i + 1) * ps]) for i in range(n)]

    def _walk(self, token_ids: Seq[int], namespace: str | None = None
              ) -> tuple[list[TreeNode], TreeNode | None, int]:
        """Follow whole nodes along `token_ids`. Returns (the fully matched nodes, the node where
        the match stopped part-way or None, pages matched into that node)."""
        keys = self._page_keys(token_ids)
        path: list[TreeNode] = []
        node, i = self._root(namespace), 0
        if node is None:
            return path, None, 0
        ps = self.page_size
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                return path, None, 0
            n_pages = child.num_tokens // ps
            k = 0
            while k < n_pages and i + k < len(keys) and child.key[k * ps:(k + 1) * ps] == keys[i + k]:
                k += 1
            if k < n_pages:
                return path, child, k
            path.append(child)
            node = child
            i += n_pages
        return path, None, 0

    def match(self, token_ids: Seq[int], *, touch: bool = True, namespace: str | None = None) -> PrefixMatch:
        """The longest cached prefix of `token_ids` that ends at a checkpoint.

        The caller passes at most the tokens it may skip (a prompt must compute at least its last
        token, so `prompt[:-1]`). With `touch`, access times along the usable path are refreshed
        and the strategy told (SGLang refreshes on match).
        """
        path, _, _ = self._walk(token_ids, namespace)
        best = -1
        for i, node in enumerate(path):
            if node.has_checkpoint:
                best = i
        if best < 0:
            return PrefixMatch(self._root(namespace) or self.root, [])
        path = path[:best + 1]
        if touch:
            now = self.clock()
            for node in path:
                node.last_access_time = now
                self.strategy.on_access(node, now)
        return PrefixMatch(path[-1], path)

    def has_checkpoint_at(self, token_ids: Seq[int], namespace: str | None = None) -> bool:
        """Whether a node ends exactly at len(token_ids) with a checkpoint (no snapshot needed)."""
        path, partial, _ = self._walk(token_ids, namespace)
        return (partial is None and bool(path) and path[-1].end_pos == len(token_ids)
                and path[-1].has_checkpoint)

    def record_hit(self, m: PrefixMatch) -> None:
        """A request was admitted through `m`: count the reuse on its path (LFU/SLRU keys)."""
        for node in m.path:
            node.hit_count += 1

    # -- locks ---------------------------------------------------------------------------------

    def lock(self, node: TreeNode | None) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0 and node.device_pages:
                self._evictable -= len(node.device_pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise AssertionError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device_pages:
                self._evictable += len(node.device_pages)
            node = node.parent

    def _set_device_pages(self, node: TreeNode, pages: list[int] | None) -> None:
        """Every change of a node's device pages goes through here (the evictable count)."""
        delta = len(pages or ()) - len(node.device_pages or ())
        self._device_pages += delta
        if node.lock_ref == 0:
            self._evictable += delta
        node.device_pages = pages

    # -- insert --------------------------------------------------------------------------------

    def _split(self, child: TreeNode, k_pages: int) -> TreeNode:
        """Split `child` after its first k_pages pages; returns the new upper node."""
        ps = self.page_size
        cut = k_pages * ps
        upper = TreeNode(
            key=child.key[:cut], parent=child.parent, start_pos=child.start_pos,
            device_pages=None if child.device_pages is None else child.device_pages[:k_pages],
            host_pages=None if child.host_pages is None else child.host_pages[:k_pages],
            lock_ref=child.lock_ref, creation_time=child.creation_time,
            last_access_time=child.last_access_time, hit_count=child.hit_count, priority=child.priority,
            policy_data=dict(child.policy_data),
        )
        assert child.parent is not None
        child.parent.children[child.key[:ps]] = upper
        child.key = child.key[cut:]
        child.start_pos += cut
        if child.device_pages is not None:
            child.device_pages = child.device_pages[k_pages:]
        if child.host_pages is not None:
            child.host_pages = child.host_pages[k_pages:]
        child.parent = upper
        upper.children[child.key[:ps]] = child
        self.strategy.on_insert(upper)
        return upper

    def insert(self, token_ids: Seq[int], page_ids: Seq[int], checkpoint: int | None, *,
               priority: int = 0, namespace: str | None = None) -> tuple[TreeNode, bool]:
        """Cache `token_ids` (a whole number of pages, ending at a checkpoint position) held in
        `page_ids` (a sequence's block table, at least len(token_ids)/page_size pages), with
        `checkpoint` (a device checkpoint id of the state at len(token_ids)) at its end.

        Nodes the tree lacks are created and take a reference on the sequence's pages; parts
        already cached keep the tree's own pages (the sequence's duplicates stay its own). A
        node evicted from the device takes the sequence's pages back. Returns (the node ending at
        len(token_ids), whether `checkpoint` was adopted: if False the caller frees it, because the
        node already had one).
        """
        ps = self.page_size
        n_pages = len(token_ids) // ps
        if n_pages * ps != len(token_ids) or n_pages == 0 or len(page_ids) < n_pages:
            raise ValueError(f"insert of {len(token_ids)} tokens with {len(page_ids)} pages (page size {ps})")
        now = self.clock()
        keys = self._page_keys(token_ids)
        node, i = self._root(namespace, create=True), 0
        while i < n_pages:
            child = node.children.get(keys[i])
            if child is None:
                new = TreeNode(
                    key=tuple(token_ids[i * ps:]), parent=node, start_pos=i * ps,
                    creation_time=now, last_access_time=now, priority=priority,
                )
                self._set_device_pages(new, list(page_ids[i:n_pages]))
                self.pages.retain(new.device_pages)
                node.children[keys[i]] = new
                self.strategy.on_insert(new)
                self.strategy.on_access(new, now)
                if self.write_policy == "write_through":
                    self._write_host(new)
                node = new
                i = n_pages
                break
            cn = child.num_tokens // ps
            k = 0
            while k < cn and i + k < n_pages and child.key[k * ps:(k + 1) * ps] == keys[i + k]:
                k += 1
            if k < cn:
                child = self._split(child, k)
                cn = k
            if child.device_pages is None:  # evicted from the device: take the sequence's pages
                self._set_device_pages(child, list(page_ids[i:i + cn]))
                self.pages.retain(child.device_pages)
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            self.strategy.on_access(child, now)
            node = child
            i += cn
        adopted = False
        if checkpoint is not None and node.checkpoint is None:
            node.checkpoint = checkpoint
            adopted = True
            if self.write_policy == "write_through" and node.host_pages is not None and node.host_checkpoint is None:
                self._write_host_checkpoint(node)
        return node, adopted

    # -- eviction --------------------------------------------------------------------------------

    def _nodes(self) -> Iterable[TreeNode]:
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _is_device_leaf(self, n: TreeNode) -> bool:
        return n.on_device and n.lock_ref == 0 and not any(c.on_device for c in n.children.values())

    def evictable_pages(self) -> int:
        """Device pages of unlocked nodes: what eviction can free now. (A running sequence locks
        its whole path, so these pages are held by the tree alone.) O(1)."""
        return self._evictable

    def evict(self, num_pages: int = 0, *, num_checkpoints: int = 0) -> int:
        """Evict device leaves (strategy order) until `num_pages` pages are free in the
        CacheManager and `num_checkpoints` checkpoint ids are free, or nothing is evictable.
        Returns the pages freed."""
        freed = 0
        heap = [(self.strategy.key(n), n.id, n) for n in self._nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        while heap and (self.pages.num_free_blocks < num_pages or self.checkpoints.num_free < num_checkpoints):
            _, _, node = heapq.heappop(heap)
            if not self._is_device_leaf(node):
                continue
            parent = node.parent
            freed += self._evict_device(node)
            if parent is not None and not parent.is_root and self._is_device_leaf(parent):
                heapq.heappush(heap, (self.strategy.key(parent), parent.id, parent))
        return freed

    def _evict_device(self, node: TreeNode) -> int:
        self.strategy.on_evict(node)
        if self.has_host_tier and node.host_pages is None:
            self._write_host(node)  # write_back (or a write-through copy that did not fit then)
        if self.has_host_tier and node.host_pages is not None and node.checkpoint is not None \
                and node.host_checkpoint is None:
            self._write_host_checkpoint(node)
        pages = node.device_pages or []
        freed = self.pages.release(pages)
        self.num_evicted_pages += len(pages)
        self._set_device_pages(node, None)
        if node.checkpoint is not None:
            self.checkpoints.free([node.checkpoint])
            node.checkpoint = None
        if node.host_pages is None:
            self._delete_subtree(node)
        return freed

    def _delete_subtree(self, node: TreeNode) -> None:
        """Remove `node` and everything below it (their data can no longer be reached)."""
        for c in list(node.children.values()):
            self._delete_subtree(c)
        if node.device_pages is not None:
            self.pages.release(node.device_pages)
            self._set_device_pages(node, None)
        if node.checkpoint is not None:
            self.checkpoints.free([node.checkpoint])
            node.checkpoint = None
        self._drop_host_copy(node)
        parent = node.parent
        if parent is not None:
            parent.children.pop(node.key[:self.page_size], None)
            node.parent = None
            if parent.is_root and not parent.children:  # an emptied namespace goes
                for ns, r in list(self._roots.items()):
                    if r is parent and ns is not None:
                        del self._roots[ns]

    # -- whole-cache operations ------------------------------------------------------------------

    def reset(self) -> None:
        """Drop everything (an idle flush): every reference and id goes back."""
        for r in list(self._roots.values()):
            for c in list(r.children.values()):
                self._delete_subtree(c)
        self._roots = {None: self.root}
        self._ops.clear()
        assert self._evictable == 0, self._evictable

    def invalidate(self) -> None:
        """A tier copy failed, so some cached data may be wrong: delete every unlocked node, and
        drop the host copies of the locked ones (their device data, in use, is intact)."""
        for node in list(self._nodes()):
            if node.parent is None:
                continue  # removed with an ancestor already
            if node.lock_ref == 0:
                self._delete_subtree(node)
            else:
                self._drop_host_copy(node)
        self._ops.clear()

    def device_page_refs(self) -> list[int]:
        """Every device page reference the tree holds (for CacheManager.check_integrity)."""
        return [b for n in self._nodes() if n.device_pages for b in n.device_pages]

    def num_device_pages(self) -> int:
        """Device pages the tree holds. O(1)."""
        return self._device_pages

    def checkpoint_ids(self) -> list[int]:
        return [n.checkpoint for n in self._nodes() if n.checkpoint is not None]

    def host_page_ids(self) -> list[int]:
        return [b for n in self._nodes() if n.host_pages for b in n.host_pages]

    def host_checkpoint_ids(self) -> list[int]:
        return [n.host_checkpoint for n in self._nodes() if n.host_checkpoint is not None]

    def check_integrity(self) -> None:
        """Structure: keys are whole pages, positions chain, page lists match key lengths,
        device residency is prefix-closed, lock counts are consistent."""
        ps = self.page_size
        walked = sum(len(n.device_pages) for n in self._nodes() if n.device_pages and n.lock_ref == 0)
        assert walked == self._evictable, f"evictable count {self._evictable} != {walked}"
        held = sum(len(n.device_pages) for n in self._nodes() if n.device_pages)
        assert held == self._device_pages, f"device page count {self._device_pages} != {held}"
        for n in self._nodes():
            p = n.parent
            assert p is not None and p.children.get(n.key[:ps]) is n, n
            assert len(n.key) % ps == 0 and n.key, n
            assert n.start_pos == p.end_pos, n
            for pages in (n.device_pages, n.host_pages):
                assert pages is None or len(pages) * ps == len(n.key), n
            assert n.on_device or p.is_root or not n.on_device or p.on_device, n
            if n.on_device and not p.is_root:
                assert p.on_device, f"device residency not prefix-closed at {n!r}"
            assert n.checkpoint is None or n.on_device, n
            assert n.host_checkpoint is None or n.on_host, n
            assert n.on_device or n.on_host, n
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), n
