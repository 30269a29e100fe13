"""Piecewise CUDA graphs for the steps decode graphs do not cover: prefill chunks and mixed steps.

Such a step is padded up to the next captured token count (one extra one-token request per padding token, on
the reserved page 0). For each count the model forward is captured as ``layers + 1`` graphs cut at the
attention: piece 0 is the embedding and the first layer up to its QKV kernel (norms, rotary embedding, KV
append, q into a fixed buffer); piece ``i`` is layer ``i - 1`` from its output projection on (MoE block
included) and layer ``i`` up to its QKV kernel; the last piece ends with the final norm. Between pieces the
attention runs eagerly on the step's own FlashInfer plan, from the fixed q buffer into a fixed output buffer.
A step then costs ``layers + 1`` graph launches and ``layers`` attention calls on the host instead of ~400
kernel launches (vLLM's piecewise graphs, without torch.compile: the cut is the attention backend's
``split``).

Every graph reads the step's token ids, positions and KV metadata from the batch builder's fixed layout for
its token count, so replays see the same memory the capture saw (checked at each replay). All pieces of all
sizes share one memory pool; pieces replay in the order they were captured, one at a time, on one stream.
"""
from __future__ import annotations

import bisect
import logging

import torch

from moeserve.engine.batch import StepBatch
from moeserve.ops.attention import AttentionSplit

log = logging.getLogger("moeserve")


def _addresses(batch: StepBatch) -> tuple[int, ...]:
    """The device memory a captured step reads its inputs from."""
    a = batch.attn
    return tuple(t.data_ptr() for t in (batch.input_ids, batch.positions, a.batch_indices, a.token_positions,
                                        a.kv_indptr, a.kv_indices))


class PiecewiseGraphs:
    def __init__(self, runner, sizes: list[int]):
        self.runner = runner
        self.sizes = sorted(set(sizes))
        self.max_tokens = self.sizes[-1]
        heads, dim = runner.num_heads, runner.arch.head_dim
        self.q = torch.empty((self.max_tokens, heads, dim), dtype=runner.dtype, device=runner.device)
        self.o = torch.zeros_like(self.q)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.layers: dict[int, list[int]] = {}  # the attention layer between piece i and piece i + 1
        self.outputs: dict[int, torch.Tensor] = {}  # the last piece's hidden states
        self.addresses: dict[int, tuple[int, ...]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(runner.device)
        self.replays = 0

    def bucket(self, tokens: int) -> int | None:
        """The smallest captured token count that holds ``tokens``, or None."""
        i = bisect.bisect_left(self.sizes, tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    @torch.no_grad()
    def capture(self, progress=None) -> None:
        """Capture every size, largest first (the pool grows once); ``progress(size)`` after each."""
        for size in sorted(self.sizes, reverse=True):
            self._capture(size)
            if progress is not None:
                progress(size)

    def _capture(self, size: int) -> None:
        r = self.runner
        attn, model = r.ops.attention, r.model
        batch = r.builder.build([], pad_to=size, fixed=True)
        attn.begin(batch.attn)
        model(batch.input_ids, batch.positions)  # warm-up: loads every kernel of the size outside the capture
        torch.cuda.synchronize(r.device)
        pieces: list[torch.cuda.CUDAGraph] = []
        layers: list[int] = []
        out = self.o[:size]

        def begin_piece():
            g = torch.cuda.CUDAGraph()
            pieces.append(g)
            g.capture_begin(pool=self.pool)

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            pieces[-1].capture_end()
            layers.append(layer)
            begin_piece()
            return out

        attn.split = AttentionSplit(self.q, attend)
        self.stream.wait_stream(torch.cuda.current_stream())
        capturing = False
        try:
            with torch.cuda.stream(self.stream):
                begin_piece()
                capturing = True
                hidden = model(batch.input_ids, batch.positions)
                capturing = False
                pieces[-1].capture_end()
        except BaseException:
            if capturing:
                try:
                    pieces[-1].capture_end()
                except Exception:  # noqa: BLE001 - the capture's own error is the one to report
                    pass
            raise
        finally:
            attn.split = None
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize(r.device)
        self.pieces[size], self.layers[size], self.outputs[size] = pieces, layers, hidden
        self.addresses[size] = _addresses(batch)

    def replay(self, size: int, batch: StepBatch) -> torch.Tensor:
        """The hidden states of the step ``batch`` (built with ``pad_to=size, fixed=True``; its attention
        already planned by ``begin``): ``[size, hidden]``, padding rows last."""
        if _addresses(batch) != self.addresses[size]:
            raise RuntimeError(f"piecewise CUDA graph of {size} tokens: the step's inputs are not where the "
                               "capture read them (build the batch with pad_to and fixed)")
        attn = self.runner.ops.attention
        pieces, q, out = self.pieces[size], self.q[:size], self.o[:size]
        pieces[0].replay()
        for layer, piece in zip(self.layers[size], pieces[1:]):
            attn.run_layer(layer, q, out)
            piece.replay()
        self.replays += 1
        return self.outputs[size]
