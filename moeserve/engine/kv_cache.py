"""Page accounting for the paged KV cache (``moeserve.ops.kv_cache.KVCache`` holds the data): which pages
are free. Page 0 is reserved: padded rows of a CUDA-graph batch point at it."""
from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PagePool:
    """Hands out page ids; a request's pages go back when it finishes, is aborted or is preempted."""

    RESERVED = 1  # page 0 is the padding page

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= self.RESERVED:
            raise ValueError(f"the KV cache needs at least {self.RESERVED + 1} pages, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack: recently freed pages are handed out first (warm in cache).
        self._free = list(range(num_pages - 1, self.RESERVED - 1, -1))
        self._used = [False] * num_pages

    @property
    def capacity(self) -> int:
        """Pages a request can ever use."""
        return self.num_pages - self.RESERVED

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self._used[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._used[p] = False
            self._free.append(p)
