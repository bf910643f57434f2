"""The radix cache's host tier (the hierarchical cache): write a node's pages and checkpoint to
host memory before its device copy is evicted, load host-only nodes back on a hit, and evict
host-only leaves when host ids run out. Copies are CacheOps the runner executes.

A mixin of RadixCache (cache/radix_cache.py); without a host tier (`has_host_tier` False) every
method here is a no-op or is never reached.
"""

from __future__ import annotations

import heapq
from trnrt.engine.cache.radix_node import PrefixMatch, TreeNode
from trnrt.engine.output.outputs import CacheOp


class HostTier:
    def load_to_device(self, m: PrefixMatch) -> int:
        """Bring the host-only nodes of `m` back to the device: new pages (the caller made sure
        `m.num_host_pages` are free), copies queued. Returns the pages loaded."""
        loaded = 0
        for node in m.host_nodes:
            assert node.host_pages is not None
            dev = self.pages.allocate_raw(len(node.host_pages))
            self._ops.append(CacheOp("pages_to_device", tuple(node.host_pages), tuple(dev)))
            self._set_device_pages(node, dev)
            loaded += len(dev)
        self.num_host_loaded_pages += loaded
        return loaded

    def _write_host(self, node: TreeNode) -> bool:
        """Give `node` a host copy of its pages (and checkpoint). False if the host is full."""
        if not self.has_host_tier or node.host_pages is not None or node.device_pages is None:
            return node.host_pages is not None
        n = len(node.device_pages)
        hp = self.host_pages.allocate(n)
        if hp is None:
            self._evict_host(n - self.host_pages.num_free, protect=node)
            hp = self.host_pages.allocate(n)
            if hp is None:
                return False
        node.host_pages = hp
        self._ops.append(CacheOp("pages_to_host", tuple(node.device_pages), tuple(hp)))
        self.num_host_written_pages += n
        if node.checkpoint is not None:
            self._write_host_checkpoint(node)
        return True

    def _write_host_checkpoint(self, node: TreeNode) -> None:
        hc = self.host_checkpoints.allocate(1)
        if hc is None:
            self._evict_host(0, protect=node, checkpoints=1)
            hc = self.host_checkpoints.allocate(1)
        if hc is not None:
            node.host_checkpoint = hc[0]
            self._ops.append(CacheOp("ckpt_to_host", (node.checkpoint,), (hc[0],)))

    def _evict_host(self, num_pages: int, *, protect: TreeNode | None = None, checkpoints: int = 0) -> None:
        """Drop host-only leaves (strategy order) until `num_pages` host pages and `checkpoints`
        host checkpoint ids are free."""
        if not self.has_host_tier:
            return
        protected = set()
        n = protect
        while n is not None:
            protected.add(n.id)
            n = n.parent
        heap = [(self.strategy.key(n), n.id, n) for n in self._nodes()
                if not n.on_device and not n.children and n.lock_ref == 0 and n.id not in protected]
        heapq.heapify(heap)
        while heap and (self.host_pages.num_free < num_pages or self.host_checkpoints.num_free < checkpoints):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._delete_subtree(node)
            if parent is not None and not parent.is_root and not parent.on_device and not parent.children \
                    and parent.lock_ref == 0 and parent.id not in protected:
                heapq.heappush(heap, (self.strategy.key(parent), parent.id, parent))

    def _drop_host_copy(self, node: TreeNode) -> None:
        if node.host_pages is not None:
            self.host_pages.free(node.host_pages)
            node.host_pages = None
        if node.host_checkpoint is not None:
            self.host_checkpoints.free([node.host_checkpoint])
            node.host_checkpoint = None
