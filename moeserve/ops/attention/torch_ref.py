"""Reference attention over the paged cache: write the new keys and values, then causal attention per request."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.kv_cache import KVCache
from moeserve.ops.attention import AttentionInputs
from moeserve.ops.interfaces import AttentionBackend


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 device: torch.device, dtype: torch.dtype, **_):
        self.kv = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.inp: AttentionInputs | None = None

    def begin(self, inp: AttentionInputs) -> None:
        self.inp = inp
        self._pages = inp.kv_indices_host.tolist()
        self._kv_indptr = inp.kv_indptr_host.tolist()
        self._qo_indptr = inp.qo_indptr_host.tolist()
        slots = inp.slot_mapping.long()
        self._page_ids = slots // self.kv.page_size
        self._offsets = slots % self.kv.page_size

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
        cache = self.kv.layer(layer)
        cache[self._page_ids, 0, self._offsets] = k.to(cache.dtype)
        cache[self._page_ids, 1, self._offsets] = v.to(cache.dtype)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        inp = self.inp
        for b in range(inp.num_seqs):
            q0, q1 = self._qo_indptr[b], self._qo_indptr[b + 1]
            n_q, n_kv = q1 - q0, inp.seq_lens[b]
            pages = self._pages[self._kv_indptr[b]:self._kv_indptr[b + 1]]
            kv = cache[pages]  # [pages, 2, page_size, Hkv, D]
            keys = kv[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:n_kv].to(q.dtype)
            vals = kv[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:n_kv].to(q.dtype)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                vals = vals.repeat_interleave(group, dim=1)
            # query i sits at position n_kv - n_q + i and sees keys 0..that position
            q_pos = torch.arange(n_kv - n_q, n_kv, device=q.device)[:, None]
            mask = torch.arange(n_kv, device=q.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                               attn_mask=mask, scale=self.scale)
            out[q0:q1] = o.transpose(0, 1)
        return out
