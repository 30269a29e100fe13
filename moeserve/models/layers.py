"""The building blocks every MoE family shares: attention, dense MLP, sparse MoE block, decoder layer, LM.

Each block computes through the operator backends in ``Ops`` and lists the checkpoint tensors it
expects (Hugging Face names) with where each one lands, so the weight loader needs no per-model code.
q/k/v are merged into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (gate rows first) so each is
one GEMM; the experts of a layer are stacked into ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``.

With several ranks (``Ops.parallel``) each block holds its part of the model and lists the part of each
checkpoint tensor it reads (``Entry.shard``; see ``moeserve.models.parallel``); row-parallel linears end in an
all-reduce. On one rank nothing of that runs.

With ``Ops.quantization == "fp8"`` the dense linears (q/k/v/o, dense and shared-expert MLPs) and the routed
experts hold ``float8_e4m3fn`` weights with float32 128x128 block scales (``weight_scale_inv``,
``w13_scale_inv``, ``w2_scale_inv``); embeddings, LM head, router and norms stay in the model dtype.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moeserve.models.arch import ArchConfig
from moeserve.models.base import Entry, Linear, Ops, empty_param, is_fp8_ops, tp_shard
from moeserve.models.parallel import MoEParallel, Shard, local_experts, local_heads, padded_vocab
from moeserve.ops.moe.combine import AddNorm, SharedExpertOutput
from moeserve.ops.moe.routing import append_shared, select_experts
from moeserve.ops.moe.routing_config import RouterPartials
from moeserve.quant.fp8 import FP8_DTYPE, block_scale_shape
from moeserve.quant.moe_ref import experts_fp8_reference


class Attention(nn.Module):
    def __init__(self, ops: Ops, arch: ArchConfig, layer_idx: int, rope, dtype, device):
        super().__init__()
        self.ops, self.layer_idx, self.rope = ops, layer_idx, rope
        self.num_heads, self.num_kv_heads, self.kv_shard = local_heads(arch, ops.parallel)  # this rank's heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.eps = arch.rms_norm_eps
        self.qkv_proj = Linear(ops, arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias, dtype, device,
                               quantize=True)
        self.o_proj = Linear(ops, self.q_size, arch.hidden_size, arch.o_bias, dtype, device, quantize=True,
                             reduce=True)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = empty_param((arch.head_dim,), dtype, device)
            self.k_norm = empty_param((arch.head_dim,), dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        attn = self.ops.attention
        if attn.fuse_qkv:  # norms, rotary embedding and KV append in one kernel
            qn, kn = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
            o = None
            if self.qkv_proj.weight_scale_inv is None:  # the projection and the attention in one launch, where taken
                o = attn.forward_qkv_gemv(self.layer_idx, x, self.qkv_proj.weight, self.qkv_proj.bias, positions,
                                          self.rope.cache, qn, kn, self.eps)
            if o is None:
                o = attn.forward_qkv(self.layer_idx, self.qkv_proj(x), positions, self.rope.cache, qn, kn, self.eps)
            return self.o_proj(o.view(t, self.q_size))
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.ops.norm.rmsnorm(q.reshape(t, self.num_heads, self.head_dim), self.q_norm, self.eps).view(t, -1)
            k = self.ops.norm.rmsnorm(k.reshape(t, self.num_kv_heads, self.head_dim), self.k_norm, self.eps).view(t, -1)
        q, k = self.rope.apply(positions, q, k)
        o = self.ops.attention.forward(
            self.layer_idx, q.reshape(t, self.num_heads, self.head_dim).contiguous(),
            k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim))
        return self.o_proj(o.view(t, self.q_size))

    def takes_layer_kernel(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs this layer's attention half in one kernel: the attention
        backend's say (a one-token decode step, ``attention_layer_kernel``), plain 16-bit contiguous projection
        weights of the activations' dtype, no output-projection bias, one rank."""
        q, o = self.qkv_proj, self.o_proj
        return (self.ops.attention.takes_layer_kernel(tokens) and q.weight_scale_inv is None and o.bias is None
                and q.weight.dtype == o.weight.dtype and q.weight.dtype in (torch.bfloat16, torch.float16)
                and q.weight.is_contiguous() and o.weight.is_contiguous() and not self.ops.parallel.is_parallel)

    def entries(self, prefix: str) -> dict[str, Entry]:
        w, qs, ks = self.qkv_proj.weight, self.q_size, self.kv_size
        sc = self.qkv_proj.weight_scale_inv
        q_sh, kv_sh = tp_shard(self.ops, 0), self.kv_shard
        e = {
            f"{prefix}.q_proj.weight": Entry(w, (slice(0, qs),), scale=sc, shard=q_sh),
            f"{prefix}.k_proj.weight": Entry(w, (slice(qs, qs + ks),), scale=sc, shard=kv_sh),
            f"{prefix}.v_proj.weight": Entry(w, (slice(qs + ks, qs + 2 * ks),), scale=sc, shard=kv_sh),
            f"{prefix}.o_proj.weight": Entry(self.o_proj.weight, scale=self.o_proj.weight_scale_inv,
                                             shard=tp_shard(self.ops, 1)),
        }
        if self.qkv_proj.bias is not None:
            b = self.qkv_proj.bias
            e[f"{prefix}.q_proj.bias"] = Entry(b, (slice(0, qs),), shard=q_sh)
            e[f"{prefix}.k_proj.bias"] = Entry(b, (slice(qs, qs + ks),), shard=kv_sh)
            e[f"{prefix}.v_proj.bias"] = Entry(b, (slice(qs + ks, qs + 2 * ks),), shard=kv_sh)
        if self.o_proj.bias is not None:
            e[f"{prefix}.o_proj.bias"] = Entry(self.o_proj.bias)
        if self.qk_norm:
            e[f"{prefix}.q_norm.weight"] = Entry(self.q_norm)
            e[f"{prefix}.k_norm.weight"] = Entry(self.k_norm)
        return e


class DenseMLP(nn.Module):
    """SwiGLU MLP; on several ranks each holds ``intermediate / tp`` of the gate and up rows and down columns,
    and the output is all-reduced unless ``reduce`` is off (the shared expert: the MoE block reduces it with
    the routed experts' output)."""

    def __init__(self, ops: Ops, hidden: int, intermediate: int, dtype, device, reduce: bool = True):
        super().__init__()
        intermediate //= ops.parallel.tp_size
        self.ops, self.intermediate = ops, intermediate
        self.gate_up_proj = Linear(ops, hidden, 2 * intermediate, False, dtype, device, quantize=True)
        self.down_proj = Linear(ops, intermediate, hidden, False, dtype, device, quantize=True, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.activation.silu_and_mul(self.gate_up_proj(x)))

    def entries(self, prefix: str) -> dict[str, Entry]:
        w, i, sc = self.gate_up_proj.weight, self.intermediate, self.gate_up_proj.weight_scale_inv
        rows = tp_shard(self.ops, 0)
        return {
            f"{prefix}.gate_proj.weight": Entry(w, (slice(0, i),), scale=sc, shard=rows),
            f"{prefix}.up_proj.weight": Entry(w, (slice(i, 2 * i),), scale=sc, shard=rows),
            f"{prefix}.down_proj.weight": Entry(self.down_proj.weight, scale=self.down_proj.weight_scale_inv,
                                                shard=tp_shard(self.ops, 1)),
        }


class SparseMoE(nn.Module):
    """Router, routed experts, and an optional (optionally gated) shared expert.

    Routing runs ``self.router`` when the routing backend installed one in ``prepare`` (a fused top-k kernel
    on a GPU; ``routing_impl`` names it), else the torch reference. FP8 experts run the backend's FP8 path when
    it has one (``serves_fp8``), else the torch FP8 reference.

    A shared expert's gate (``x . w``, one output) is a row more of the router's weight when both are in the
    model dtype: one GEMM computes the router logits and the gate logit (row ``E``; the weight is padded
    with zero rows to a multiple of 8).

    On several ranks the router is replicated, the shared expert split like a dense MLP, and the routed
    experts either split along their intermediate size (tensor parallel) or placed whole, ``E / ep`` per rank
    (expert parallel: ``w13``/``w2`` hold the local experts, ``local_experts`` their global ids);
    ``moe_parallel`` runs ``run_experts`` across the ranks (dispatch, combine).
    """

    def __init__(self, ops: Ops, arch: ArchConfig, dtype, device):
        super().__init__()
        self.ops, self.routing = ops, arch.routing
        self.num_experts, self.top_k = arch.num_experts, arch.routing.top_k
        p = ops.parallel
        self.local_experts = local_experts(arch.num_experts, p) if p.ep_size > 1 else range(arch.num_experts)
        # (size, rank) of the split of each expert's intermediate rows, and of the experts among the ranks
        self.expert_tp = (1, 0) if p.ep_size > 1 else (p.tp_size, p.tp_rank)
        self.expert_ep = (p.ep_size, p.ep_rank)
        h, i, e = arch.hidden_size, arch.moe_intermediate_size // self.expert_tp[0], arch.num_experts
        self.intermediate = i
        self.router_fp32 = arch.router_fp32
        gated_shared = bool(arch.shared_expert_intermediate_size and arch.shared_expert_gate)
        self.shared_gate_in_router = gated_shared and not arch.router_fp32
        rows = e
        if self.shared_gate_in_router:  # E + 1 rows, padded to a multiple of 8 with zero rows that are never read:
            rows = -(-(e + 1) // 8) * 8  # cuBLAS takes slow kernels for outputs whose rows are not 16-byte aligned
        self.gate = Linear(ops, h, rows, False, torch.float32 if arch.router_fp32 else dtype, device)
        self.gate.weight.data[e:].zero_()
        fp8 = is_fp8_ops(ops)
        el = len(self.local_experts)
        self.w13 = empty_param((el, 2 * i, h), FP8_DTYPE if fp8 else dtype, device)
        self.w2 = empty_param((el, h, i), FP8_DTYPE if fp8 else dtype, device)
        self.w13_scale_inv = empty_param((el, *block_scale_shape(2 * i, h)), torch.float32, device) if fp8 else None
        self.w2_scale_inv = empty_param((el, *block_scale_shape(h, i)), torch.float32, device) if fp8 else None
        self.w13_order = "gate_up"
        self.correction_bias = empty_param((e,), torch.float32, device) if arch.routing_correction_bias else None
        self.router = None
        self.routing_impl = "torch"
        self.shared_expert = None
        self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(ops, h, arch.shared_expert_intermediate_size, dtype, device, reduce=False)
            if arch.shared_expert_gate and not self.shared_gate_in_router:
                self.shared_expert_gate = Linear(ops, h, 1, False, dtype, device)
        self.moe_parallel = MoEParallel(p, e, device, ops.moe.maps_expert_ids) if p.is_parallel else None
        self.fused_shared = 0  # shared-expert pieces appended to the routed experts (fuse_shared_expert)
        self.fused_max_tokens = 0  # steps of more tokens run the shared expert apart; 0: none does
        self.fused_rest = None  # the shared expert's rows left apart in a fused step (fewer pieces)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor | RouterPartials:
        """The router's GEMM of the tokens ``x``: its logits, or for small steps where the routing kernel takes
        them (``router_split_k_max_tokens``) their partial sums over slices of the hidden size."""
        if self.router_gemm_split(x.shape[0]):
            return self.router.partial_logits(x, self.gate.weight)
        return self.gate(x.float() if self.router_fp32 else x)

    def router_gemm_split(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs the router's GEMM in the router (partial sums)."""
        takes = getattr(self.router, "takes_gemm", None)
        return (takes is not None and not self.router_fp32 and self.gate.weight_scale_inv is None
                and self.gate.bias is None and takes(tokens, self.gate.weight))

    def takes_router_norm(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens folds the post-attention residual add and norm into the router's
        partial sums (``router_fuse_norm``, :meth:`add_norm_route_partials`)."""
        takes = getattr(self.router, "takes_norm", None)
        return (self.ops.router_fuse_norm and self.moe_parallel is None and takes is not None
                and self.router_gemm_split(tokens) and takes(tokens, self.gate.weight))

    def add_norm_route_partials(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor, RouterPartials]:
        """``(norm of residual + x, residual + x, the router's partial sums of that norm)`` in one launch."""
        return self.router.add_norm_partial_logits(x, residual, norm_weight, eps, self.gate.weight)

    def fuses_shared(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs the shared expert inside the fused MoE (``fuse_shared_expert``):
        every step, or those of at most ``fused_max_tokens`` tokens."""
        return self.fused_shared > 0 and (not self.fused_max_tokens or tokens <= self.fused_max_tokens)

    def side_expert(self, tokens: int) -> DenseMLP | None:
        """The shared expert a step of ``tokens`` tokens runs apart: all of it, or in a fused step the rows that did
        not join the routed experts (None: none)."""
        return self.fused_rest if self.fuses_shared(tokens) else self.shared_expert

    def route(self, x: torch.Tensor, partials: RouterPartials | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(weights float32 [T, k], ids int32 [T, k], shared-expert gate logit [T, 1] or None)`` for the
        tokens ``x``; the gate logit is there when the router's GEMM computed it. In a step that fuses the shared
        expert (``fuses_shared``), ``k`` grows by its pieces: ids ``E ..``, weights its gate (or 1); the gate logit
        is then there only for the rows left apart. ``partials``: the router's partial sums for ``x``, already
        computed (:meth:`add_norm_route_partials`)."""
        fused = self.fused_shared if self.fuses_shared(x.shape[0]) else 0
        apart = (self.fused_rest if fused else self.shared_expert) is not None
        logits = partials if partials is not None else self.router_logits(x)
        if isinstance(logits, RouterPartials):  # the routing kernel adds them up and writes the logits
            # the fused MoE's shared-expert tiles may start with the routing kernel: they read x, which the router
            # did not write (with partials given, the router wrote it: no)
            early = bool(fused) and self.ops.moe_fused_shared_early and x.shape[0] == 1 and partials is None
            weights, ids, logits = self.router.route_partials(logits, self.num_experts, shared=fused,
                                                              gated=self.shared_gate_in_router, let_early=early)
            if fused and not apart:
                return weights, ids, None
            e = self.num_experts
            return weights, ids, logits[:, e:e + 1] if self.shared_gate_in_router else None
        gate_logit = None
        if self.shared_gate_in_router:
            logits, gate_logit = logits[:, :self.num_experts], logits[:, self.num_experts:self.num_experts + 1]
        rest_gate = gate_logit if apart else None  # for the rows not fused
        if fused and self.router is not None and self.router.appends_shared:
            return (*self.router(logits, self.correction_bias, shared=fused, gated=gate_logit is not None),
                    rest_gate)
        if self.router is not None:
            weights, ids = self.router(logits, self.correction_bias)
        else:
            weights, ids = select_experts(logits, self.routing, self.correction_bias)
        if fused:
            return (*append_shared(weights, ids, gate_logit, self.num_experts, fused), rest_gate)
        return weights, ids, gate_logit

    @torch.no_grad()
    def fuse_shared_expert(self, pieces: int = 0, max_tokens: int = 0) -> int:
        """Append the shared expert to the routed experts as ``ceil(S / I)`` pieces of the expert intermediate
        size ``I`` (the last zero-padded; SwiGLU acts row by row, so the pieces' outputs sum to the shared
        expert's), chosen for every token with its gate as weight (1 without a gate). ``pieces`` (fewer than
        that; 0: all): only the first ``pieces * I`` rows join the routed experts, and the rest stay a shared
        expert of ``S - pieces * I`` rows, computed apart and gated as before. ``max_tokens``: only steps of at
        most that many tokens run it so; larger ones run the whole shared expert apart, as unfused, from its own
        weights, which are kept (the pieces are a copy); 0: every step. Returns the pieces appended."""
        if self.shared_expert is None or self.fused_shared:
            return self.fused_shared
        if self.w13_order != "gate_up":
            raise RuntimeError("fuse_shared_expert: run it before the MoE backend's prepare (the experts' rows were "
                               f"laid out as {self.w13_order!r})")
        if self.w13_scale_inv is not None or self.shared_expert_gate is not None or self.moe_parallel is not None:
            raise ValueError("moe_fuse_shared_expert: needs unquantised experts, one GPU and the shared expert's "
                             "gate (if any) in the router")
        i = self.intermediate
        gate_up, down = self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight
        s = down.shape[1]
        rest = None
        if 0 < pieces < -(-s // i):  # the first pieces * I rows join; the others stay a shared expert
            k = pieces * i
            rest = DenseMLP(self.ops, down.shape[0], s - k, gate_up.dtype, gate_up.device, reduce=False)
            rest.gate_up_proj.weight.copy_(torch.cat([gate_up[k:s], gate_up[s + k:]]))
            rest.down_proj.weight.copy_(down[:, k:])
            gate_up, down, s = torch.cat([gate_up[:k], gate_up[s:s + k]]), down[:, :k], k
        pieces = -(-s // i)
        pad = pieces * i - s
        g, u = gate_up[:s], gate_up[s:]
        if pad:
            g, u = F.pad(g, (0, 0, 0, pad)), F.pad(u, (0, 0, 0, pad))
            down = F.pad(down, (0, pad))
        h = down.shape[0]
        w13 = torch.cat([g.view(pieces, i, -1), u.view(pieces, i, -1)], dim=1)  # [pieces, 2I, H]
        w2 = down.view(h, pieces, i).transpose(0, 1)  # [pieces, H, I]
        self.w13 = nn.Parameter(torch.cat([self.w13.data, w13.to(self.w13.dtype)]), requires_grad=False)
        self.w2 = nn.Parameter(torch.cat([self.w2.data, w2.to(self.w2.dtype)]).contiguous(), requires_grad=False)
        if not max_tokens:
            self.shared_expert = rest  # no step runs all of it apart
        self.fused_rest = rest
        self.fused_shared = pieces
        self.fused_max_tokens = max_tokens
        return pieces

    def takes_norm(self, tokens: int, in_grid: bool = False) -> bool:
        """Whether ``forward(x, add_norm)`` of a step of ``tokens`` tokens folds the residual add and the next norm
        into the combine (``moe_fuse_norm``, ``moe_fuse_norm_max_tokens``; ``in_grid``: the step routes in the fused
        MoE's grid, ``moe_fuse_norm_in_grid``): a MoE backend that can (the Triton MoE, the torch reference),
        high-precision experts, one rank."""
        return ((0 < tokens <= self.ops.moe_fuse_norm_max_tokens or (in_grid and self.ops.moe_fuse_norm_in_grid))
                and self.ops.moe.fuses_norm and self.moe_parallel is None and self.w13_scale_inv is None)

    def routes_in_grid(self, x: torch.Tensor, partials: RouterPartials | None = None) -> bool:
        """Whether :meth:`forward` of ``x`` routes inside the fused MoE's first grid (``moe_route_in_grid``, where the
        MoE backend takes the step: ``MoEBackend.takes_routing``)."""
        return (partials is None and self.ops.moe_route_in_grid and self.moe_parallel is None
                and not self.router_fp32 and self.router_gemm_split(x.shape[0]) and self.ops.moe.takes_routing(x, self))

    def after_attention(self, h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        next_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The rest of a decoder layer from the attention's output ``h``: the post-attention residual add and
        norm (``norm_weight``; in the router's kernel where it takes it, ``router_fuse_norm``), then this block.
        ``(output, residual, normed)``: with ``next_norm`` where the block takes it (``moe_fuse_norm``), the
        output is that norm of the new residual and ``normed`` is True."""
        partials = None
        if self.takes_router_norm(h.shape[0]):
            h, residual, partials = self.add_norm_route_partials(h, residual, norm_weight, eps)
        else:
            h, residual = self.ops.norm.add_rmsnorm(h, residual, norm_weight, eps)
        return self.after_norm(h, residual, eps, next_norm, partials)

    def after_norm(self, h: torch.Tensor, residual: torch.Tensor, eps: float, next_norm: torch.Tensor | None = None,
                   partials: RouterPartials | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """:meth:`after_attention` from its post-attention norm ``h`` (``residual`` updated, ``partials`` the router's
        partial sums of ``h`` where they were computed with it)."""
        if next_norm is not None and self.takes_norm(h.shape[0], self.routes_in_grid(h, partials)):
            return self(h, AddNorm(residual, next_norm, eps), partials), residual, True
        return self(h, None, partials), residual, False

    def forward(self, x: torch.Tensor, add_norm: AddNorm | None = None,
                partials: RouterPartials | None = None) -> torch.Tensor:
        """The block's output for the tokens ``x``; with ``add_norm`` (only where ``takes_norm``), the norm of
        the residual it was added to. ``partials``: the router's partial sums for ``x`` (``router_fuse_norm``)."""
        if self.routes_in_grid(x, partials):
            return self.ops.moe.experts_routed(x, self, add_norm=add_norm)  # routing inside the experts' grid
        shared = None
        stream = self.ops.side_stream
        # Routing (the router's GEMM and the top-k) first, alone: launched beside the shared expert's GEMMs, whose
        # thread blocks fill the SMs, its small kernels waited for free ones on the path every later kernel of the
        # layer waits on (c=1 step profile on an H200: the top-k kernel adding the router's partial sums 11 us per
        # layer there).
        weights, ids, gate_logit = self.route(x, partials)
        side = self.side_expert(x.shape[0])
        if side is not None and stream is not None and x.shape[0] <= self.ops.side_stream_max_tokens:
            stream.wait_stream(torch.cuda.current_stream())  # x and the routing are ready
            with torch.cuda.stream(stream):
                shared = self._shared(side, x, None, stream)
        if side is not None and shared is None:
            shared = self._shared(side, x, gate_logit, None)
        elif shared is not None and shared.gate_logit is None and gate_logit is not None:
            shared.gate_logit = gate_logit  # the router's GEMM computed the gate on this stream
        if self.moe_parallel is not None:  # dispatch to the ranks' experts, combine their partial sums
            return self.moe_parallel(self.run_experts, x, weights, ids, shared)
        if add_norm is not None:
            return self.ops.moe.experts(x, weights, ids, self, shared=shared, add_norm=add_norm)
        return self.run_experts(x, weights, ids, shared)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    shared: SharedExpertOutput | None) -> torch.Tensor:
        """This rank's experts (ids outside them count as zero) plus the shared expert's output."""
        if self.w13_scale_inv is not None and not self.ops.moe.serves_fp8:
            out = experts_fp8_reference(x, weights, ids, self)
            return out if shared is None else shared.add_to(out)
        return self.ops.moe.experts(x, weights, ids, self, shared=shared)

    def _shared(self, mlp: DenseMLP, x: torch.Tensor, gate_logit: torch.Tensor | None, stream) -> SharedExpertOutput:
        """The output of the shared expert ``mlp`` (all of it, or its rows left apart) and its gate logit (its own
        linear, or the router's extra row)."""
        out = mlp(x)
        if self.shared_expert_gate is not None:
            gate_logit = self.shared_expert_gate(x)
        return SharedExpertOutput(out, gate_logit, stream)

    def entries(self, prefix: str) -> dict[str, Entry]:
        i, n = self.intermediate, self.num_experts
        e: dict[str, Entry] = {f"{prefix}.gate.weight": Entry(self.gate.weight, (slice(0, n),))}
        if self.shared_gate_in_router:
            e[f"{prefix}.shared_expert_gate.weight"] = Entry(self.gate.weight, (slice(n, n + 1),))
        per_expert_13, per_expert_2 = [], []
        s13, s2 = self.w13_scale_inv, self.w2_scale_inv
        tp, tp_rank = self.expert_tp
        ep, ep_rank = self.expert_ep
        rows, cols = (Shard(0, tp_rank, tp), Shard(1, tp_rank, tp)) if tp > 1 else (None, None)
        first = self.local_experts.start
        for x in range(self.num_experts):
            p = f"{prefix}.experts.{x}"
            names = (f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight")
            if x not in self.local_experts:  # another rank holds it
                e.update({name: Entry(None) for name in names})
                continue
            lx = x - first
            e[names[0]] = Entry(self.w13, (lx, slice(0, i)), scale=s13, shard=rows)
            e[names[1]] = Entry(self.w13, (lx, slice(i, 2 * i)), scale=s13, shard=rows)
            e[names[2]] = Entry(self.w2, (lx,), scale=s2, shard=cols)
            per_expert_13 += names[:2]
            per_expert_2.append(names[2])
        # Stacked layouts (transformers 5 in memory, some exporters): one tensor for all experts.
        if ep > 1:
            sh13 = sh2 = Shard(0, ep_rank, ep)
        else:
            sh13, sh2 = (Shard(1, tp_rank, tp, parts=2), Shard(2, tp_rank, tp)) if tp > 1 else (None, None)
        e[f"{prefix}.experts.gate_up_proj"] = Entry(self.w13, (), tuple(per_expert_13), scale=s13, shard=sh13)
        e[f"{prefix}.experts.down_proj"] = Entry(self.w2, (), tuple(per_expert_2), scale=s2, shard=sh2)
        if self.correction_bias is not None:
            e[f"{prefix}.gate.e_score_correction_bias"] = Entry(self.correction_bias)
        if self.shared_expert is not None:
            e.update(self.shared_expert.entries(f"{prefix}.shared_expert"))
        if self.shared_expert_gate is not None:
            e[f"{prefix}.shared_expert_gate.weight"] = Entry(self.shared_expert_gate.weight)
        return e


class DecoderLayer(nn.Module):
    def __init__(self, ops: Ops, arch: ArchConfig, layer_idx: int, rope, dtype, device):
        super().__init__()
        self.ops, self.eps = ops, arch.rms_norm_eps
        self.input_layernorm = empty_param((arch.hidden_size,), dtype, device)
        self.post_attention_layernorm = empty_param((arch.hidden_size,), dtype, device)
        self.self_attn = Attention(ops, arch, layer_idx, rope, dtype, device)
        if arch.layer_is_moe(layer_idx):
            self.mlp = SparseMoE(ops, arch, dtype, device)
        else:
            self.mlp = DenseMLP(ops, arch.hidden_size, arch.dense_intermediate_size, dtype, device)

    def forward(self, positions, hidden, residual, normed: bool = False, next_norm: torch.Tensor | None = None):
        """``(output, residual, normed)``. ``normed``: ``hidden`` is already this layer's input norm (the layer
        before folded it into its MoE combine, ``residual`` updated). ``next_norm``: the weight of the norm that
        follows this layer; where the MoE block takes it (``SparseMoE.takes_norm``), the output is that norm of
        the new residual and ``normed`` comes back True."""
        norm = self.ops.norm
        if residual is not None and not normed and self.self_attn.takes_layer_kernel(hidden.shape[0]):
            return self._forward_one_kernel(positions, hidden, residual, next_norm)
        if normed:
            h = hidden
        elif residual is None:
            residual = hidden
            h = norm.rmsnorm(hidden, self.input_layernorm, self.eps)
        else:
            h, residual = norm.add_rmsnorm(hidden, residual, self.input_layernorm, self.eps)
        h = self.self_attn(positions, h)
        if isinstance(self.mlp, SparseMoE):
            return self.mlp.after_attention(h, residual, self.post_attention_layernorm, self.eps, next_norm)
        h, residual = norm.add_rmsnorm(h, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(h), residual, False

    def _forward_one_kernel(self, positions, hidden, residual, next_norm):
        """:meth:`forward` of a one-token decode step whose attention half (residual add and norm, QKV, attention,
        output projection, residual add and norm, and the router's GEMM where the routing kernel takes it) runs
        in one kernel (``moeserve.ops.attention.layer_triton``)."""
        attn, mlp = self.self_attn, self.mlp
        moe = isinstance(mlp, SparseMoE)
        router = mlp.gate.weight if moe and mlp.router_gemm_split(1) else None
        h, parts = self.ops.attention.attention_half(
            attn.layer_idx, hidden, residual, self.input_layernorm, attn.qkv_proj.weight, attn.qkv_proj.bias,
            attn.o_proj.weight, self.post_attention_layernorm, self.eps, positions, attn.rope.cache,
            attn.q_norm if attn.qk_norm else None, attn.k_norm if attn.qk_norm else None, router)
        if not moe:
            return mlp(h), residual, False
        partials = RouterPartials(parts, router.shape[0], router.dtype) if parts is not None else None
        return mlp.after_norm(h, residual, self.eps, next_norm, partials)

    def entries(self, prefix: str) -> dict[str, Entry]:
        e = {f"{prefix}.input_layernorm.weight": Entry(self.input_layernorm),
             f"{prefix}.post_attention_layernorm.weight": Entry(self.post_attention_layernorm)}
        e.update(self.self_attn.entries(f"{prefix}.self_attn"))
        e.update(self.mlp.entries(f"{prefix}.mlp"))
        return e


def _vocab_param(rows: int, start: int, arch: ArchConfig, dtype, device) -> nn.Parameter:
    """This rank's rows of the embedding or LM head; rows past the vocabulary (padding) are zero."""
    p = empty_param((rows, arch.hidden_size), dtype, device)
    real = max(0, min(arch.vocab_size - start, rows))
    p.data[real:].zero_()
    return p


class MoECausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head, over a flat batch of tokens.

    On several ranks the embedding and the LM head hold ``vocab_rows`` rows each (the padded vocabulary split
    in rank order): a lookup masks the ids of other ranks and all-reduces, the logits are all-gathered."""

    def __init__(self, arch: ArchConfig, ops: Ops, dtype: torch.dtype, device: torch.device):
        super().__init__()
        from moeserve.ops.basic import rope_cos_sin_cache
        self.arch, self.ops = arch, ops
        p = ops.parallel
        self.vocab_rows = padded_vocab(arch.vocab_size, p.tp_size) // p.tp_size
        self.vocab_start = p.tp_rank * self.vocab_rows
        self.embed_tokens = _vocab_param(self.vocab_rows, self.vocab_start, arch, dtype, device)
        cache = rope_cos_sin_cache(arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta,
                                   arch.rope_scaling, device)
        self.rope = ops.rope_cls(arch.head_dim, arch.rotary_dim, cache)
        self.layers = nn.ModuleList(DecoderLayer(ops, arch, i, self.rope, dtype, device)
                                    for i in range(arch.num_layers))
        self.norm = empty_param((arch.hidden_size,), dtype, device)
        self.lm_head = self.embed_tokens if arch.tie_word_embeddings else _vocab_param(
            self.vocab_rows, self.vocab_start, arch, dtype, device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        p = self.ops.parallel
        if not p.is_parallel:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return p.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        first = None if self.ops.parallel.is_parallel else self.ops.norm.embed_rmsnorm(
            input_ids, self.embed_tokens, self.layers[0].input_layernorm, self.layers[0].eps)
        if first is not None:  # the embedding and the first layer's input norm in one kernel
            hidden, residual = first
            normed = True
        else:
            hidden = self.embed(input_ids)
            residual, normed = None, False
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            next_norm = self.norm if i == last else self.layers[i + 1].input_layernorm
            hidden, residual, normed = layer(positions, hidden, residual, normed, next_norm)
        if normed:  # the last MoE combine applied the final norm
            return hidden
        hidden, _ = self.ops.norm.add_rmsnorm(hidden, residual, self.norm, self.arch.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear.linear(hidden, self.lm_head)  # the Triton GEMV for one-token steps (PDL)
        p = self.ops.parallel
        if p.is_parallel:
            logits = p.all_gather(logits, dim=-1)[:, :self.arch.vocab_size]
        return logits.float()

    def greedy_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits, tokens)``, what a decode graph computes: :meth:`compute_logits`'s logits left in the model's
        dtype (``.float()`` gives them), and each row's greedy token (int64) where the linear backend finds it in
        the LM head's epilogue (``linear_argmax``; None elsewhere, and under tensor parallelism)."""
        p = self.ops.parallel
        if not p.is_parallel:
            return self.ops.linear.linear_argmax(hidden, self.lm_head)
        return p.all_gather(self.ops.linear.linear(hidden, self.lm_head), dim=-1)[:, :self.arch.vocab_size], None

    def checkpoint_entries(self) -> dict[str, Entry]:
        e = {"model.embed_tokens.weight": self._vocab_entry(self.embed_tokens), "model.norm.weight": Entry(self.norm)}
        if not self.arch.tie_word_embeddings:
            e["lm_head.weight"] = self._vocab_entry(self.lm_head)
        for i, layer in enumerate(self.layers):
            e.update(layer.entries(f"model.layers.{i}"))
        return e

    def _vocab_entry(self, param: torch.Tensor) -> Entry:
        p = self.ops.parallel
        if not p.is_parallel:
            return Entry(param)
        real = max(0, min(self.arch.vocab_size - self.vocab_start, self.vocab_rows))
        return Entry(param, (slice(0, real),), shard=Shard(0, p.tp_rank, p.tp_size, size=self.vocab_rows))

    def moe_blocks(self) -> list[SparseMoE]:
        blocks = [getattr(layer.mlp, "_orig_mod", layer.mlp) for layer in self.layers]
        return [b for b in blocks if isinstance(b, SparseMoE)]
