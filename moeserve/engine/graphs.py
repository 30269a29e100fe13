"""CUDA graphs for decode steps: one graph per batch-size bucket (one per variant where the attention backend
has several for that size, ``graph_variants``), captured largest first in a shared pool.

A decode batch is padded up to the smallest captured size that holds it (padded rows read and write the
reserved page 0); batches larger than the largest bucket run eagerly. Each graph covers the whole model forward
and the LM head, whose logits it leaves in the model's dtype (``MoECausalLM.greedy_logits``); where the linear
backend finds the greedy tokens in the LM head's epilogue (one-token steps on the Triton GEMV) they are an output
too. Sampling otherwise runs after the graph. Before a replay one kernel copies the step's ids and positions into
the graph's buffers, feeds the tokens still in flight (``StepBatch.feed``) and copies the attention's index lists
into its fixed buffers (what the backend's ``begin_graph`` leaves to it); it also copies the previous step's
sampled tokens out to the host where that step left them to it (``moeserve.engine.runner``).
"""
from __future__ import annotations

import bisect
import logging

import torch

from moeserve.engine.batch import StepBatch
from moeserve.ops.inputs_triton import feed_step_inputs, feed_step_inputs_reference

log = logging.getLogger("moeserve")

HIGH_PRIORITY = -1  # CUDA stream priorities: lower is higher; torch streams default to 0, -1 is the highest
# one kernel copies a replay's ids and positions in and feeds its in-flight tokens (moeserve.ops.inputs_triton; False:
# the same in torch, seven launches: an A/B switch)
FEED_KERNEL = True
# the same launch copies the attention's fixed index buffers in (begin_graph's ``copies``; a replay of the Triton decode
# then runs no FlashInfer plan; False: the backend plans and copies them itself, as before: an A/B switch)
FEED_COPIES = True


class DecodeGraphs:
    def __init__(self, runner, sizes: list[int]):
        self.runner = runner
        self.sizes = sorted(set(sizes))
        self.max_batch_size = self.sizes[-1]
        # keyed by (batch size, the attention backend's variant)
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # (logits, greedy tokens or None)
        self.outputs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None
        # Kernel nodes keep the priority of the stream they were captured on (torch instantiates graphs with
        # cudaGraphInstantiateFlagUseNodePriority). shared_expert_stream_priority puts one of the two paths on a
        # high-priority stream while the graphs of up to shared_expert_stream_priority_max_tokens are captured:
        # "routed" captures on it, "shared" forks the shared expert onto it. first[bs]: the path each graph favours.
        cfg = runner.cfg
        self.priority = cfg.shared_expert_stream_priority if runner.ops.side_stream is not None else "equal"
        self.priority_max_tokens = cfg.shared_expert_stream_priority_max_tokens
        self.high_priority_stream = (torch.cuda.Stream(runner.device, priority=HIGH_PRIORITY)
                                     if self.priority != "equal" else None)
        self.first: dict[int, str] = {}

    def bucket(self, batch_size: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch_size)]

    def _dummy_batch(self, bs: int) -> StepBatch:
        return self.runner.builder.build([], pad_to=bs)

    @torch.no_grad()
    def capture(self, progress: bool = True) -> None:
        r = self.runner
        attn, model = r.ops.attention, r.model
        sizes = sorted(self.sizes, reverse=True)
        iterator = sizes
        bar = None
        if progress:
            from rich.progress import Progress
            bar = Progress(transient=False)
            bar.start()
            task = bar.add_task("capturing decode CUDA graphs", total=len(sizes))
        try:
            for bs in iterator:
                attn.init_graph(bs, r.max_pages_per_seq)
                ids = torch.zeros(bs, dtype=torch.int32, device=r.device)
                pos = torch.zeros(bs, dtype=torch.int32, device=r.device)
                self.inputs[bs] = (ids, pos)
                first = self.priority if bs <= self.priority_max_tokens else "equal"
                self.first[bs] = first
                dummy = self._dummy_batch(bs).attn
                for variant in attn.graph_variants(bs):
                    attn.begin_graph(bs, dummy, variant)
                    model.greedy_logits(model(ids, pos))  # warm-up: loads kernels outside the capture
                    torch.cuda.synchronize(r.device)
                    g = torch.cuda.CUDAGraph()
                    side = r.ops.side_stream
                    if first == "shared":
                        r.ops.side_stream = self.high_priority_stream
                    try:
                        with torch.cuda.graph(g, pool=self.pool,
                                              stream=self.high_priority_stream if first == "routed" else None):
                            out = model.greedy_logits(model(ids, pos))
                    finally:
                        r.ops.side_stream = side
                    if self.pool is None:
                        self.pool = g.pool()
                    self.graphs[bs, variant], self.outputs[bs, variant] = g, out
                if bar is not None:
                    bar.update(task, advance=1, description=f"capturing decode CUDA graphs (batch {bs})")
        finally:
            if bar is not None:
                bar.stop()
        if FEED_KERNEL and self.inputs:  # load the input feed's kernel now, not at the first request's replay
            ids, pos = self.inputs[self.sizes[0]]
            feed_step_inputs(ids, pos, ids.clone(), pos.clone())

    def replay(self, bs: int, batch: StepBatch, after_plan=None, tokens_out=None,
               after_feed=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the step's graph; returns its outputs for every row (padding too): the logits in the model's
        dtype, and the greedy tokens where the graph finds them (else None). ``tokens_out``: ``(tokens, host)``, the
        previous step's sampled tokens for the feed to copy out; ``after_feed``: called once the feed is queued."""
        ids, pos = self.inputs[bs]
        copies = [] if FEED_KERNEL and FEED_COPIES else None
        variant = self.runner.ops.attention.begin_graph(bs, batch.attn, copies=copies)
        if after_plan is not None:
            after_plan()
        if FEED_KERNEL:
            feed_step_inputs(ids, pos, batch.input_ids, batch.positions, *(batch.feed or (None,) * 3),
                             copies=copies or (), tokens_out=tokens_out)
        else:
            feed_step_inputs_reference(ids, pos, batch.input_ids, batch.positions, *(batch.feed or ()),
                                       tokens_out=tokens_out)
        if after_feed is not None:
            after_feed()
        self.graphs[bs, variant].replay()
        return self.outputs[bs, variant]
