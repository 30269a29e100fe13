"""The model runner: builds the model on its device with the planned backends, sizes the KV cache, and
runs one step (forward, logits, sampling) from a ``StepInput``, through captured CUDA graphs: whole-model
graphs for decode steps (``moeserve.engine.graphs``), graphs of the layers between attentions for the other
steps up to ``prefill_graph_max_tokens`` (``moeserve.engine.piecewise``).

A step is launched (``launch``: everything queued on the GPU, the sampled tokens copied into pinned host
memory behind an event) and later waited for (``wait``); ``execute`` does both. Between the two the host
is free to schedule and launch the next step, which reads the tokens it feeds from this step's device
tensor (a request's ``inflight_row``). With ``DEFER_TOKEN_COPY`` (off by default), where that next step replays a
decode graph, its input feed copies this step's tokens out as well, so no copy sits between the two steps on the
GPU; a step whose tokens no launch took along copies them when it is waited for. FlashInfer's ``plan()`` writes the
next step's schedule into a pinned buffer of the wrapper before copying it to the device, so each plan waits for
the copy of the previous one (an event; by then long done).

The runner sees plain data only (``moeserve.engine.step``); the sampler keeps each seeded request's
random stream until the request is listed in a step's ``finished_request_ids``.

With several ranks (``plan.parallel``) every rank runs a runner on the same steps: it holds its part of the
model and of the KV cache (its kv heads; the page count is the smallest any rank can hold), the logits are
gathered on every rank and every rank samples the same tokens (same logits, same seeds), so each can feed
in-flight tokens from its own device tensor; only rank 0 copies them to the host (``copies_tokens``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from moeserve.engine.batch import BatchBuilder
from moeserve.engine.kernels import prepare_kernels
from moeserve.engine.logprobs import PROMPT_ROWS_PER_PASS, PromptLogprobs, SampledLogprobs, cat, score
from moeserve.engine.step import SamplingRow, ScheduledRequest, StepInput, StepOutput
from moeserve.kernel_cache.triton_cache import wait_launchers
from moeserve.models.layers import MoECausalLM, Ops
from moeserve.models.parallel import local_heads
from moeserve.ops import pdl
from moeserve.ops.kv_cache import KVCache
from moeserve.ops.parallel import all_reduce_min
from moeserve.ops.sampling import SamplingBatch, to_device
from moeserve.plan import RuntimePlan
from moeserve.weights import load_weights

log = logging.getLogger("moeserve")

CPU_KV_BUDGET_BYTES = 1 << 30
# a step's sampled tokens go to the host with the next step's decode-graph input feed where there is one (False: a
# copy queued right after the step: an A/B switch, read when a runner is made; off until an A/B on a GPU has
# measured it)
DEFER_TOKEN_COPY = False
# rows of pinned host memory those feeds write the tokens into, taken in turn: at most two steps are in flight (a step
# is waited for before the one after the next is launched), and a step dropped unwaited leaves a late write in a row
# of this runner's, never in memory handed out again
TOKEN_ROWS = 4


@dataclass
class LaunchedStep:
    """A step queued on the device; ``tokens`` holds one sampled token per sampling request, in order."""
    step: StepInput
    tokens: torch.Tensor | None = None  # device, int64
    host: torch.Tensor | None = None  # pinned copy of tokens
    event: torch.cuda.Event | None = None
    pending: bool = False  # host is still to be written (and event recorded): by the next feed, or by wait
    sampled_logprobs: SampledLogprobs | None = None  # host copies, for the sampling requests that asked
    prompt_logprobs: PromptLogprobs | None = None  # host copies, for the prefill chunks that asked


def tuned_config_sizes(arch, dtype: torch.dtype, max_tokens: int) -> list[int]:
    """The smallest step size of each distinct fused-MoE tile config up to ``max_tokens`` tokens (the sizes
    whose first step loads a kernel, when no kernel cache lists them)."""
    from moeserve.ops.moe.triton_configs import get_config
    sizes, seen = [], set()
    for t in range(1, max_tokens + 1):
        cfg = get_config(t, arch.num_experts, arch.moe_intermediate_size, arch.hidden_size, arch.top_k, dtype)[0]
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            sizes.append(t)
    return sizes


def kv_budget_bytes(utilization: float, total: int, free_at_start: int, free_now: int, activation_peak: int) -> int:
    """Bytes the KV cache may take: ``utilization`` of the GPU for this engine (weights, activations, cache),
    counting only what this engine allocated since it started, as vLLM does, so another process on the GPU
    does not shrink it; never more than is free now."""
    used_by_engine = free_at_start - free_now
    return int(min(utilization * total - used_by_engine, free_now) - activation_peak)


class ModelRunner:
    def __init__(self, plan: RuntimePlan):
        t_start = time.perf_counter()
        cfg = self.cfg = plan.config
        self.plan = plan
        self.device, self.arch, self.dtype = plan.device, plan.arch, plan.dtype
        self.quantization, self.max_model_len = plan.quantization, plan.max_model_len
        self.parallel = plan.parallel
        self.num_heads, self.num_kv_heads, _ = local_heads(self.arch, self.parallel)  # this rank's
        self.copies_tokens = True  # copy sampled tokens to the host (ranks other than 0 have no use for them)
        self.defer_token_copy = DEFER_TOKEN_COPY
        self._token_rows: torch.Tensor | None = None  # [TOKEN_ROWS, max_num_seqs] int64, pinned, made at first use
        self._token_row = 0
        self.free_at_start = 0
        # Seconds of each part of the start, in order (``startup_phases``; the engine adds its own).
        self.startup_phases: dict[str, float] = {}
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.free_at_start = torch.cuda.mem_get_info(self.device)[0]  # before this engine allocates
        self._phase("cuda_init", t_start)
        t = time.perf_counter()
        self.kernel_cache = prepare_kernels(plan)
        self.pdl_max_tokens = plan.pdl_max_tokens
        pdl.configure(self.pdl_max_tokens)  # before any Triton kernel is warmed, compiled or captured
        self.backend_names = plan.backend_names
        self.ops = self._build_ops()
        t0 = self._phase("kernel_cache_and_ops", t)

        self.model, self.load_format, self.high_precision_modules = self._load_model()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.load_seconds = time.perf_counter() - t0
        if self.device.type == "cuda":  # Triton's launchers, built in the background since the kernel cache's set-up
            t = time.perf_counter()
            wait_launchers()
            self._phase("triton_launchers_wait", t)

        self.page_size = cfg.page_size
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)
        self.activation_peak_bytes = 0
        num_pages = self._num_kv_pages()
        t = time.perf_counter()
        self.kv = KVCache(self.arch.num_layers, num_pages, self.page_size, self.num_kv_heads,
                          self.arch.head_dim, self.dtype, self.device)
        self.ops.attention = self._make_attention(self.kv)
        self.sampler = plan.backend_class("sampling")(self.device, cfg.seed)
        # a step lists each request's pages, shared prefix pages once per request: up to max_pages_per_seq each
        self.builder = BatchBuilder(self.page_size, max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
                                    cfg.max_num_seqs, cfg.max_num_seqs * self.max_pages_per_seq, self.device)
        self.graphs = None
        self.piecewise = None
        self._plan_copied = None  # event after the last plan()'s host-to-device copy
        self._last: LaunchedStep | None = None  # the last launched step, whose tokens in-flight inputs read
        self.graph_capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self._phase("kv_cache", t)
        self.init_seconds = time.perf_counter() - t_start

    @property
    def fusions(self) -> list[str]:
        """The kernels that do more than their operator's backend says (for reports): the attention's QKV
        kernel (q/k norms, rotary embedding, KV append), the SwiGLU activation inside the expert GEMM and the
        router's GEMM as partial sums the routing kernel adds (small steps)."""
        out = []
        if self.ops.attention is not None and self.ops.attention.fuse_qkv:
            out.append("qkv-norm-rope-append")
        blocks = list(self.model.moe_blocks())
        if any(b.w13_order == "interleaved" for b in blocks):
            out.append("swiglu-in-expert-gemm")
        if any(b.router_gemm_split(1) for b in blocks):
            out.append("router-gemm-split-k")
        return out

    def _phase(self, name: str, since: float) -> float:
        """Record ``name`` as the seconds since ``since``; returns now."""
        now = time.perf_counter()
        self.startup_phases[name] = round(now - since, 3)
        return now

    # --- set-up --------------------------------------------------------------------------------
    def _build_ops(self) -> Ops:
        plan, dev, dtype = self.plan, self.device, self.dtype
        cls = plan.backend_class
        side = dev.type == "cuda" and self.cfg.shared_expert_stream_max_tokens > 0 and not self.cfg.torch_compile
        linear, moe = cls("linear")(dev, dtype), cls("moe")(dev, dtype)
        if linear.name == "triton":
            linear.max_tokens = self.cfg.linear_gemv_max_tokens
        if moe.name == "triton":
            moe.pairwise_max_tokens = self.cfg.moe_pairwise_max_tokens
        norm = cls("norm")()
        if norm.name == "flashinfer":
            norm.triton_max_tokens = plan.norm_triton_max_tokens
        routing = cls("routing")(dev, explicit=plan.explicit("routing"))
        if routing.name == "fused":
            routing.split_max_tokens = self.cfg.router_split_k_max_tokens
        return Ops(linear=linear, norm=norm, activation=cls("activation")(),
                   moe=moe, routing=routing,
                   rope_cls=cls("rope"), names=self.backend_names, quantization=self.quantization,
                   side_stream=torch.cuda.Stream(dev) if side else None,
                   side_stream_max_tokens=self.cfg.shared_expert_stream_max_tokens, parallel=self.parallel,
                   moe_fuse_norm_max_tokens=plan.moe_fuse_norm_max_tokens,
                   moe_fuse_norm_in_grid=plan.moe_fuse_norm_in_grid, router_fuse_norm=plan.router_fuse_norm,
                   moe_fused_shared_early=plan.moe_fused_shared_early, moe_route_in_grid=plan.moe_route_in_grid)

    def _load_model(self) -> tuple[MoECausalLM, str, list[str]]:
        """The model with its weights in place and every MoE layer prepared by the routing and MoE backends;
        also the load format used and the FP8 checkpoint's linears kept in high precision."""
        plan, cfg = self.plan, self.cfg
        t = time.perf_counter()
        torch.manual_seed(cfg.seed)
        model = MoECausalLM(self.arch, self.ops, self.dtype, self.device)
        kept = []
        if self.quantization == "fp8":
            from moeserve.models.base import keep_in_high_precision
            from moeserve.quant.config import high_precision_rule
            kept = keep_in_high_precision(model, high_precision_rule(plan.source.config), self.dtype, self.device)
            if kept:
                log.info("FP8: %d linears stay in %s as the checkpoint's quantization_config says (%s, ...)",
                         len(kept), str(self.dtype).removeprefix("torch."), kept[0])
        t = self._phase("build_model", t)
        load_format = load_weights(model, plan.source, cfg.load_format, cfg.seed)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = self._phase("weights", t)
        fused = plan.fused_shared_expert_steps
        for block in model.moe_blocks():
            if fused is not None:
                block.fuse_shared_expert(cfg.moe_fuse_shared_expert_pieces, fused)
            self.ops.routing.prepare(block)
            self.ops.moe.prepare(block)
        if cfg.torch_compile:
            self._compile_mlps(model)
        self._phase("prepare_moe", t)
        return model, load_format, kept

    @staticmethod
    def _compile_mlps(model: MoECausalLM) -> None:
        """torch.compile each layer's MLP/MoE block (router, routing, shared expert, residual maths).

        Attention stays outside: FlashInfer's ops are not registered with torch.library, and ``plan()``
        must run on the host between steps. Dynamic shapes keep one compiled graph for every batch size.
        """
        from moeserve.ops.eager import apply_eager_marks
        apply_eager_marks()  # the custom kernel launches run eagerly inside the compiled blocks
        for layer in model.layers:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)

    def _make_attention(self, kv: KVCache):
        a = self.arch
        att = self.plan.backend_class("attention")(kv, self.num_heads, self.num_kv_heads, a.head_dim,
                                                   a.head_dim ** -0.5, self.device, self.dtype)
        att.fuse_qkv = att.fuse_qkv and self.plan.fused_qkv
        if self.plan.triton_decode_max_tokens:
            att.enable_triton_decode(self.plan.triton_decode_max_tokens, a.rotary_dim,
                                     self.cfg.attention_decode_triton_max_context)
            if self.plan.layer_kernel:
                att.enable_layer_kernel(a.hidden_size)
        return att

    def _num_kv_pages(self) -> int:
        cfg, a = self.cfg, self.arch
        per_page = KVCache.bytes_per_page(a.num_layers, self.page_size, self.num_kv_heads, a.head_dim, self.dtype)
        if cfg.num_kv_pages is not None:
            pages = cfg.num_kv_pages
        elif cfg.kv_cache_gb is not None:
            pages = int(cfg.kv_cache_gb * (1 << 30)) // per_page
        elif self.device.type == "cuda":
            t = time.perf_counter()
            self.activation_peak_bytes = self._profile_activations()
            self._phase("activation_profile", t)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_budget_bytes(cfg.gpu_memory_utilization, total, self.free_at_start, free,
                                     self.activation_peak_bytes)
            pages = max(0, int(budget) // per_page)
        else:
            wanted = cfg.max_num_seqs * self.max_pages_per_seq + 1
            pages = min(wanted, CPU_KV_BUDGET_BYTES // per_page)
        if self.parallel.is_parallel:  # every rank holds the same pages (the scheduler's pool)
            pages = all_reduce_min(pages, self.device)
        if pages - 1 < self.max_pages_per_seq:
            raise ValueError(
                f"the KV cache holds {max(pages - 1, 0)} pages of {self.page_size} tokens but one request of "
                f"max_model_len {self.max_model_len} needs {self.max_pages_per_seq}; lower max_model_len or give "
                "the cache more memory (gpu_memory_utilization, kv_cache_gb or num_kv_pages)")
        return pages

    @torch.no_grad()
    def _profile_activations(self) -> int:
        """Peak activation bytes of the largest step (``max_num_batched_tokens`` prefill tokens)."""
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        seqs = max(1, -(-self.cfg.max_num_batched_tokens // n))
        need = -(-n // self.page_size)
        pages = seqs * need + 1
        kv = KVCache(self.arch.num_layers, pages, self.page_size, self.num_kv_heads, self.arch.head_dim,
                     self.dtype, self.device)
        saved, self.ops.attention = self.ops.attention, self._make_attention(kv)
        items = [ScheduledRequest(f"profile-{i}", 0, [0] * n, list(range(1 + i * need, 1 + (i + 1) * need)), True)
                 for i in range(seqs)]
        builder = BatchBuilder(self.page_size, seqs * n, seqs, pages, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        batch = builder.build(items)
        self.ops.attention.begin(batch.attn)
        hidden = self.model(batch.input_ids, batch.positions)
        self.model.compute_logits(hidden[batch.logits_indices])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.ops.attention = saved
        del kv, hidden, builder
        torch.cuda.empty_cache()
        return int(peak)

    def capture_graphs(self, sizes: list[int], progress: bool = True) -> None:
        """Capture the decode graphs of ``sizes`` and the piecewise graphs of ``prefill_graph_sizes``."""
        pieces = self.cfg.prefill_graph_sizes()
        if self.device.type != "cuda" or not (sizes or pieces):
            return
        attn = self.ops.attention
        if sizes and not attn.supports_graphs:
            log.warning("CUDA graphs: the %s attention backend cannot be captured; decode runs eagerly",
                        self.backend_names["attention"])
            sizes = []
        if pieces and not attn.supports_piecewise:
            log.info("piecewise CUDA graphs: the %s attention backend without its one-kernel QKV path cannot be cut "
                     "at the attention; prefill and mixed steps run eagerly", self.backend_names["attention"])
            pieces = []
        if not (sizes or pieces):
            return
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        if sizes:
            from moeserve.engine.graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, sizes)
            self.graphs.capture(progress=progress)
        t1 = time.perf_counter()
        if pieces:
            from moeserve.engine.piecewise import PiecewiseGraphs
            self.piecewise = PiecewiseGraphs(self, pieces)
            self._capture_piecewise(progress)
        torch.cuda.synchronize(self.device)
        self.graph_capture_seconds = time.perf_counter() - t0
        self.startup_phases["cuda_graphs"] = round(self.graph_capture_seconds, 3)
        self.graph_memory_bytes = max(0, free0 - torch.cuda.mem_get_info(self.device)[0])
        if self.graphs is not None:
            log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs.graphs),
                     self.graphs.sizes, t1 - t0)
        if self.piecewise is not None:
            log.info("captured piecewise CUDA graphs of %d token counts (%d to %d) in %.1f s",
                     len(self.piecewise.sizes), self.piecewise.sizes[0], self.piecewise.max_tokens,
                     time.perf_counter() - t1)
        log.info("the CUDA graphs hold %.0f MiB", self.graph_memory_bytes / 2**20)

    def _capture_piecewise(self, progress: bool) -> None:
        if not progress:
            self.piecewise.capture()
            return
        from rich.progress import Progress
        with Progress(transient=False) as bar:
            task = bar.add_task("capturing piecewise CUDA graphs", total=len(self.piecewise.sizes))
            self.piecewise.capture(lambda t: bar.update(
                task, advance=1, description=f"capturing piecewise CUDA graphs ({t} tokens)"))

    @torch.no_grad()
    def warm_up(self) -> None:
        """Before the first request, on the GPU: load every Triton kernel a step can launch and grow the memory
        pool to the largest step, so that no request pays either.

        The MoE block of the first sparse layer runs once per step size that first launches a kernel (listed
        per kernel by ``moeserve precompile`` in the kernel cache; without one, the first size of each tuned
        tile config), then the whole model runs one step of ``max_num_batched_tokens`` prefill tokens on free
        KV pages (the prefill attention plan, activations at their peak). Decode sizes are loaded by the CUDA
        graph capture."""
        if self.device.type != "cuda":
            return
        from moeserve.kernel_cache.triton_cache import warm_step_sizes
        from moeserve.models.layers import SparseMoE
        t0 = time.perf_counter()
        sizes = warm_step_sizes()
        moe = next((layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)), None)
        if moe is not None and self.backend_names["moe"] == "triton":
            if sizes is None:
                sizes = tuned_config_sizes(self.arch, self.dtype, self.plan.max_step_tokens)
            h = self.arch.hidden_size
            for t in sizes:
                if t <= self.plan.max_step_tokens:
                    x = torch.zeros((t, h), dtype=self.dtype, device=self.device)
                    ones = torch.ones(h, dtype=self.dtype, device=self.device)
                    moe.after_attention(x, torch.zeros_like(x), ones, self.arch.rms_norm_eps, ones)  # as the model
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        need = -(-n // self.page_size)
        if need < self.kv.num_pages:
            item = ScheduledRequest("warm-up", 0, [0] * n, list(range(1, 1 + need)), True)
            batch = self.builder.build([item])
            self.ops.attention.begin(batch.attn)
            hidden = self.model(batch.input_ids, batch.positions)
            self.model.compute_logits(hidden[batch.logits_indices])
        torch.cuda.synchronize(self.device)
        self._phase("warm_up", t0)
        log.info("warm-up: the MoE block at %d step sizes and one step of %d tokens in %.2f s",
                 len(sizes or []), n, time.perf_counter() - t0)

    # --- a step --------------------------------------------------------------------------------
    def sampling_batch(self, requests: list[ScheduledRequest]) -> SamplingBatch:
        rows: list[SamplingRow] = [r.sampling for r in requests]
        dev = self.device
        return SamplingBatch(
            temperature=to_device([r.temperature for r in rows], torch.float32, dev),
            top_k=to_device([r.top_k for r in rows], torch.int32, dev),
            top_p=to_device([r.top_p for r in rows], torch.float32, dev),
            min_p=to_device([r.min_p for r in rows], torch.float32, dev),
            greedy=[r.greedy for r in rows], seeds=[r.seed for r in rows],
            steps=[r.num_generated for r in rows], keys=[r.request_id for r in requests],
            filters=[r.filters for r in rows],
        )

    def _before_plan(self) -> None:
        if self._plan_copied is not None:
            self._plan_copied.synchronize()

    def _after_plan(self) -> None:
        if self.device.type == "cuda":
            if self._plan_copied is None:
                self._plan_copied = torch.cuda.Event()
            self._plan_copied.record()

    @torch.no_grad()
    def forward_logits(self, step: StepInput) -> torch.Tensor:
        """Logits of every request of ``step`` that samples (float32 ``[S, V]``). Inputs still in flight are
        read from the sampled tokens of the last launched step."""
        return self._forward(step)[0].float()

    def _forward(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The sampling requests' logits (float32, or the model's dtype from a decode graph), the hidden states of
        every fed token when the step scores prompt tokens (such a step runs eagerly), and the requests' greedy
        tokens where a decode graph found them (else None)."""
        items = step.requests
        prev = self._last.tokens if self._last is not None else None
        graphs = self.graphs
        pdl.configure(self.pdl_max_tokens)  # the process-wide switch, as this engine's plan says
        scores_prompt = any(it.prompt_logprobs is not None for it in items)
        if graphs is not None and step.is_decode and len(items) <= graphs.max_batch_size and not scores_prompt:
            bucket = graphs.bucket(len(items))
            batch = self.builder.build(items, pad_to=bucket, prev_tokens=prev, defer_feed=True)
            self._before_plan()
            last = self._last if self._last is not None and self._last.pending else None
            logits, greedy = graphs.replay(bucket, batch, after_plan=self._after_plan,
                                           tokens_out=None if last is None else (last.tokens, last.host),
                                           after_feed=None if last is None else lambda: self._copied(last))
            if all(it.samples for it in items):
                rows = slice(0, len(items))
            else:
                rows = batch.logits_indices.long()
            return logits[rows], None, None if greedy is None else greedy[rows]
        if self._last is not None and self._last.pending:
            self._copy_tokens(self._last)
        pieces = self.piecewise
        size = pieces.bucket(step.num_tokens) if pieces is not None and not scores_prompt else None
        batch = self.builder.build(items, prev_tokens=prev, pad_to=size, fixed=size is not None)
        self._before_plan()
        self.ops.attention.begin(batch.attn)
        self._after_plan()
        if size is not None:
            hidden = pieces.replay(size, batch)
        else:
            hidden = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden[batch.logits_indices]), hidden if scores_prompt else None, None

    def _score_prompts(self, step: StepInput, hidden: torch.Tensor) -> PromptLogprobs | None:
        """Queue the scores of the prompt tokens of the chunks that asked: position p's logits against the
        prompt token at p + 1 (the chunk's last position against ``next_prompt_token``)."""
        parts, targets, spans = [], [], []
        offset = 0
        for r in step.requests:
            if r.prompt_logprobs is not None:
                assert r.inflight_row < 0, f"{r.request_id}: prompt tokens scored with a token in flight"
                tgt = r.token_ids[1:] + ([r.next_prompt_token] if r.next_prompt_token is not None else [])
                for a in range(0, len(tgt), PROMPT_ROWS_PER_PASS):
                    b = min(len(tgt), a + PROMPT_ROWS_PER_PASS)
                    logits = self.model.compute_logits(hidden[offset + a:offset + b])
                    parts.append(score(logits, to_device(tgt[a:b], torch.int64, self.device), r.prompt_logprobs))
                if tgt:
                    spans.append((r.request_id, len(targets), len(tgt), r.prompt_logprobs))
                    targets.extend(tgt)
            offset += r.num_tokens
        if not parts:
            return None
        return PromptLogprobs(cat(parts).to_host(self.device.type == "cuda"), targets, spans)

    def _score_sampled(self, sampling: list[ScheduledRequest], logits: torch.Tensor,
                       tokens: torch.Tensor) -> SampledLogprobs | None:
        """Queue the scores of the sampled tokens of the requests that asked (the unmodified logits)."""
        rows = [(r.request_id, i, r.sampling.logprobs) for i, r in enumerate(sampling) if r.sampling.logprobs is not None]
        if not rows:
            return None
        logits = logits.float()  # a decode graph's are in the model's dtype
        if len(rows) < len(sampling):
            idx = to_device([i for _, i, _ in rows], torch.int64, self.device)
            logits, tokens = logits.index_select(0, idx), tokens.index_select(0, idx)
        t = score(logits, tokens, max(k for _, _, k in rows))
        return SampledLogprobs(t.to_host(self.device.type == "cuda"), rows)

    @torch.no_grad()
    def launch(self, step: StepInput) -> LaunchedStep:
        """Queue one step on the device and return without waiting for it."""
        if step.finished_request_ids:
            self.sampler.release(step.finished_request_ids)
        launched = LaunchedStep(step)
        if not step.requests:
            return launched
        logits, hidden, greedy = self._forward(step)
        if hidden is not None:
            launched.prompt_logprobs = self._score_prompts(step, hidden)
            del hidden
        sampling = step.sampling_requests
        cuda = self.device.type == "cuda"
        if sampling:
            if all(r.sampling.greedy for r in sampling):  # no per-request tensors to build and copy
                tokens = greedy if greedy is not None else logits.argmax(dim=-1)  # the same in any float dtype
            else:
                logits = logits.float()
                tokens = self.sampler.sample(logits, self.sampling_batch(sampling))
            launched.tokens = tokens
            launched.sampled_logprobs = self._score_sampled(sampling, logits, tokens)
            if self.copies_tokens and cuda:
                launched.host = self._deferred_row(tokens)
                launched.pending = launched.host is not None
                if not launched.pending:
                    launched.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                    launched.host.copy_(tokens, non_blocking=True)
            elif self.copies_tokens:
                launched.host = tokens
        if cuda and not launched.pending and (launched.host is not None or launched.prompt_logprobs is not None):
            self._copied(launched)
        self._last = launched
        return launched

    def _deferred_row(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The next row of pinned host memory for tokens the next decode graph's feed copies out, or None where
        they are copied now (``defer_token_copy`` off, no decode graphs, or tokens the rows do not hold)."""
        rows = self.cfg.max_num_seqs
        if not (self.defer_token_copy and self.graphs is not None and tokens.dtype == torch.int64
                and tokens.dim() == 1 and tokens.shape[0] <= rows):
            return None
        if self._token_rows is None:
            self._token_rows = torch.empty((TOKEN_ROWS, rows), dtype=torch.int64, pin_memory=True)
        k, self._token_row = self._token_row, (self._token_row + 1) % TOKEN_ROWS
        return self._token_rows[k, :tokens.shape[0]]

    @staticmethod
    def _copied(launched: LaunchedStep) -> None:
        """The step's copies to the host are queued: the event its wait blocks on."""
        launched.event = torch.cuda.Event()
        launched.event.record()
        launched.pending = False

    def _copy_tokens(self, launched: LaunchedStep) -> None:
        """Queue the copy of a step's tokens that no decode graph's feed took along."""
        launched.host.copy_(launched.tokens, non_blocking=True)
        self._copied(launched)

    def wait(self, launched: LaunchedStep) -> StepOutput:
        """Block until the step's tokens (and log-probabilities) are on the host."""
        step = launched.step
        if launched.pending:
            self._copy_tokens(launched)
        if launched.event is not None:
            launched.event.synchronize()
        out = StepOutput(step.step_id, [None] * len(step.requests))
        if launched.prompt_logprobs is not None:
            out.prompt_logprobs = launched.prompt_logprobs.resolve()
        if launched.tokens is None:
            return out
        tokens = launched.host.tolist()
        it_tokens = iter(tokens)
        out.sampled = [next(it_tokens) if r.samples else None for r in step.requests]
        if launched.sampled_logprobs is not None:
            out.logprobs = launched.sampled_logprobs.resolve(tokens)
        return out

    @torch.no_grad()
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step to completion."""
        return self.wait(self.launch(step))
