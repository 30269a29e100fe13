"""Page accounting for the paged KV cache (``moeserve.ops.kv_cache.KVCache`` holds the data), with prefix
caching: which pages are free, which hold a known run of tokens, and which a new request can reuse.

Every full page of computed tokens gets a chained hash: the parent page's hash, the page's token ids and an
extra key (the request's cache salt) on the first page (vLLM's design). Pages carry a reference count; a
page whose count drops to zero keeps its hash and joins the free queue. Fresh pages come from the head of
that queue (never-used pages first, then the least recently freed), so a cached page is overwritten (and
its hash forgotten) only when it is the oldest free page and a fresh one is needed. A new request takes the
longest run of cached full pages its tokens start with (always leaving at least one token to compute, so
the step has logits) and prefills only the rest. Page 0 is reserved: padded rows of a CUDA-graph batch
point at it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class OutOfPages(RuntimeError):
    pass


def page_hash(parent: bytes | None, token_ids, extra: str | None = None) -> bytes:
    """The chained hash of one full page: stable across processes (sha256, not Python's ``hash``)."""
    h = hashlib.sha256(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(b"\1" + extra.encode())
    return h.digest()


class KVCacheManager:
    """Hands out page ids, counts references, and keeps freed full pages findable by hash until reused."""

    RESERVED = 1  # page 0 is the padding page

    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True):
        if num_pages <= self.RESERVED:
            raise ValueError(f"the KV cache needs at least {self.RESERVED + 1} pages, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self._refs = [0] * num_pages
        self._hash: list[bytes | None] = [None] * num_pages
        self._by_hash: dict[bytes, int] = {}
        # free pages in reuse order: never-used ones first (low ids first), then freed ones oldest first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.RESERVED, num_pages))
        self.queries = 0  # prompt tokens looked up in the cache
        self.hits = 0  # of them, found
        self.evictions = 0  # cached pages overwritten as fresh pages

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Pages a request can ever use."""
        return self.num_pages - self.RESERVED

    @property
    def num_free(self) -> int:
        """Pages no request holds (cached ones included: they are reused when needed)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_cached(self) -> int:
        """Free pages that still hold a findable run of tokens."""
        return sum(1 for p in self._free if self._hash[p] is not None)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    # --- pages ---------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages (a cached one loses its hash)."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            h = self._hash[p]
            if h is not None:
                self._hash[p] = None
                self.evictions += 1
                if self._by_hash.get(h) == p:
                    del self._by_hash[h]
            self._refs[p] = 1
            pages.append(p)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages nobody holds become free, the last page first, so a
        request's tail is reused before its head (other requests are likelier to share the head)."""
        for p in reversed(pages):
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free[p] = None

    def _take(self, p: int) -> None:
        if self._refs[p] == 0:
            del self._free[p]
        self._refs[p] += 1

    # --- prefix caching ------------------------------------------------------------------------
    def match(self, hashes: list[bytes], max_pages: int) -> list[int]:
        """The cached pages of the longest run of ``hashes`` (at most ``max_pages``), not yet taken."""
        if not self.enable_caching:
            return []
        found = []
        for h in hashes[:max_pages]:
            p = self._by_hash.get(h)
            if p is None:
                break
            found.append(p)
        return found

    def free_after_taking(self, pages: list[int]) -> int:
        """Free pages left once ``pages`` (a match) are taken."""
        return len(self._free) - sum(1 for p in pages if self._refs[p] == 0)

    def take(self, pages: list[int]) -> None:
        """Hold the matched cached ``pages`` for a request."""
        for p in pages:
            self._take(p)

    def register(self, pages: list[int], hashes: list[bytes], start: int) -> None:
        """Make full pages ``pages[start:len(hashes)]`` findable under their hashes (a hash already cached
        under another page keeps that page)."""
        if not self.enable_caching:
            return
        for i in range(start, min(len(hashes), len(pages))):
            p, h = pages[i], hashes[i]
            if self._hash[p] is None and h not in self._by_hash:
                self._hash[p] = h
                self._by_hash[h] = p

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit
