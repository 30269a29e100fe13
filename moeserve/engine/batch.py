"""Turning a scheduled step into device tensors: token ids, positions and the attention CSR metadata.

All integer metadata of a step is packed into one int32 host buffer (pinned on GPU machines) and moved
to the device with a single copy; the host views stay available for FlashInfer's ``plan()``. Each step
gets a fresh pinned buffer from torch's caching host allocator, which does not hand a buffer out again
before its copy has run, so a step can be built while the previous one is still on the GPU.

With ``SIDE_COPY`` (off by default) that copy runs on a stream of its own, into one of two device buffers taken in
turn: a step is built while the one before it runs, so its copy is done by the time the GPU gets to it, and the
step's stream waits for the copy's event instead of for a copy queued behind the previous step (on an H200 that
copy started 5.6 µs after the work before it and took 1.4 µs, between two decode steps). A buffer is written again
two builds later, after an event recorded on the step's stream at the build between, by when every use of it is
queued (a step's tensors are used by the work queued before the next build). Fixed layouts (the prefill graphs
read their fields at fixed addresses) keep one buffer of their own, copied on the step's stream.

A token sampled by the previous step but not yet on the host (asynchronous scheduling) is fed from that
step's device tensor of sampled tokens: the builder writes 0 in its place and a device gather fills it (or, with
``defer_feed``, the decode graph's replay, which copies the ids into its buffers in the same launch).

A step padded to ``pad_to`` tokens gets one extra request of one token per padding token, at position 0 on
the reserved page 0 (a CUDA graph of that size then reads real rows first, padding after). With ``fixed``
every field starts at an offset that depends only on ``pad_to``, so the device views of two steps of one
padded size are the same memory (what the CUDA graphs of prefill steps read).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeserve.engine.step import ScheduledRequest
from moeserve.ops.attention import AttentionInputs

# the host-to-device copy of a step that is not of a fixed layout runs on a stream of its own, into two buffers taken
# in turn (False: on the step's stream, into the one buffer: an A/B switch, read when a builder is made; off until an
# A/B on a GPU has measured it)
SIDE_COPY = False


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [S] int32: the last token of each request that samples this step
    num_real: int  # requests before padding
    num_tokens_real: int
    # with build(..., defer_feed=True): the rows still to take the previous step's sampled tokens, left to the
    # caller (rows dst take prev[src]; dst, src int32 [F], prev the previous step's tokens); None: none
    feed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class BatchBuilder:
    def __init__(self, page_size: int, max_tokens: int, max_seqs: int, max_pages: int, device: torch.device):
        """``max_pages``: the most page entries a step lists, its requests' pages summed (pages shared through the
        prefix cache count once per request)."""
        self.page_size = page_size
        self.device = device
        self.max_tokens = max_tokens
        # a fixed layout of T tokens takes 10 T + 2 entries before the page indices (at most max_pages, plus one
        # page-0 entry per padding row)
        cap = 11 * max_tokens + 6 * (max_seqs + 1) + max_pages + 64
        self.pin = device.type == "cuda"
        self.dev = torch.zeros(cap, dtype=torch.int32, device=device) if self.pin else None
        # SIDE_COPY: the copy stream and its two buffers (made at first use), the one the next build takes, and for
        # each buffer the event after which it may be written again (on the step's stream) and the event after its
        # last copy (on the copy stream)
        self._cap = cap
        self.side_copy = SIDE_COPY and self.pin
        self._copy_stream = None
        self._side: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._free: list[torch.cuda.Event] = []
        self._copied: list[torch.cuda.Event] = []

    def build(self, items: list[ScheduledRequest], pad_to: int | None = None,
              prev_tokens: torch.Tensor | None = None, fixed: bool = False, defer_feed: bool = False) -> StepBatch:
        """``prev_tokens``: the previous step's sampled tokens on the device, for in-flight inputs. ``pad_to``:
        the step's token count after padding; ``fixed``: lay the fields out at the offsets of that size.
        ``defer_feed``: leave the in-flight inputs to the caller (``StepBatch.feed``; a decode graph's replay feeds
        them as it copies the ids in, ``moeserve.ops.inputs_triton``)."""
        if fixed and (pad_to is None or pad_to > self.max_tokens):
            raise ValueError(f"a fixed layout needs pad_to of at most {self.max_tokens} tokens, got {pad_to}")
        if all(it.num_tokens == 1 for it in items):
            fields = self._single_token_fields(items)
        else:
            fields = self._chunk_fields(items)
        return self._finish(items, fields, pad_to, prev_tokens, fixed, defer_feed)

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

    def _copy_aside(self, host: torch.Tensor, n: int) -> torch.Tensor:
        """``host`` into the next of the two side buffers, on the copy stream; the current stream waits for it."""
        step_stream = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._free = [torch.cuda.Event(), torch.cuda.Event()]
            for e in self._free:  # before any build: free once the work queued so far is done
                e.record(step_stream)
            self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        k, self._turn = self._turn, self._turn ^ 1
        # the other buffer was written by the build before this one, whose uses are all queued by now (a stream's
        # wait takes an event as it was when the wait was queued, so each event is recorded again and again)
        freed = self._free[k ^ 1]
        freed.record(step_stream)
        after = self._free[k]
        buf = self._side[k]
        if buf is None or buf.numel() < n:  # new memory: its last uses on the step's stream are queued by now too
            buf = self._side[k] = torch.empty(max(self._cap, 2 * n), dtype=torch.int32, device=self.device)
            buf.record_stream(self._copy_stream)
            after = freed
        dev = buf[:n]
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(after)
            dev.copy_(host, non_blocking=True)
            self._copied[k].record(self._copy_stream)
        step_stream.wait_event(self._copied[k])
        return dev

    def _finish(self, items, fields, pad_to, prev_tokens, fixed=False, defer_feed=False) -> StepBatch:
        ids, pos, slots, bidx, qo, kvp, last, indices, logit_idx, fix_dst, fix_src = fields
        num_real, seq_lens = len(items), [it.start + it.num_tokens for it in items]
        query_lens = [it.num_tokens for it in items]
        t_real = len(ids)
        if fixed and pad_to < t_real:
            raise ValueError(f"a step of {t_real} tokens does not fit a fixed layout of {pad_to}")
        if pad_to is not None and pad_to > t_real:
            extra = pad_to - t_real
            s = len(qo) - 1
            zeros = [0] * extra
            ids, pos, slots = ids + zeros, pos + zeros, slots + zeros
            bidx = bidx + list(range(s, s + extra))
            indices = indices + zeros  # every padding row reads and writes the reserved page 0
            qo = qo + [qo[-1] + i + 1 for i in range(extra)]
            kvp = kvp + [kvp[-1] + i + 1 for i in range(extra)]
            last = last + [1] * extra
            seq_lens += [1] * extra
            query_lens += [1] * extra
        # the page indices last: in a fixed layout the only field whose length has no bound but the pool's
        fields = [ids, pos, slots, bidx, qo, kvp, last, logit_idx, fix_dst, fix_src, indices]
        sizes = [len(f) for f in fields]
        if fixed:
            t = pad_to
            caps = [t, t, t, t, t + 1, t + 1, t, t, t, t]
            offs = np.concatenate([[0], np.cumsum(caps)])
            n_all = int(offs[-1]) + sizes[-1]
            host = torch.empty(n_all, dtype=torch.int32, pin_memory=self.pin)
            flat = host.numpy()
            for f, o in zip(fields, offs):
                flat[o:o + len(f)] = f
        else:
            flat = np.fromiter((v for f in fields for v in f), dtype=np.int32, count=sum(sizes))
            n_all = len(flat)
            host = torch.empty(n_all, dtype=torch.int32, pin_memory=self.pin)
            host.numpy()[:] = flat
            offs = np.concatenate([[0], np.cumsum(sizes)])
        if self.dev is None:
            dev = host.clone()
        elif self.side_copy and not fixed and not torch.cuda.is_current_stream_capturing():
            dev = self._copy_aside(host, n_all)
        else:
            if n_all > self.dev.numel():  # more page entries than sized for: a new, larger buffer
                self.dev = torch.zeros(2 * n_all, dtype=torch.int32, device=self.device)
            dev = self.dev[:n_all]
            dev.copy_(host, non_blocking=True)
        h = [host[offs[i]:offs[i] + sizes[i]] for i in range(len(fields))]
        d = [dev[offs[i]:offs[i] + sizes[i]] for i in range(len(fields))]
        feed = None
        if fix_dst:
            if prev_tokens is None:
                raise RuntimeError("a step feeds in-flight tokens but the previous step's tokens were not given")
            if defer_feed:
                feed = (d[8], d[9], prev_tokens)
            else:
                d[0].index_copy_(0, d[8].long(), prev_tokens.index_select(0, d[9].long()).to(torch.int32))
        attn = AttentionInputs(
            num_seqs=len(qo) - 1, num_tokens=sizes[0], query_lens=query_lens, seq_lens=seq_lens,
            is_decode=all(it.is_decode for it in items),
            qo_indptr_host=h[4], kv_indptr_host=h[5], kv_indices_host=h[10], kv_last_page_len_host=h[6],
            qo_indptr=d[4], kv_indptr=d[5], kv_indices=d[10], kv_last_page_len=d[6],
            slot_mapping=d[2], batch_indices=d[3], token_positions=d[1],
        )
        return StepBatch(input_ids=d[0], positions=d[1], attn=attn, logits_indices=d[7], num_real=num_real,
                         num_tokens_real=sum(it.num_tokens for it in items), feed=feed)
