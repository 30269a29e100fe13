"""L2 weight prefetch for small decode steps.

A one-token decode step reads every weight it uses once, but not at the copy bandwidth: between the large
GEMMs sit chains of small, latency-bound kernels (the norms, the QKV kernel, attention, routing, the combine)
during which the memory system is mostly idle, and a GEMM of a few rows itself runs below the bandwidth. Weights
whose address is known before they are needed can be fetched into L2 (50 MB on an H200) during those gaps, on a
second stream, so that the GEMM which reads them later finds them there.

``L2Prefetch`` holds that stream and what to fetch where (``targets``, the config's ``l2_prefetch``):

- ``o_proj``, ``shared_down``, ``shared_gate_up``: at the start of a layer, the attention's output projection and
  the shared expert's down or gate/up projection of the same layer, which are read later in it;
- ``expert_down``: once the router has chosen, the down projections of the chosen experts (read after their
  gate/up GEMM);
- ``next_qkv``: once the router has chosen, the next layer's QKV projection.

Steps of up to ``max_tokens`` tokens prefetch. With ``evict_last`` the prefetched lines are kept in L2 ahead of
the lines the kernels stream through meanwhile. A prefetch is a hint: it reads nothing into the SMs and writes
nothing, so a step computes exactly the same with or without it; the prefetch stream is joined at the end of
each layer (before the CUDA graph of a step ends). Compute capability 9.0 or later (``cp.async.bulk.prefetch``).
"""
from __future__ import annotations

import torch

TARGETS = ("o_proj", "shared_down", "shared_gate_up", "expert_down", "next_qkv")
LAYER_START = ("o_proj", "shared_down", "shared_gate_up")  # issued at a layer's start; the others after routing


class L2Prefetch:
    def __init__(self, device: torch.device, targets, max_tokens: int, evict_last: bool = True,
                 method: str = "bulk"):
        bad = [t for t in targets if t not in TARGETS]
        if bad:
            raise ValueError(f"l2_prefetch: unknown target {bad[0]!r} (one of {', '.join(TARGETS)})")
        self.targets = frozenset(targets)
        self.max_tokens = max_tokens
        self.evict_last, self.method = evict_last, method
        self.sink = torch.empty(1, dtype=torch.int32, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._forked = False

    def takes(self, tokens: int, target: str) -> bool:
        return 0 < tokens <= self.max_tokens and target in self.targets

    def weights(self, tensors) -> None:
        """Prefetch each tensor of ``tensors`` (contiguous, on the GPU) whole, on the prefetch stream, after
        what the current stream has launched so far."""
        for t in tensors:
            self._launch(t, None)

    def rows(self, weight: torch.Tensor, ids: torch.Tensor) -> None:
        """Prefetch ``weight[i]`` for each ``i`` in ``ids`` (int, any shape; ids outside ``weight``'s rows are
        skipped), on the prefetch stream, once ``ids`` is written."""
        self._launch(weight, ids)

    def join(self) -> None:
        """Make the current stream wait for the prefetches launched so far (each layer's end)."""
        if self._forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._forked = False

    def _launch(self, w: torch.Tensor, ids: torch.Tensor | None) -> None:
        if w.numel() == 0 or ids is not None and ids.numel() == 0:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        self._forked = True
        with torch.cuda.stream(self.stream):
            launch_prefetch(w, ids, self.evict_last, self.method, self.sink)


def launch_prefetch(w: torch.Tensor, ids: torch.Tensor | None, evict_last: bool, method: str = "bulk",
                    sink: torch.Tensor | None = None) -> None:
    """On the current stream: the kernel that prefetches ``w`` whole (``ids`` None) or its rows ``w[ids]``
    (``method``: see ``moeserve.ops.l2_prefetch_triton``; ``sink`` one scratch int32 for ``loads``)."""
    from moeserve.ops.l2_prefetch_triton import BLOCK, LANES, LOAD_WORDS, l2_prefetch_kernel
    if not w.is_contiguous() or w.data_ptr() % 16:
        raise ValueError("l2 prefetch: a weight must be contiguous and 16-byte aligned")
    if ids is None:
        ids_arg, n_ids, rows, stride = w, 1, 1, 0
        n_bytes = w.numel() * w.element_size()
    else:
        ids_arg = ids.reshape(-1) if ids.dtype == torch.int32 else ids.reshape(-1).to(torch.int32)
        n_ids, rows = ids_arg.numel(), w.shape[0]
        stride = n_bytes = w.stride(0) * w.element_size()
        if stride % 16:
            raise ValueError("l2 prefetch: the rows of a weight prefetched by id must be a multiple of 16 bytes")
    if sink is None:
        sink = torch.empty(1, dtype=torch.int32, device=w.device)
    block = BLOCK[method]
    grid = (-(-n_bytes // block), n_ids)
    l2_prefetch_kernel[grid](w, ids_arg, sink, n_ids, n_bytes, stride, rows, BY_ID=ids is not None,
                             EVICT_LAST=evict_last, METHOD=method, BLOCK=block, LANES=LANES,
                             LOAD_WORDS=min(LOAD_WORDS, block // 4), num_warps=1 if method == "bulk" else 4)
