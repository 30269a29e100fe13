"""The model runner: builds the model on its device with the chosen backends, sizes the KV cache, and
runs one scheduled step (forward, logits, sampling), through captured CUDA graphs for decode steps.

A step is launched (``launch``: everything queued on the GPU, the sampled tokens copied into pinned host
memory behind an event) and later waited for (``wait``); ``execute`` does both. Between the two the host
is free to schedule and launch the next step, which reads the tokens it feeds from this step's device
tensor. FlashInfer's ``plan()`` writes the next step's schedule into a pinned buffer of the wrapper before
copying it to the device, so each plan waits for the copy of the previous one (an event; by then long done).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from moeserve.config import EngineConfig, ModelSource
from moeserve.engine.batch import BatchBuilder
from moeserve.engine.kv_cache import KVCache
from moeserve.engine.scheduler import ScheduledSeq
from moeserve.hardware import HardwareInfo, check_gpu_arch, resolve_device
from moeserve.models import arch_from_hf
from moeserve.models.layers import MoECausalLM, Ops
from moeserve.ops import registry
from moeserve.ops.names import OPERATORS
from moeserve.ops.sampling import SamplingBatch, to_device
from moeserve.quant.config import engine_quantization
from moeserve.weights import init_dummy, load_checkpoint

log = logging.getLogger("moeserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 1 << 30


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


@dataclass
class LaunchedStep:
    """A step queued on the device; ``tokens`` holds one sampled token per sampling request, in order."""
    items: list[ScheduledSeq]
    tokens: torch.Tensor | None = None  # device, int64
    host: torch.Tensor | None = None  # pinned copy of tokens
    event: torch.cuda.Event | None = None


class ModelRunner:
    def __init__(self, cfg: EngineConfig, source: ModelSource, hw: HardwareInfo):
        t_start = time.perf_counter()
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        check_gpu_arch(cfg.gpu_arch, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.arch = arch = arch_from_hf(source.config)
        self.dtype = resolve_dtype(cfg.dtype, arch.torch_dtype, self.device)
        self.quantization = engine_quantization(cfg, source.config)
        if cfg.kv_cache_dtype != "auto":
            raise NotImplementedError(f"kv_cache_dtype: {cfg.kv_cache_dtype!r} is not supported by this build "
                                      "(the KV cache is kept in the model dtype; use kv_cache_dtype: auto)")
        self.max_model_len = cfg.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({arch.max_position_embeddings})")

        self.kernel_cache = None
        if cfg.kernel_cache_dir is not None:
            from moeserve.kernels import use_kernel_cache
            self.kernel_cache = use_kernel_cache(cfg.kernel_cache_dir, hw)
        specs = {op: registry.resolve(op, getattr(cfg.backends, op), hw, self.device, self.dtype, self.quantization,
                                      arch.head_dim)
                 for op in OPERATORS}
        self.backend_names = {op: s.name for op, s in specs.items()}
        load = registry.load
        self.ops = Ops(
            linear=load(specs["linear"])(self.device, self.dtype),
            norm=load(specs["norm"])(),
            activation=load(specs["activation"])(),
            moe=load(specs["moe"])(self.device, self.dtype),
            routing=load(specs["routing"])(self.device, explicit=cfg.backends.routing != "auto"),
            rope_cls=load(specs["rope"]),
            names=self.backend_names,
            quantization=self.quantization,
        )
        self._attn_cls = load(specs["attention"])

        # weights
        t0 = time.perf_counter()
        torch.manual_seed(cfg.seed)
        self.model = MoECausalLM(arch, self.ops, self.dtype, self.device)
        self.high_precision_modules = []
        if self.quantization == "fp8":
            from moeserve.models.layers import keep_in_high_precision
            from moeserve.quant.config import high_precision_rule
            self.high_precision_modules = keep_in_high_precision(self.model, high_precision_rule(source.config),
                                                                 self.dtype, self.device)
            if self.high_precision_modules:
                log.info("FP8: %d linears stay in %s as the checkpoint's quantization_config says (%s, ...)",
                         len(self.high_precision_modules), str(self.dtype).removeprefix("torch."),
                         self.high_precision_modules[0])
        use_dummy = cfg.load_format == "dummy" or (cfg.load_format == "auto" and source.weights_dir is None)
        if cfg.load_format == "safetensors" and source.weights_dir is None:
            raise ValueError(f"load_format: 'safetensors' but model {cfg.model!r} has no *.safetensors files "
                             "(use load_format: dummy for random weights)")
        if use_dummy:
            init_dummy(self.model, seed=cfg.seed)
        else:
            load_checkpoint(self.model, source.weights_dir)
        for block in self.model.moe_blocks():
            self.ops.routing.prepare(block)
            self.ops.moe.prepare(block)
        self.load_format = "dummy" if use_dummy else "safetensors"
        if cfg.torch_compile:
            self._compile_mlps()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.load_seconds = time.perf_counter() - t0

        # KV cache
        self.page_size = cfg.page_size
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)
        self.activation_peak_bytes = 0
        num_pages = self._num_kv_pages()
        self.kv = KVCache(arch.num_layers, num_pages, self.page_size, arch.num_kv_heads, arch.head_dim,
                          self.dtype, self.device)
        self.ops.attention = self._make_attention(self.kv)
        self.sampler = load(specs["sampling"])(self.device, cfg.seed)
        self.builder = BatchBuilder(self.page_size, max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
                                    cfg.max_num_seqs, num_pages + cfg.max_num_seqs, self.device)
        self.graphs = None
        self._plan_copied = None  # event after the last plan()'s host-to-device copy
        self.graph_capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.init_seconds = time.perf_counter() - t_start

    # --- set-up --------------------------------------------------------------------------------
    def _compile_mlps(self) -> None:
        """torch.compile each layer's MLP/MoE block (router, routing, shared expert, residual maths).

        Attention stays outside: FlashInfer's ops are not registered with torch.library, and ``plan()``
        must run on the host between steps. Dynamic shapes keep one compiled graph for every batch size.
        """
        for layer in self.model.layers:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
    def _make_attention(self, kv: KVCache):
        a = self.arch
        return self._attn_cls(kv, a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim ** -0.5, self.device,
                              self.dtype)

    def _num_kv_pages(self) -> int:
        cfg, a = self.cfg, self.arch
        per_page = KVCache.bytes_per_page(a.num_layers, self.page_size, a.num_kv_heads, a.head_dim, self.dtype)
        if cfg.num_kv_pages is not None:
            pages = cfg.num_kv_pages
        elif cfg.kv_cache_gb is not None:
            pages = int(cfg.kv_cache_gb * (1 << 30)) // per_page
        elif self.device.type == "cuda":
            self.activation_peak_bytes = self._profile_activations()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = cfg.gpu_memory_utilization * total - (total - free) - self.activation_peak_bytes
            pages = int(budget) // per_page
        else:
            wanted = cfg.max_num_seqs * self.max_pages_per_seq + 1
            pages = min(wanted, CPU_KV_BUDGET_BYTES // per_page)
        if pages - 1 < self.max_pages_per_seq:
            raise ValueError(
                f"the KV cache holds {max(pages - 1, 0)} pages of {self.page_size} tokens but one request of "
                f"max_model_len {self.max_model_len} needs {self.max_pages_per_seq}; lower max_model_len or give "
                "the cache more memory (gpu_memory_utilization, kv_cache_gb or num_kv_pages)")
        return pages

    @torch.no_grad()
    def _profile_activations(self) -> int:
        """Peak activation bytes of the largest step (``max_num_batched_tokens`` prefill tokens)."""
        from moeserve.engine.scheduler import ScheduledSeq
        from moeserve.engine.sequence import Sequence
        from moeserve.engine.sampling_params import SamplingParams
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        seqs = max(1, -(-self.cfg.max_num_batched_tokens // n))
        pages = seqs * (-(-n // self.page_size)) + 1
        kv = KVCache(self.arch.num_layers, pages, self.page_size, self.arch.num_kv_heads, self.arch.head_dim,
                     self.dtype, self.device)
        saved, self.ops.attention = self.ops.attention, self._make_attention(kv)
        items, next_page = [], 1
        for i in range(seqs):
            s = Sequence(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1))
            need = -(-n // self.page_size)
            s.pages = list(range(next_page, next_page + need))
            next_page += need
            items.append(ScheduledSeq(s, 0, n))
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
        if self.device.type != "cuda" or not sizes:
            return
        if not getattr(self.ops.attention, "supports_graphs", False):
            log.warning("CUDA graphs: the %s attention backend cannot be captured; decode runs eagerly",
                        self.backend_names["attention"])
            return
        from moeserve.engine.graphs import DecodeGraphs
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        self.graphs = DecodeGraphs(self, sizes)
        self.graphs.capture(progress=progress)
        torch.cuda.synchronize(self.device)
        self.graph_capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = max(0, free0 - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s; they hold %.0f MiB",
                 len(self.graphs.sizes), self.graphs.sizes, self.graph_capture_seconds, self.graph_memory_bytes / 2**20)

    # --- a step --------------------------------------------------------------------------------
    def sampling_batch(self, items: list[ScheduledSeq]) -> SamplingBatch:
        ps = [it.seq.params for it in items]
        dev = self.device
        gens = []
        for it in items:
            s = it.seq
            if s.params.seed is not None and s.generator is None:
                s.generator = self.sampler.make_generator(s.params.seed)
            gens.append(s.generator)
        return SamplingBatch(
            temperature=to_device([p.temperature for p in ps], torch.float32, dev),
            top_k=to_device([p.effective_top_k for p in ps], torch.int32, dev),
            top_p=to_device([p.top_p for p in ps], torch.float32, dev),
            min_p=to_device([p.min_p for p in ps], torch.float32, dev),
            greedy=[p.greedy for p in ps], seeds=[p.seed for p in ps],
            steps=[it.seq.num_generated for it in items], generators=gens,
            filters=[(p.effective_top_k > 0, p.top_p < 1, p.min_p > 0) for p in ps],
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
    def forward_logits(self, items: list[ScheduledSeq], is_decode: bool,
                       prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of every request in ``items`` that samples this step (float32 ``[S, V]``); ``prev_tokens``
        are the previous step's sampled tokens on the device, for the inputs still in flight."""
        graphs = self.graphs
        if graphs is not None and is_decode and len(items) <= graphs.max_batch_size:
            bucket = graphs.bucket(len(items))
            batch = self.builder.build(items, pad_to=bucket, prev_tokens=prev_tokens)
            self._before_plan()
            logits = graphs.replay(bucket, batch, after_plan=self._after_plan)
            if all(it.samples for it in items):
                return logits[:len(items)]
            return logits[batch.logits_indices.long()]
        batch = self.builder.build(items, prev_tokens=prev_tokens)
        self._before_plan()
        self.ops.attention.begin(batch.attn)
        self._after_plan()
        hidden = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden[batch.logits_indices])

    @torch.no_grad()
    def launch(self, items: list[ScheduledSeq], is_decode: bool, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step on the device and return without waiting for it. Each sampling request's
        ``last_row`` becomes its row in the step's tokens."""
        step = LaunchedStep(items)
        if not items:
            return step
        logits = self.forward_logits(items, is_decode, prev.tokens if prev is not None else None)
        sampling = [it for it in items if it.samples]
        if not sampling:
            return step
        if all(it.seq.params.greedy for it in sampling):  # no per-request tensors to build and copy
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self.sampler.sample(logits, self.sampling_batch(sampling))
        for row, it in enumerate(sampling):
            it.seq.last_row = row
        step.tokens = tokens
        if self.device.type == "cuda":
            step.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            step.host.copy_(tokens, non_blocking=True)
            step.event = torch.cuda.Event()
            step.event.record()
        else:
            step.host = tokens
        return step

    def wait(self, step: LaunchedStep) -> list[int | None]:
        """Block until the step's tokens are on the host; one entry per item, ``None`` where it did not sample."""
        if step.tokens is None:
            return [None] * len(step.items)
        if step.event is not None:
            step.event.synchronize()
        it_tokens = iter(step.host.tolist())
        return [next(it_tokens) if it.samples else None for it in step.items]

    @torch.no_grad()
    def execute(self, items: list[ScheduledSeq], is_decode: bool) -> list[int | None]:
        """Run one step to completion: its sampled token per item (``None`` where it did not sample)."""
        return self.wait(self.launch(items, is_decode))
