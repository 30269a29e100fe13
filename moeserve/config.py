"""The run configuration: one YAML file (or none) plus command-line overrides, validated by pydantic.

Every mistake is reported with the dotted name of the field and what is allowed, e.g.
``config error: backends.moe: 'cutlas' is not a moe backend; choose one of auto, flashinfer, torch, triton``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moeserve.backends import BACKEND_NAMES, OPERATORS
from moeserve.hub import looks_like_hub_id, model_snapshot

PRESET_DIR = Path(__file__).parent / "presets"


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device):
    """The model dtype: ``requested`` unless ``auto``; ``auto`` is float32 on the CPU and the checkpoint's
    16-bit type (bfloat16 unless it says float16) on a GPU."""
    import torch
    if requested != "auto":
        return getattr(torch, requested)  # float32 | bfloat16 | float16 (the field's Literal)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


class ConfigError(ValueError):
    """A configuration problem; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BackendConfig(_Strict):
    """Which implementation runs each operator; ``auto`` picks the best one this machine supports."""

    attention: str = "auto"
    moe: str = "auto"
    routing: str = "auto"
    linear: str = "auto"
    sampling: str = "auto"
    norm: str = "auto"
    rope: str = "auto"
    activation: str = "auto"

    @field_validator(*OPERATORS)
    @classmethod
    def _known(cls, name: str, info):
        op = info.field_name
        allowed = ("auto",) + BACKEND_NAMES[op]
        if name not in allowed:
            raise ValueError(f"{name!r} is not a {op} backend; choose one of {', '.join(sorted(allowed))}")
        return name


class VllmBaselineConfig(_Strict):
    enabled: bool = True
    # Named vLLM configurations to run beside moeserve; see moeserve.bench.vllm_baseline.VLLM_CONFIGS.
    configs: list[str] = Field(default_factory=lambda: ["default", "flashinfer"])
    start_timeout_s: float = Field(900.0, gt=0)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    # With dummy weights: "moeserve" draws vLLM's random weights by moeserve's rule (N(0, initializer_range),
    # unit norms), so both engines run the same kind of random model; "vllm" keeps vLLM's U(-1e-3, 1e-3).
    dummy_init: Literal["moeserve", "vllm"] = "moeserve"


class SharedPrefixConfig(_Strict):
    """The ``shared-prefix`` workload: ``groups`` system prompts of ``prefix_len`` tokens; each of ``requests``
    requests is one of them plus ``suffix_len`` unique tokens, ``output_len`` tokens out, ``c`` in flight."""

    groups: int = Field(8, ge=1)
    prefix_len: int = Field(2048, ge=1)
    suffix_len: int = Field(128, ge=1)
    requests: int = Field(256, ge=1)
    output_len: int = Field(32, ge=2)
    concurrency: list[int] | None = Field(default_factory=lambda: [8, 32])  # None: bench.concurrency


class BenchConfig(_Strict):
    workloads: list[Literal["prefill", "decode", "mixed", "shared-prefix"]] = Field(
        default_factory=lambda: ["prefill", "decode", "mixed"])
    concurrency: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    # "shared-checkpoint": a model without weights gets one random checkpoint written to disk (moeserve's dummy
    # rule, HF names) that every engine loads through its real loader, so all run identical weights;
    # "dummy": each engine draws its own random weights (not a comparison between engines)
    weights: Literal["shared-checkpoint", "dummy"] = "shared-checkpoint"
    checkpoint_dir: str | None = None  # where that checkpoint goes (default <output_dir>/checkpoints/...)
    prompt_len: int = Field(512, ge=1)
    output_len: int = Field(128, ge=2)
    runs: int = Field(3, ge=1)
    warmup_runs: int = Field(1, ge=0)
    seed: int = 0
    # Mixed workload: c requests in flight whose output lengths differ by this many tokens, so they finish
    # at different times; each finished request is replaced by a new prompt until 3*c are done.
    mixed_arrival_every: int = Field(4, ge=1)
    output_dir: str = "bench-results"
    shared_prefix: SharedPrefixConfig = Field(default_factory=SharedPrefixConfig)
    vllm: VllmBaselineConfig = Field(default_factory=VllmBaselineConfig)
    plots: bool = True

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v):
        if not v or any(c < 1 for c in v):
            raise ValueError(f"every concurrency level must be >= 1, got {v}")
        return v


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None
    max_queue_len: int = Field(256, ge=1)
    # a Jinja chat template, inline or a file (vllm serve --chat-template); default: the tokenizer's
    chat_template: str | None = None
    # SIGTERM/Ctrl+C: stop accepting, let running requests finish for up to this long, then exit
    shutdown_timeout: float = Field(30.0, ge=0)


class DistributedConfig(_Strict):
    """How the ranks of a multi-GPU engine find each other (torch.distributed's TCP rendezvous).

    Unset fields fall back to the torchrun variables ``MASTER_ADDR`` / ``MASTER_PORT``, then to this host
    and a free port (one host, workers started by the engine)."""

    master_addr: str | None = None
    master_port: int | None = Field(None, ge=1, le=65535)
    # A collective that waits longer than this fails (NCCL/gloo timeout), so a lost host cannot hang the engine
    timeout_s: float = Field(600.0, gt=0)


class EngineConfig(_Strict):
    """Everything that shapes one engine instance and the jobs run on it."""

    # Each field's description is the help of its command-line flag (moeserve.args derives the flags).
    model: str = Field("tiny", description=f"the model: a preset ({', '.join(preset_names())}), a directory with config.json and *.safetensors, or a Hugging Face model id "
                       "such as Qwen/Qwen1.5-MoE-A2.7B (fetched into the Hugging Face cache, or found there "
                       "offline)")
    revision: str | None = Field(None, description="the branch, tag or commit of a Hugging Face model id "
                                 "(default: main)")
    weights_dir: str | None = Field(None, description="read the *.safetensors weights from this directory "
                                    "instead of the model's")
    load_format: Literal["auto", "dummy", "safetensors"] = Field(
        "auto", description="auto reads the model's *.safetensors files (a preset, which has none, gets random "
        "weights); dummy draws random weights of the right shapes; safetensors insists on the files")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="model and KV-cache dtype; auto is float32 on the CPU and the checkpoint's 16-bit "
        "type (bfloat16 unless it says float16) on a GPU")
    device: str = Field("auto", description="auto (the first GPU, else the CPU), cpu, cuda or cuda:N")
    gpu_arch: str | None = Field(None, description="refuse to start unless the GPU is this architecture "
                                 "(e.g. 9.0a)")
    quantization: Literal["none", "fp8"] = Field(
        "none", description="fp8: 128x128 block-scaled FP8 weights (an FP8 checkpoint is read as it is, a 16-bit "
        "one is quantised while loading); none keeps the checkpoint's format")
    kv_cache_dtype: Literal["auto", "fp8"] = Field("auto", description="KV-cache dtype; auto is the model dtype")
    seed: int = Field(0, description="seed of random weights and of requests sampled without their own seed")

    max_num_seqs: int = Field(256, ge=1, description="most requests running at once")
    enable_prefix_caching: bool = Field(True, description="reuse the KV pages of prompt prefixes already computed "
                                        "(automatic prefix caching)")
    max_num_batched_tokens: int = Field(8192, ge=1, description="most tokens in one step (a longer prompt is "
                                        "prefilled in chunks)")
    max_model_len: int | None = Field(None, ge=2, description="the longest context (prompt + output) a request "
                                      "may reach (default: the model's max_position_embeddings)")
    page_size: int = Field(16, ge=1, description="tokens per KV-cache page")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="the fraction of the GPU's memory "
                                          "this engine may use (weights, activations and KV cache); memory other "
                                          "processes hold is not counted against it, as in vLLM")
    kv_cache_gb: float | None = Field(None, gt=0, description="KV-cache size in GiB (default: what "
                                      "gpu_memory_utilization leaves)")
    num_kv_pages: int | None = Field(None, ge=1, description="KV-cache size in pages (overrides kv_cache_gb)")

    kernel_cache_dir: str | None = Field(
        None, description="a kernel cache made by moeserve precompile: its FlashInfer modules (used as "
        "FLASHINFER_WORKSPACE_BASE) and its Triton kernels (its triton/ folder becomes Triton's cache)")
    allow_jit: bool = Field(
        True, description="false: a FlashInfer module or Triton kernel missing from the kernel cache is refused by "
        "name at start and never compiled inside a request; true: it compiles on first use, logged")

    cuda_graph_batch_sizes: list[int] | None = Field(
        None, description="decode batch sizes to capture as CUDA graphs (default: 1 2 4 8 16 32 ... 256, up to "
        "max_num_seqs)")
    prefill_graph_max_tokens: int = Field(
        2048, ge=0, description="steps that decode graphs do not cover (prefill chunks, mixed steps) of at most this "
        "many tokens replay CUDA graphs of the layers between attentions, captured at fixed token counts (the step "
        "padded up to the next), the attention running eagerly between them, as vLLM's piecewise graphs; one GPU; "
        "0 runs them eagerly")
    prefill_graph_token_sizes: list[int] | None = Field(
        None, description="the token counts of the piecewise graphs (default: 16 to 128 by 16, to 512 by 64, to "
        "2048 by 256, then by 512, up to prefill_graph_max_tokens and max_num_batched_tokens, which closes the list)")
    enforce_eager: bool = Field(False, description="run every step eagerly: no CUDA graphs")
    torch_compile: bool = Field(False, description="torch.compile each layer's MoE block")
    # vLLM's --async-scheduling, SGLang's overlap scheduler
    async_scheduling: bool = Field(True, description="schedule and launch the next step while the GPU runs the "
                                   "current one (its tokens reach the host one step later)")
    attention_fused_qkv: bool = Field(
        True, description="FlashInfer attention on a GPU: the q/k norms, rotary embedding and KV-cache append of a "
        "layer in one Triton kernel from the QKV projection (false: the rope and norm backends and FlashInfer's "
        "append, three to seven launches)")
    attention_decode_triton_max_tokens: int = Field(
        32, ge=0, le=256, description="with the fused QKV path (attention_fused_qkv): decode steps of at most this "
        "many tokens run the q/k norms, rotary embedding, KV append and split-KV attention (its splits merged "
        "in the kernel) as one Triton kernel instead of the QKV kernel and FlashInfer's decode (Qwen1.5-MoE on an "
        "H200, 32: 0.6 to 1.8 percent faster at c = 1, 4 and 32, 0.4 slower at c=16); 0 never")
    attention_decode_triton_max_context: int = Field(
        1024, ge=1, description="the one-kernel Triton decode attention (attention_decode_triton_max_tokens) only "
        "for decode steps whose longest request holds at most this many tokens; longer ones run FlashInfer's "
        "decode (Qwen1.5-MoE's attention on an H200, one to 32 requests: at 1,024 tokens the Triton kernel was 1 to "
        "6 percent faster except at four requests, 6 percent slower; at 2,048 up to 9 percent slower; at 4,096 and "
        "more 10 to 29 percent slower at one to four requests); the decode CUDA graphs of those step sizes are "
        "captured both ways")
    attention_layer_kernel: bool = Field(
        False, description="one-token decode steps on the one-kernel Triton decode path (attention_decode_triton_max_"
        "tokens, one GPU, unquantised bf16/fp16 linears) run each layer's residual add and norm, QKV projection, "
        "attention, output projection, residual add and post-attention norm and the router's GEMM in one "
        "persistent Triton kernel, one program per SM with grid-wide barriers between its phases; false: those "
        "six or more kernels one after another")
    # vLLM's VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD
    shared_expert_stream_max_tokens: int = Field(
        256, ge=0, description="steps of at most this many tokens run the shared expert on a second CUDA stream, "
        "beside routing and the routed experts; 0 runs it in line")
    shared_expert_stream_priority: Literal["equal", "shared", "routed"] = Field(
        "equal", description="with the shared expert on its own stream: which path's kernels the GPU schedules first "
        "in the decode CUDA graphs of at most shared_expert_stream_priority_max_tokens tokens (shared: the shared "
        "expert's stream has the higher priority; routed: the main stream's, the routing and routed experts)")
    shared_expert_stream_priority_max_tokens: int = Field(
        1024, ge=0, description="decode CUDA graphs of at most this many tokens are captured with "
        "shared_expert_stream_priority; larger ones, and steps outside the graphs, give both streams one priority")
    moe_pairwise_max_tokens: int = Field(
        16, ge=0, le=64, description="Triton MoE: steps of at most this many tokens skip the expert alignment "
        "kernel: one row tile per (token, expert) pair, and in steps of several tokens the tile of each "
        "expert's first pair takes every token routed to that expert (the others end at once); the tile is as tall "
        "as the step, and above 16 tokens that was slower than aligning on an H200; 0 always aligns")
    router_split_k_max_tokens: int = Field(
        64, ge=0, le=64, description="fused (Triton) softmax/Llama-4 routing: steps of at most this many tokens run "
        "the router's GEMM as moeserve's split-K kernel, its partial sums added by the routing kernel (cuBLAS runs "
        "this narrow GEMM on one or two thread blocks); 0 leaves it to the linear backend")
    router_fuse_norm: bool = Field(
        False, description="fused (Triton) softmax/Llama-4 routing, one GPU: steps of at most 16 tokens that run the "
        "router's GEMM as split-K partial sums (router_split_k_max_tokens) also fold the post-attention residual add "
        "and norm into them, one launch per MoE layer fewer")
    # FlashInfer's enable_pdl (its own kernels default to it on Hopper), for moeserve's kernels and by step size
    pdl_max_tokens: int = Field(
        64, ge=0, description="GPUs of compute capability 9.0 and later: steps of at most this many tokens launch "
        "moeserve's Triton kernels with programmatic dependent launch, each scheduled while the kernel before it "
        "finishes (it waits for that kernel's results on the GPU); 0 launches them one after the other")
    moe_fuse_shared_expert: bool = Field(
        False, description="run the shared expert inside the fused MoE as always-chosen experts (its intermediate "
        "rows cut into moe_intermediate_size pieces, weighted by its gate): no separate shared-expert GEMMs or "
        "side stream; one GPU, unquantised weights")
    moe_fuse_shared_expert_pieces: int = Field(
        0, ge=0, description="where the shared expert runs in the fused MoE, how many of those pieces join the routed "
        "experts; the "
        "shared expert's other rows stay a smaller shared expert beside them (on the side stream), so that the "
        "fused MoE and the shared expert's GEMMs can be given even shares of the work; 0 all of them")
    moe_fuse_shared_expert_max_tokens: int = Field(
        1, ge=0, description="steps of at most this many tokens run the shared expert inside the fused MoE, as "
        "moe_fuse_shared_expert does for every step, where it applies (a shared expert, unquantised experts, one "
        "GPU, the Triton or torch MoE, no torch_compile); larger steps run it apart, beside the routed experts, so "
        "its weights are held twice; 0 none (on an H200 the fused MoE was faster at one token, slower at two)")
    moe_fused_shared_early: bool = Field(
        True, description="one-token steps that run the shared expert inside the Triton MoE (with PDL): the first "
        "expert GEMM's tiles of the shared expert come first and stream their weights while the routing still runs, "
        "as they need only the layer's input; false: every tile waits for the routing")
    moe_route_in_grid: bool = Field(
        True, description="one-token steps that run the shared expert inside the Triton MoE with fused (Triton) "
        "routing, with moe_fused_shared_early: the router's GEMM and the routing run in the first expert GEMM's grid, "
        "whose shared-expert tiles start with it and whose routed tiles wait for the routing on a flag; false: three "
        "kernels (router, routing, expert GEMM)")
    moe_fuse_norm: bool = Field(
        False, description="Triton MoE on unquantised experts, one GPU: the MoE combine also adds the block's output "
        "to the residual and applies the next layer's input norm (or the final norm), one launch per layer fewer, "
        "at every step size")
    moe_fuse_norm_max_tokens: int = Field(
        0, ge=0, description="moe_fuse_norm for steps of at most this many tokens only (the fused combine is one "
        "program per token: slower than the plain combine and the norm at 2 to 32 tokens on an H200); 0 none")
    moe_fuse_norm_in_grid: bool = Field(
        True, description="one-token steps whose routing runs in the fused MoE's grid (moe_route_in_grid) fold the "
        "residual add and the next norm into the MoE's combine, which the down GEMM's last program runs (with its "
        "weights loaded before it waits: +0.8% at c=1 on an H200)")
    linear_gemv_max_tokens: int = Field(
        1, ge=0, le=16, description="with backends.linear: triton, steps of at most this many tokens run moeserve's "
        "Triton GEMV instead of cuBLAS (on an H200 it was faster at one token, slower at two); 0 always runs cuBLAS")
    norm_triton_max_tokens: int = Field(
        64, ge=0, le=1024, description="with backends.norm: flashinfer on a GPU, the residual add + RMSNorm of steps "
        "of at most this many tokens runs moeserve's Triton kernel, which lets the next kernel start (PDL) as soon "
        "as it runs where FlashInfer's lets it start only at its end (on an H200 decode was faster with it at c=1, 8 "
        "and 32); 0 always runs FlashInfer's")
    generation_config: str = Field(
        "auto", description="request defaults (temperature, top_p, top_k, min_p): auto reads the model "
        "directory's generation_config.json, vllm uses none, a directory reads that one's")

    # Parallelism over the GPUs of one host (or several, launched by torchrun), as vLLM's flags: one process
    # per GPU.
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs to split the model over (one process each): attention heads, dense and "
        "shared-expert MLPs, embeddings, the LM head and the routed experts (along their intermediate size)")
    enable_expert_parallel: bool = Field(
        False, description="place whole routed experts on each tensor-parallel rank instead of slicing every expert")
    # allreduce is vLLM's behaviour without data parallelism; allgather_reducescatter its default all2all backend
    expert_parallel_dispatch: Literal["auto", "allreduce", "allgather_reducescatter"] = Field(
        "auto", description="how an expert-parallel layer reaches other ranks' experts: allreduce (every rank holds "
        "every token; local experts, one all-reduce) or allgather_reducescatter (each rank brings its share of the "
        "tokens); auto is allreduce")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    backends: BackendConfig = Field(default_factory=BackendConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError(f"{v!r} is not a device; use auto, cpu, cuda or cuda:N")

    @field_validator("gpu_arch")
    @classmethod
    def _arch(cls, v):
        if v is None:
            return v
        core = v.rstrip("af")
        parts = core.split(".")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"{v!r} is not a GPU architecture; write it like 9.0a or 8.9")
        return v

    @field_validator("cuda_graph_batch_sizes", "prefill_graph_token_sizes")
    @classmethod
    def _graph_sizes(cls, v):
        if v is None:
            return v
        if any(b < 1 for b in v):
            raise ValueError(f"batch sizes must be >= 1, got {v}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _model_known(self):
        if looks_like_hub_id(self.model) and not Path(self.model).expanduser().exists():
            return self  # a hub id: looked up (and fetched) when the engine resolves its plan
        resolve_model_source(self.model, self.weights_dir)
        return self

    @model_validator(mode="after")
    def _parallel(self):
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"device: {self.device!r} names one GPU but tensor_parallel_size is "
                             f"{self.tensor_parallel_size}; use device: cuda (rank r runs on cuda:LOCAL_RANK; pick "
                             "the GPUs with CUDA_VISIBLE_DEVICES)")
        if self.torch_compile and self.tensor_parallel_size > 1:
            raise ValueError("torch_compile: not supported with tensor_parallel_size > 1 yet (the compiled MoE blocks "
                             "would hold collectives); CUDA graphs still capture every decode step")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel: needs tensor_parallel_size > 1 (the experts are split across "
                             "the tensor-parallel ranks)")
        return self

    # --- derived values -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Processes (GPUs) one engine runs on."""
        return self.tensor_parallel_size

    def graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes to capture as CUDA graphs, bounded by max_num_seqs."""
        if self.enforce_eager:
            return []
        sizes = self.cuda_graph_batch_sizes
        if sizes is None:
            sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
        return [b for b in sizes if b <= self.max_num_seqs] or ([self.max_num_seqs] if sizes else [])

    def prefill_graph_sizes(self) -> list[int]:
        """Token counts of the piecewise CUDA graphs of steps the decode graphs do not cover (none without CUDA
        graphs, with torch_compile or on several GPUs)."""
        bound = min(self.prefill_graph_max_tokens, self.max_num_batched_tokens)
        if self.enforce_eager or self.torch_compile or self.world_size > 1 or bound == 0:
            return []
        sizes = self.prefill_graph_token_sizes
        if sizes is not None:
            return [t for t in sizes if t <= bound]
        sizes = [t for t in default_prefill_graph_sizes(bound) if t < bound]
        return sizes + [bound]


def default_prefill_graph_sizes(up_to: int) -> list[int]:
    """16 to 128 by 16, to 512 by 64, to 2048 by 256, then by 512, up to ``up_to``."""
    sizes, t = [], 16
    while t <= up_to:
        sizes.append(t)
        t += 16 if t < 128 else 64 if t < 512 else 256 if t < 2048 else 512
    return sizes


class ModelSource(BaseModel):
    """Where a model's architecture and weights come from."""

    name: str
    config: dict[str, Any]
    config_dir: str | None  # directory holding config.json (and maybe a tokenizer), when there is one
    weights_dir: str | None  # directory with *.safetensors, when there are weights


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(config_dir: str | None) -> bool:
    """Whether the model's directory holds a Hugging Face tokenizer (text prompts need one)."""
    return config_dir is not None and any((Path(config_dir) / f).is_file() for f in TOKENIZER_FILES)


def _has_safetensors(d: Path) -> bool:
    return any(d.glob("*.safetensors"))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model: {str(path)!r} is not a readable JSON file: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"model: {str(path)!r} must hold a JSON object, not {type(cfg).__name__}")
    return cfg


def _from_directory(name: str, d: Path, shown: str) -> ModelSource:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"model: directory {shown!r} has no config.json")
    return ModelSource(name=name, config=_read_config(cfg_path), config_dir=str(d),
                       weights_dir=str(d) if _has_safetensors(d) else None)


def resolve_model_source(model: str, weights_dir: str | None = None, revision: str | None = None) -> ModelSource:
    """Turn ``model`` (a preset name, a directory with config.json, a config.json path, or a Hugging Face hub
    id such as ``Qwen/Qwen1.5-MoE-A2.7B``) into a ModelSource. A hub id is looked up in the local Hugging Face
    cache and fetched from the hub first where it can be reached (``revision``: branch, tag or commit)."""
    p = Path(model).expanduser()
    if model in preset_names():
        cfg = json.loads((PRESET_DIR / f"{model}.json").read_text())
        src = ModelSource(name=model, config=cfg, config_dir=None, weights_dir=None)
    elif p.is_dir():
        src = _from_directory(p.name, p, model)
    elif p.is_file() and p.suffix == ".json":
        src = ModelSource(name=p.stem, config=_read_config(p), config_dir=str(p.parent), weights_dir=None)
    elif looks_like_hub_id(model):
        src = _from_directory(model, model_snapshot(model, revision), model)
    else:
        raise ValueError(
            f"model: {model!r} is neither a preset ({', '.join(preset_names())}), a directory with config.json, "
            "a config.json file nor a Hugging Face model id (org/name)"
        )
    if weights_dir is not None:
        w = Path(weights_dir).expanduser()
        if not w.is_dir() or not _has_safetensors(w):
            raise ValueError(f"weights_dir: {weights_dir!r} is not a directory with *.safetensors files")
        src.weights_dir = str(w)
    return src


# --- loading and overriding ---------------------------------------------------------------------

def _format_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"] if x != "__root__")
        msg = err["msg"]
        for prefix in ("Value error, ", "Assertion failed, "):
            if msg.startswith(prefix):
                msg = msg[len(prefix):]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "literal_error":
            msg = f"{err['input']!r} is not allowed; {msg.lower()}"
        elif "input" in err and err["type"].endswith("_type") or err["type"].endswith("_parsing"):
            msg = f"{msg} (got {err.get('input')!r})"
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "config error: " + "; ".join(lines)


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        nxt = cur.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"config error: {dotted}: {k} is not a section")
        cur = nxt
    cur[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` with value parsed as YAML (so 1, 0.5, true, [1, 8] and plain strings all work)."""
    if "=" not in text:
        raise ConfigError(f"config error: override {text!r} must look like field=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Read a YAML config (optional), apply ``{dotted.field: value}`` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config error: file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config error: {path} is not valid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config error: {path} must hold a mapping of fields, not {type(loaded).__name__}")
        data = loaded
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def make_config(**fields: Any) -> EngineConfig:
    """Build a config from keyword fields (nested sections as dicts), with the same error messages."""
    try:
        return EngineConfig.model_validate(fields)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None
