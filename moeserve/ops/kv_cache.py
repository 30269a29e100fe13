"""The paged KV cache tensor every attention backend reads and writes.

Layout per layer is FlashInfer's NHD paged format ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
(the same one vLLM's FlashInfer backend uses), so every attention backend reads the same memory.
Page 0 is reserved: padded rows of a CUDA-graph batch point at it, so it never holds a request's data.
Which request owns which page is the engine's business (``moeserve.engine.kv_cache``).
"""
from __future__ import annotations

import torch


class KVCache:
    """One tensor for all layers: ``[layers, pages, 2, page_size, kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.data = torch.zeros(num_layers, num_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)

    def layer(self, i: int) -> torch.Tensor:
        return self.data[i]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
