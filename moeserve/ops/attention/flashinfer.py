"""FlashInfer paged attention: one ``plan()`` per step outside any graph, then ``run()`` in every layer.

- Steps that are all decodes use ``BatchDecodeWithPagedKVCacheWrapper`` (tensor-core decode, which reuses
  the prefill kernels, when the GQA group is 4 or more; CUDA-core decode otherwise).
- Any step with a prefill chunk, mixed with decodes or not, uses one causal
  ``BatchPrefillWithPagedKVCacheWrapper`` plan over all its requests (FA3 on sm90), which also covers
  chunked prefill over earlier pages.
- Decode steps of at most ``attention_decode_triton_max_tokens`` tokens (32 by default) instead run the
  QKV kernel's work, the attention and the merge of its splits in one Triton kernel
  (``moeserve.ops.attention.decode_triton``) where it has programs enough for the GPU's SMs and the longest
  request holds at most ``attention_decode_triton_max_context`` tokens (``DecodeWorkspace.serves``; the decode
  graphs of those sizes are captured both ways, ``graph_variants``); FlashInfer still plans them (its fixed
  index buffers are what the kernel reads in CUDA graphs).
- New keys and values go in through ``flashinfer.page.append_paged_kv_cache``, or, from the QKV projection
  whole (``forward_qkv``), through one Triton kernel that also applies the q/k norms and the rotary embedding
  (``moeserve.ops.attention.qkv_triton``).
- CUDA graphs: each captured decode batch size gets its own decode wrapper with fixed index buffers;
  ``begin_graph`` plans it and copies the step's positions into the fixed buffers before replay.
- Piecewise CUDA graphs (prefill and mixed steps): while the engine captures the layers between attentions,
  ``split`` is set and ``forward_qkv`` writes q into the split's fixed buffer and hands it to the split instead
  of running the attention; at replay the engine calls ``run_layer`` between the pieces, eagerly, on the plan
  of ``begin``.

``plan()`` defaults to fp16 queries and non-causal masks; both are set explicitly here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.kernel_cache import flashinfer_env  # noqa: F401
from moeserve.kernel_cache.modules import DECODE_GEN, PREFILL_GEN, KernelModule, Target, dtype_arg, short_dtype
from moeserve.ops.attention import AttentionInputs, AttentionSplit, decode_kernel_takes_rotary
from moeserve.ops.eager import eager
from moeserve.ops.interfaces import AttentionBackend
from moeserve.ops.kv_cache import KVCache

WORKSPACE_BYTES = 256 << 20


@dataclass
class _GraphBuffers:
    wrapper: object
    inputs: AttentionInputs  # device tensors here are the fixed buffers the graph reads


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    supports_graphs = True

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 device: torch.device, dtype: torch.dtype, use_tensor_cores: bool | None = None,
                 prefill_backend: str = "auto", **_):
        import flashinfer
        from flashinfer.page import append_paged_kv_cache
        self._fi = flashinfer
        self._append = append_paged_kv_cache
        # the one-kernel QKV path (moeserve.ops.attention.qkv_triton) writes the cache in the model's dtype
        self.fuse_qkv = kv_cache.dtype == dtype and device.type == "cuda"
        if self.fuse_qkv:
            from moeserve.ops.attention.qkv_triton import qkv_rope_append
            self._qkv_rope_append = qkv_rope_append
        self.kv = kv_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_cache.dtype
        self.use_tensor_cores = (num_heads // num_kv_heads >= 4) if use_tensor_cores is None else use_tensor_cores
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        self.graphs: dict[int, _GraphBuffers] = {}
        self.inp: AttentionInputs | None = None
        self.wrapper = None
        self.split: AttentionSplit | None = None  # set while the engine captures piecewise CUDA graphs
        self.decode_ws = None  # with enable_triton_decode: decode steps of few tokens in one Triton kernel
        self.decode_variant = "flashinfer"  # how this step's decode runs: "triton" (decode_ws) or "flashinfer"
        self._qkv_gemv = None  # with enable_triton_decode: moeserve.ops.attention.qkv_gemv_triton
        self.layer_ws = None  # with enable_layer_kernel: one-token steps' attention half in one kernel

    def enable_triton_decode(self, max_tokens: int, rotary_dim: int, max_context: int | None = None) -> bool:
        """Run decode steps of at most ``max_tokens`` tokens whose longest request holds at most ``max_context``
        tokens through ``moeserve.ops.attention.decode_triton`` (QKV kernel, attention and merge in one launch)
        where it applies: the fused QKV path and a rotary width that is the head or at least 16 short of it.
        Returns whether it is on."""
        d = self.head_dim
        if max_tokens <= 0 or not self.fuse_qkv or not decode_kernel_takes_rotary(d, rotary_dim):
            self.decode_ws = None
            return False
        from moeserve.ops.attention import qkv_gemv_triton
        from moeserve.ops.attention.decode_triton import DecodeWorkspace, qkv_decode_attention
        self._qkv_decode = qkv_decode_attention
        self._qkv_gemv = qkv_gemv_triton
        self.decode_ws = DecodeWorkspace(max_tokens, self.num_heads, self.num_kv_heads, d, self.device,
                                         max_context=max_context)
        return True

    def enable_layer_kernel(self, hidden: int) -> bool:
        """One-token decode steps on the Triton decode path may run a layer's attention half in one persistent
        kernel (``moeserve.ops.attention.layer_triton``; the layer asks :meth:`takes_layer_kernel`). Needs
        :meth:`enable_triton_decode` first and a program per kv head. Returns whether it is on."""
        if self.decode_ws is None:
            return False
        from moeserve.ops.attention.layer_triton import LayerWorkspace, attention_half
        ws = LayerWorkspace(hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        if not ws.serves(self.num_kv_heads):
            return False
        self.layer_ws, self._attention_half = ws, attention_half
        return True

    def takes_layer_kernel(self, tokens: int) -> bool:
        """Whether this step runs the attention half in one kernel: a one-token decode step on the Triton decode
        path (not inside a piecewise capture)."""
        return (tokens == 1 and self.layer_ws is not None and self.decode_variant == "triton" and self.split is None
                and self.inp is not None and self.inp.is_decode)

    @eager  # a custom kernel launch: torch.compile runs it eagerly
    def attention_half(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor, norm1: torch.Tensor,
                       w_qkv: torch.Tensor, b_qkv: torch.Tensor | None, w_o: torch.Tensor, norm2: torch.Tensor,
                       eps: float, positions: torch.Tensor, cos_sin: torch.Tensor, q_norm: torch.Tensor | None,
                       k_norm: torch.Tensor | None, router: torch.Tensor | None):
        """``(post-attention norm, router partial sums or None)`` of a one-token step's layer ``layer``;
        ``residual`` updated in place (:func:`moeserve.ops.attention.layer_triton.attention_half`)."""
        inp = self.inp
        if router is not None and not self.layer_ws.takes_router(router.shape[0]):
            router = None  # more router rows than programs: the MoE block computes its logits
        return self._attention_half(hidden, residual, norm1, w_qkv, b_qkv, w_o, norm2, eps, positions, cos_sin,
                                    self.num_heads, self.num_kv_heads, self.head_dim, self.kv.layer(layer),
                                    inp.token_positions, inp.kv_indices, inp.kv_indptr, q_norm, k_norm, eps,
                                    self.scale, self.layer_ws, router=router)

    def _decode_variant(self, tokens: int, inp: AttentionInputs) -> str:
        ws = self.decode_ws
        if ws is None or not inp.is_decode:
            return "flashinfer"
        return "triton" if ws.serves(tokens, max(inp.seq_lens, default=0)) else "flashinfer"

    @property
    def supports_piecewise(self) -> bool:
        """The one-kernel QKV path can be cut before the attention (``split``)."""
        return self.fuse_qkv

    # --- eager steps ---------------------------------------------------------------------------
    def _plan_decode(self, wrapper, inp: AttentionInputs) -> None:
        wrapper.plan(inp.kv_indptr_host, inp.kv_indices, inp.kv_last_page_len_host, self.num_heads,
                     self.num_kv_heads, self.head_dim, self.kv.page_size, q_data_type=self.dtype,
                     kv_data_type=self.kv_dtype, sm_scale=self.scale, non_blocking=True)

    def begin(self, inp: AttentionInputs) -> None:
        self.inp = inp
        self.decode_variant = self._decode_variant(inp.num_tokens, inp)
        if inp.is_decode:
            self._plan_decode(self.decode, inp)
            self.wrapper = self.decode
        else:
            self.prefill.plan(inp.qo_indptr_host, inp.kv_indptr_host, inp.kv_indices, inp.kv_last_page_len_host,
                              self.num_heads, self.num_kv_heads, self.head_dim, self.kv.page_size, causal=True,
                              q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.scale,
                              non_blocking=True)
            self.wrapper = self.prefill

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv.layer(layer)
        inp = self.inp
        self._append(k, v, inp.batch_indices, inp.token_positions, cache, inp.kv_indices, inp.kv_indptr,
                     inp.kv_last_page_len, kv_layout="NHD")
        return self.wrapper.run(q, cache)

    def forward_qkv(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        cache = self.kv.layer(layer)
        inp = self.inp
        split = self.split
        if self.decode_variant == "triton" and split is None and inp.is_decode:
            return self._qkv_decode(qkv, positions, cos_sin, self.num_heads, self.num_kv_heads, self.head_dim, cache,
                                    inp.token_positions, inp.kv_indices, inp.kv_indptr, q_norm, k_norm, eps,
                                    self.scale, self.decode_ws)
        q = self._qkv_rope_append(qkv, positions, cos_sin, self.num_heads, self.num_kv_heads, self.head_dim, cache,
                                  inp.batch_indices, inp.token_positions, inp.kv_indices, inp.kv_indptr,
                                  q_norm, k_norm, eps, out=None if split is None else split.q[:qkv.shape[0]])
        if split is not None:
            return split.attend(layer, q)
        return self.wrapper.run(q, cache)

    def forward_qkv_gemv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         positions: torch.Tensor, cos_sin: torch.Tensor, q_norm: torch.Tensor | None,
                         k_norm: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """One-token steps on the Triton decode path with ``qkv_gemv_triton.QKV_IN_GRID``: the QKV GEMV and the
        decode attention in one grid (``moeserve.ops.attention.qkv_gemv_triton``), where it takes the weight."""
        qg, inp = self._qkv_gemv, self.inp
        if not (qg is not None and qg.QKV_IN_GRID and self.decode_variant == "triton" and self.split is None
                and inp is not None and inp.is_decode and x.shape[0] == 1 and x.is_cuda):
            return None
        if qg.unsupported_reason(x, weight, bias, self.num_heads, self.num_kv_heads, self.head_dim, cos_sin,
                                 self.decode_ws) is not None:
            return None
        return self._qkv_gemv_attention(layer, x, weight, bias, positions, cos_sin, q_norm, k_norm, eps)

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def _qkv_gemv_attention(self, layer, x, weight, bias, positions, cos_sin, q_norm, k_norm, eps):
        inp = self.inp
        return self._qkv_gemv.qkv_gemv_decode_attention(
            x, weight, bias, positions, cos_sin, self.num_heads, self.num_kv_heads, self.head_dim, self.kv.layer(layer),
            inp.token_positions, inp.kv_indices, inp.kv_indptr, q_norm, k_norm, eps, self.scale, self.decode_ws)

    def run_layer(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """The attention of ``layer`` for the queries ``q`` (their keys and values already in the cache) into
        ``out``, on the plan of the last ``begin``."""
        self.wrapper.run(q, self.kv.layer(layer), out=out)

    # --- CUDA-graph decode ---------------------------------------------------------------------
    def init_graph(self, batch_size: int, max_pages_per_seq: int) -> None:
        """Fixed buffers and a graph-mode decode wrapper for one captured batch size."""
        dev = self.device
        indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        indices = torch.zeros(batch_size * max_pages_per_seq, dtype=torch.int32, device=dev)
        last = torch.ones(batch_size, dtype=torch.int32, device=dev)
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        empty = torch.empty(0, dtype=torch.int32)
        inputs = AttentionInputs(
            num_seqs=batch_size, num_tokens=batch_size, query_lens=[1] * batch_size, seq_lens=[1] * batch_size,
            is_decode=True, qo_indptr_host=empty, kv_indptr_host=empty, kv_indices_host=empty,
            kv_last_page_len_host=empty,
            qo_indptr=torch.arange(batch_size + 1, dtype=torch.int32, device=dev),
            kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
            slot_mapping=torch.zeros(batch_size, dtype=torch.int64, device=dev),
            batch_indices=torch.arange(batch_size, dtype=torch.int32, device=dev),
            token_positions=torch.zeros(batch_size, dtype=torch.int32, device=dev),
        )
        self.graphs[batch_size] = _GraphBuffers(wrapper, inputs)

    def graph_variants(self, batch_size: int) -> tuple[str, ...]:
        """Both ways for step sizes the Triton decode serves (which one replays depends on the step's longest
        request, ``attention_decode_triton_max_context``); FlashInfer's decode for the others."""
        ws = self.decode_ws
        return ("triton", "flashinfer") if ws is not None and ws.serves(batch_size) else ("flashinfer",)

    def begin_graph(self, batch_size: int, inp: AttentionInputs, variant: str | None = None,
                    copies: list | None = None) -> str:
        """Plan the captured wrapper for this step (``inp`` already padded to ``batch_size``); returns the graph
        variant it replays (``variant``, when given, at capture).

        With ``copies`` (a list), the step's positions go to the caller's copy, and a step of the Triton decode,
        whose kernel reads only the positions, ``kv_indptr`` and ``kv_indices``, is not planned: those two go there
        too. FlashInfer's plan of a graph's wrapper copies its index lists into the fixed buffers and its plan
        into the workspace, four copies on the step's stream (three from the host) that a replay of the Triton
        decode does not read."""
        g = self.graphs[batch_size]
        self.decode_variant = variant or self._decode_variant(batch_size, inp)
        fixed = g.inputs
        if copies is None:
            self._plan_decode(g.wrapper, inp)
            fixed.token_positions.copy_(inp.token_positions, non_blocking=True)
        else:
            if self.decode_variant != "triton":
                self._plan_decode(g.wrapper, inp)
            else:
                if inp.kv_indices.shape[0] > fixed.kv_indices.shape[0]:
                    raise ValueError(f"a decode step of {batch_size} requests lists {inp.kv_indices.shape[0]} "
                                     f"pages, more than its graph's {fixed.kv_indices.shape[0]}")
                copies += [(inp.kv_indptr, fixed.kv_indptr), (inp.kv_indices, fixed.kv_indices)]
            copies.append((inp.token_positions, fixed.token_positions))
        self.inp = fixed
        self.wrapper = g.wrapper
        return self.decode_variant


# --- the FlashInfer modules this backend loads (for ahead-of-time builds) ------------------------------

def _is_16bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def prefill_backend(t: Target) -> str:
    """What FlashInfer's ``determine_attention_backend`` picks for moeserve's causal, mask-free, RoPE-free
    prefill: FA3 on sm90 unless the KV cache is fp8 under a 16-bit query, FA2 elsewhere."""
    fp8_kv_16bit_q = not _is_16bit(t.kv_dtype) and _is_16bit(t.dtype)
    return "fa3" if t.arch.major == 9 and not fp8_kv_16bit_q else "fa2"


def _attention_args(t: Target) -> tuple:
    # q, kv, o dtypes, index dtype, head_dim_qk, head_dim_vo, pos_encoding_mode (none), use_sliding_window,
    # use_logits_soft_cap
    return (dtype_arg(t.dtype), dtype_arg(t.kv_dtype), dtype_arg(t.dtype), "torch.int32", t.head_dim, t.head_dim,
            0, False, False)


def flashinfer_modules(t: Target) -> list[KernelModule]:
    """Paged prefill, decode (tensor-core decode reuses an FA2 prefill module when the GQA group is >= 4),
    and the KV append kernel (``page``)."""
    dt, hd = short_dtype(t.dtype), t.head_dim
    backend = prefill_backend(t)
    mods = [KernelModule("prefill", "attention", "flashinfer", f"paged prefill {backend} {dt} hd{hd}", PREFILL_GEN,
                         (backend,) + _attention_args(t) + (False,), weight=60 if backend == "fa3" else 40)]
    if t.num_heads // t.num_kv_heads >= 4:
        if backend != "fa2":
            mods.append(KernelModule("decode", "attention", "flashinfer", f"tensor-core decode (fa2 prefill) {dt} hd{hd}",
                                     PREFILL_GEN, ("fa2",) + _attention_args(t) + (False,), weight=40))
    else:
        mods.append(KernelModule("decode", "attention", "flashinfer", f"decode {dt} hd{hd}", DECODE_GEN,
                                 _attention_args(t), weight=10))
    mods.append(KernelModule("page", "attention", "flashinfer", "paged KV append", "flashinfer.jit.page:gen_page_module",
                             weight=5))
    return mods
