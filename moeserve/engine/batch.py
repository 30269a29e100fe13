"""Turning a scheduled step into device tensors: token ids, positions and the attention CSR metadata.

All integer metadata of a step is packed into one int32 host buffer (pinned on GPU machines) and moved
to the device with a single copy; the host views stay available for FlashInfer's ``plan()``. Each step
gets a fresh pinned buffer from torch's caching host allocator, which does not hand a buffer out again
before its copy has run, so a step can be built while the previous one is still on the GPU.

A token sampled by the previous step but not yet on the host (asynchronous scheduling) is fed from that
step's device tensor of sampled tokens: the builder writes 0 in its place and a device gather fills it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeserve.engine.step import ScheduledRequest
from moeserve.ops.attention import AttentionInputs


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [S] int32: the last token of each request that samples this step
    num_real: int  # requests before padding
    num_tokens_real: int


class BatchBuilder:
    def __init__(self, page_size: int, max_tokens: int, max_seqs: int, max_pages: int, device: torch.device):
        self.page_size = page_size
        self.device = device
        cap = 5 * max_tokens + 6 * (max_seqs + 1) + max_pages + 64
        self.pin = device.type == "cuda"
        self.dev = torch.zeros(cap, dtype=torch.int32, device=device) if self.pin else None

    def build(self, items: list[ScheduledRequest], pad_to: int | None = None,
              prev_tokens: torch.Tensor | None = None) -> StepBatch:
        """``prev_tokens``: the previous step's sampled tokens on the device, for in-flight inputs."""
        if all(it.num_tokens == 1 for it in items):
            fields = self._single_token_fields(items)
        else:
            fields = self._chunk_fields(items)
        return self._finish(items, fields, pad_to, prev_tokens)

    def _single_token_fields(self, items: list[ScheduledRequest]):
        """Decode steps: one token per request, built with plain lists (cheaper than numpy at this size)."""
        ps = self.page_size
        ids, pos, slots, qo, kvp, indices, last, fix_dst, fix_src = [], [], [], [0], [0], [], [], [], []
        for b, it in enumerate(items):
            p = it.start
            ids.append(it.token_ids[0])
            if it.inflight_row >= 0:
                fix_dst.append(b)
                fix_src.append(it.inflight_row)
            pos.append(p)
            npages = p // ps + 1
            pages = it.pages[:npages]
            slots.append(pages[-1] * ps + p % ps)
            qo.append(b + 1)
            kvp.append(kvp[-1] + npages)
            indices.extend(pages)
            last.append(p + 1 - (npages - 1) * ps)
        logit_idx = [b for b, it in enumerate(items) if it.samples]
        return ids, pos, slots, list(range(len(items))), qo, kvp, last, indices, logit_idx, fix_dst, fix_src

    def _chunk_fields(self, items: list[ScheduledRequest]):
        ps = self.page_size
        ids, pos, slots, bidx, qo, kvp, indices, last, logit_idx = [], [], [], [], [0], [0], [], [], []
        fix_dst, fix_src = [], []
        for b, it in enumerate(items):
            start, n = it.start, it.num_tokens
            end = start + n
            p = np.arange(start, end, dtype=np.int64)
            if it.inflight_row >= 0:  # the last token is in flight (only ever one, and only the last)
                fix_dst.append(qo[-1] + n - 1)
                fix_src.append(it.inflight_row)
            ids.append(np.asarray(it.token_ids, dtype=np.int64))
            pos.append(p)
            npages = -(-end // ps)
            pages = np.asarray(it.pages[:npages], dtype=np.int64)
            slots.append(pages[p // ps] * ps + p % ps)
            bidx.append(np.full(n, b, dtype=np.int64))
            qo.append(qo[-1] + n)
            kvp.append(kvp[-1] + npages)
            indices.append(pages)
            last.append(end - (npages - 1) * ps)
            if it.samples:
                logit_idx.append(qo[-1] - 1)
        cat = lambda xs: np.concatenate(xs).tolist() if xs else []  # noqa: E731
        return cat(ids), cat(pos), cat(slots), cat(bidx), qo, kvp, last, cat(indices), logit_idx, fix_dst, fix_src

    def _finish(self, items, fields, pad_to, prev_tokens) -> StepBatch:
        ids, pos, slots, bidx, qo, kvp, last, indices, logit_idx, fix_dst, fix_src = fields
        num_real, seq_lens = len(items), [it.start + it.num_tokens for it in items]
        query_lens = [it.num_tokens for it in items]
        if pad_to is not None and pad_to > num_real:
            extra = pad_to - num_real
            zeros = [0] * extra
            ids, pos, slots = ids + zeros, pos + zeros, slots + zeros
            bidx = bidx + list(range(num_real, pad_to))
            indices = indices + zeros  # every padded row reads and writes the reserved page 0
            qo = qo + [qo[-1] + i + 1 for i in range(extra)]
            kvp = kvp + [kvp[-1] + i + 1 for i in range(extra)]
            last = last + [1] * extra
            seq_lens += [1] * extra
            query_lens += [1] * extra
        fields = [ids, pos, slots, bidx, qo, kvp, last, indices, logit_idx, fix_dst, fix_src]
        sizes = [len(f) for f in fields]
        flat = np.fromiter((v for f in fields for v in f), dtype=np.int32, count=sum(sizes))
        n_all = len(flat)
        host = torch.empty(n_all, dtype=torch.int32, pin_memory=self.pin)
        host.numpy()[:] = flat
        if self.dev is not None:
            dev = self.dev[:n_all]
            dev.copy_(host, non_blocking=True)
        else:
            dev = host.clone()
        offs = np.concatenate([[0], np.cumsum(sizes)])
        h = [host[offs[i]:offs[i + 1]] for i in range(len(fields))]
        d = [dev[offs[i]:offs[i + 1]] for i in range(len(fields))]
        if fix_dst:
            if prev_tokens is None:
                raise RuntimeError("a step feeds in-flight tokens but the previous step's tokens were not given")
            d[0].index_copy_(0, d[9].long(), prev_tokens.index_select(0, d[10].long()).to(torch.int32))
        t = sizes[0]
        attn = AttentionInputs(
            num_seqs=len(qo) - 1, num_tokens=t, query_lens=query_lens, seq_lens=seq_lens,
            is_decode=all(it.is_decode for it in items),
            qo_indptr_host=h[4], kv_indptr_host=h[5], kv_indices_host=h[7], kv_last_page_len_host=h[6],
            qo_indptr=d[4], kv_indptr=d[5], kv_indices=d[7], kv_last_page_len=d[6],
            slot_mapping=d[2], batch_indices=d[3], token_positions=d[1],
        )
        return StepBatch(input_ids=d[0], positions=d[1], attn=attn, logits_indices=d[8], num_real=num_real,
                         num_tokens_real=sum(it.num_tokens for it in items))
