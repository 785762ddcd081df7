"""Prefix index: a radix tree over page-aligned token blocks, mapping to device and/or host pages.

Each edge holds whole pages (64 tokens per page). A node's pages live on the device
(``device_pages``), in the host tier (``host_pages``), or both (a prefix reloaded from host keeps its
host copy). Invariants:

* a node without device pages has host pages (otherwise it is removed);
* device eviction goes leaf-first, so below a host-only node every node is host-only;
* a locked node (``lock_ref > 0``, held by a running batch along its whole path) is never evicted.

Eviction device -> host copies the node's pages for every layer the host pool holds on the
``offload`` stream and records an event; the device pages are freed only once that event completed
(:meth:`PrefixIndex.reclaim`). Eviction host -> gone frees host pages of host-only leaves whose
offload copy has completed.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from dsa_kernels.layout import PAGE_SIZE
from hicache.allocator import OutOfPages
from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.runtime.streams import Event, Runtime
from hicache.transfer import PageIds, copy_layer_part

_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    parent: "RadixNode | None" = None
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)
    device_pages: list[int] | None = None
    host_pages: list[int] | None = None
    host_ready: Event | None = None  # offload copy into host_pages; they are valid once it completed
    lock_ref: int = 0
    last_access: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.key) // PAGE_SIZE


@dataclass
class PrefixMatch:
    """Longest cached prefix of a request: a device part, then a host-only part."""

    nodes: list[RadixNode]
    device_pages: list[int]
    host_nodes: list[RadixNode]
    host_pages: list[int]
    host_fences: list[Event]

    @property
    def device_tokens(self) -> int:
        return len(self.device_pages) * PAGE_SIZE

    @property
    def host_tokens(self) -> int:
        return len(self.host_pages) * PAGE_SIZE

    @property
    def last_node(self) -> RadixNode | None:
        return self.nodes[-1] if self.nodes else None


def _blocks(tokens: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The page-aligned part of ``tokens``."""
    return tuple(tokens[: len(tokens) // PAGE_SIZE * PAGE_SIZE])


class PrefixIndex:
    def __init__(self, runtime: Runtime, device_pool: DSADevicePool, host_pool: DSAHostPool | None = None) -> None:
        self.rt, self.device_pool, self.host_pool = runtime, device_pool, host_pool
        self.root = RadixNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._pending_device_free: list[tuple[Event | None, list[int]]] = []

    # match / insert --------------------------------------------------------------------------------
    def _split(self, node: RadixNode, pages: int) -> RadixNode:
        """Cut ``node`` after ``pages`` pages; returns the new upper part (the lower keeps ``node``)."""
        cut = pages * PAGE_SIZE
        upper = RadixNode(node.key[:cut], node.parent, {}, node.device_pages and node.device_pages[:pages],
                          node.host_pages and node.host_pages[:pages], node.host_ready, node.lock_ref, node.last_access)
        upper.children[node.key[cut:cut + PAGE_SIZE]] = node
        node.parent.children[node.key[:PAGE_SIZE]] = upper
        node.key = node.key[cut:]
        node.parent = upper
        node.device_pages = node.device_pages and node.device_pages[pages:]
        node.host_pages = node.host_pages and node.host_pages[pages:]
        return upper

    def _walk(self, key: tuple[int, ...]) -> tuple[list[RadixNode], int]:
        """Nodes fully matching a prefix of ``key`` (splitting a partial match); matched tokens."""
        node, pos, path, now = self.root, 0, [], next(_clock)
        while pos < len(key):
            child = node.children.get(key[pos:pos + PAGE_SIZE])
            if child is None:
                break
            same = 0
            while same < child.num_pages and child.key[same * PAGE_SIZE:(same + 1) * PAGE_SIZE] == key[pos + same * PAGE_SIZE:pos + (same + 1) * PAGE_SIZE]:
                same += 1
            if same < child.num_pages:
                child = self._split(child, same)
            child.last_access = now
            path.append(child)
            pos += len(child.key)
            node = child
        return path, pos

    def match_prefix(self, tokens: list[int] | tuple[int, ...]) -> PrefixMatch:
        """The longest cached page-aligned prefix of ``tokens``."""
        path, _ = self._walk(_blocks(tokens))
        dev = [n for n in path if n.device_pages is not None]
        host = path[len(dev):]
        assert all(n.device_pages is None and n.host_pages is not None for n in host), "device part must come first"
        fences = [n.host_ready for n in host if n.host_ready is not None and not n.host_ready.query()]
        return PrefixMatch(path, [p for n in dev for p in n.device_pages], host,
                           [p for n in host for p in n.host_pages], fences)

    def insert(self, tokens: list[int] | tuple[int, ...], device_pages: list[int]) -> int:
        """Cache ``tokens`` (page-aligned part) stored in ``device_pages``; the tree takes their reference.

        Returns how many leading pages were already on the device: the caller still owns those
        pages of its own and should free them. Host-only nodes on the path adopt the caller's pages.
        """
        key = _blocks(tokens)
        if len(device_pages) != len(key) // PAGE_SIZE:
            raise ValueError(f"device_pages: expected {len(key) // PAGE_SIZE} pages for {len(key)} tokens, got {len(device_pages)}")
        path, pos = self._walk(key)
        already, used = 0, 0
        for node in path:
            mine = device_pages[used:used + node.num_pages]
            if node.device_pages is None:
                node.device_pages = mine  # host-only prefix becomes resident again
            else:
                already += node.num_pages
            used += node.num_pages
        if pos < len(key):
            parent = path[-1] if path else self.root
            leaf = RadixNode(key[pos:], parent, device_pages=device_pages[used:], last_access=next(_clock))
            parent.children[leaf.key[:PAGE_SIZE]] = leaf
        return already

    # locking ---------------------------------------------------------------------------------------
    def lock(self, node: RadixNode | None) -> None:
        """Protect ``node`` and its ancestors from eviction (a running batch uses them)."""
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError("unlock: expected a locked node, got lock_ref 0 (unbalanced unlock)")
            node.lock_ref -= 1
            node = node.parent

    # eviction --------------------------------------------------------------------------------------
    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _device_leaf(self, node: RadixNode) -> bool:
        return (node.device_pages is not None and node.lock_ref == 0
                and all(c.device_pages is None for c in node.children.values()))

    def _host_copy(self, node: RadixNode, after: Event | None) -> Event:
        """Queue the D2H copy of ``node``'s pages for every layer the host pool holds."""
        stream = self.rt.stream("offload")
        if after is not None:
            stream.wait_event(after)  # hazard: the forward that wrote these pages must finish first
        ids = PageIds(self.device_pool, node.device_pages, self.host_pool, node.host_pages)
        stream.submit(ids.stage, name="stage")  # page ids reach the device once, on this stream
        for layer in self.host_pool.layers:
            for part in ("index", "kv") if self.host_pool.spec.has_indexer(layer) else ("kv",):
                stream.submit(lambda layer=layer, part=part: copy_layer_part(self.device_pool, self.host_pool, ids, layer, part),
                              name=f"d2h-{part}[{layer}]")
        event = self.rt.event()
        event.record(stream)
        return event

    def evict_device(self, num_pages: int, after: Event | None = None) -> int:
        """Move least-recently-used unlocked device leaves to host (or drop them without a host
        tier) until ``num_pages`` device pages are scheduled to be freed; returns that count.
        ``after``: event of the last stream work that wrote or read those pages (default: the compute
        stream's work queued so far)."""
        if after is None:  # hazard: forward work already queued may still read or write these pages
            after = self.rt.event()
            after.record(self.rt.compute_stream())
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            if not self._device_leaf(node):
                continue
            event = after
            if node.host_pages is None:
                if self.host_pool is None or not self._alloc_host(node):
                    if node.children:
                        continue  # host-only descendants need this node's path: keep it
                    self._pending_device_free.append((after, node.device_pages))
                    freed += node.num_pages
                    self._remove(node)
                    self._push_parent(heap, node.parent)
                    continue
                event = self._host_copy(node, after)
                node.host_ready = event
            self._pending_device_free.append((event, node.device_pages))
            freed += node.num_pages
            node.device_pages = None
            self._push_parent(heap, node.parent)
        self.reclaim()
        return freed

    def _push_parent(self, heap: list, parent: RadixNode | None) -> None:
        if parent is not None and parent is not self.root and self._device_leaf(parent):
            heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _alloc_host(self, node: RadixNode) -> bool:
        try:
            node.host_pages = self.host_pool.allocator.alloc(node.num_pages)
        except OutOfPages:
            self.evict_host(node.num_pages - self.host_pool.allocator.available)
            try:
                node.host_pages = self.host_pool.allocator.alloc(node.num_pages)
            except OutOfPages:
                return False
        return True

    def evict_host(self, num_pages: int) -> int:
        """Drop least-recently-used unlocked host-only leaves whose offload copy completed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes()
                if not n.children and n.device_pages is None and n.lock_ref == 0
                and (n.host_ready is None or n.host_ready.query())]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            self.host_pool.allocator.free(node.host_pages)
            freed += node.num_pages
            parent = node.parent
            self._remove(node)
            if (parent is not self.root and not parent.children and parent.device_pages is None
                    and parent.lock_ref == 0 and (parent.host_ready is None or parent.host_ready.query())):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _remove(self, node: RadixNode) -> None:
        del node.parent.children[node.key[:PAGE_SIZE]]

    def reclaim(self) -> int:
        """Free device pages whose offload copy (or fence) completed; returns pages freed."""
        done = [(e, pages) for e, pages in self._pending_device_free if e is None or e.query()]
        for item in done:
            self._pending_device_free.remove(item)
            self.device_pool.allocator.free(item[1])
        return sum(len(pages) for _, pages in done)

    @property
    def pending_device_free(self) -> int:
        return sum(len(pages) for _, pages in self._pending_device_free)


def load_back(index: PrefixIndex, match: PrefixMatch, loader) -> "object | None":
    """Reload the host-only part of ``match`` into fresh device pages, layer by layer.

    Allocates device pages (evicting LRU device leaves if needed), queues the load behind the
    pages' reuse fences and the host pages' offload copies, and makes the nodes resident at once:
    consumers must wait on the returned load's per-layer events before reading them.
    """
    if not match.host_nodes:
        return None
    need = len(match.host_pages)
    pool = index.device_pool.allocator
    if pool.available < need:
        index.evict_device(need - pool.available)
        index.reclaim()
    pages = pool.alloc(need)
    fences = pool.fences(pages) + match.host_fences
    load = loader.start_loading(match.host_pages, pages, fences)
    used = 0
    for node in match.host_nodes:
        node.device_pages = pages[used:used + node.num_pages]
        used += node.num_pages
    match.device_pages = match.device_pages + pages
    return load
