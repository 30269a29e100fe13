"""A one-token MoE step whose routing runs in the first expert GEMM's grid (``moe_route_in_grid``, default on).

In a one-token step that runs the shared expert inside the fused MoE as ``P`` always-picked pieces, the pieces'
GEMM tiles need only the layer's input, while the routed experts' tiles need the routing. Launched as three kernels
(router's partial sums, routing, GEMM), the GEMM can start only once the routing kernel has (PDL), ~1.4 us before
the routing ends on an H200. Here one grid holds all three:

- programs ``0 .. R - 1`` compute the router's partial sums over slices of the hidden size; each counts itself
  done on the first flag, and the last adds the sums in slice order (as ``routing_triton``'s routing kernel does: the
  same logits, weights and ids), routes, resets that flag and sets the second (ready);
- the next ``P * NT`` programs are the shared pieces' tiles: they start with the grid, once the norm before it
  has completed;
- the last ``top_k * NT`` programs are the routed tiles: each waits for the ready flag, reads its expert, and counts
  itself done on the third flag; the last resets the ready flag and the third for the next launch.

The three flags lie on their own 128-byte lines (``SYNC_STRIDE`` words apart: the router's atomics do not queue
behind the waiting tiles' reads of the ready flag). The routed tiles wait with atomic reads (waiting with volatile
loads, then one atomic read, was 1.9% slower at c=1 on an H200).

The routed tiles wait only on lower program ids, which the GPU dispatches first (an order CUDA does not promise).
Should that ever fail, a routed tile gives up after ``SPIN_LIMIT`` reads of the ready flag (seconds, where the
routing takes microseconds) and ends the kernel with a trap: the launch fails with a CUDA error instead of hanging
(``moe_route_in_grid: false`` then runs the three kernels). +2.5% at c=1 on an H200
(docs/results/2026-12-04-h200-v). The down GEMM after the grid is ``triton_kernels``'s: its tiles load their first
weight tile before they wait for the grid (:data:`DOWN_PRELOAD`), and its last program runs the combine, with the
next norm where the block folds it (:data:`DOWN_COMBINE`; ``moe_fuse_norm_in_grid``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import let_next_start, wait_prior

from .combine import moe_combine
from .combine_triton import MAX_NORM_HIDDEN
from .routing_triton import ROUTER_BLOCK_K, ROUTER_MAX_ROWS, ROUTER_SPLITS, _route_parts, unsupported
from .triton_kernels import PAIRWISE_BLOCK_M, invoke_fused_moe_kernel, store_swiglu_tile, tile_dot

SYNC_STRIDE = 32  # int32 words between the flags: one 128-byte line each
SYNC_WORDS = 4 * SYNC_STRIDE  # the three flags of the grid, and the down GEMM's counter (DOWN_COMBINE)
SPIN_LIMIT = 1 << 22  # reads of the ready flag before a routed tile ends the kernel (each an L2 round trip)
# The down GEMM after the grid: its tiles load their first weight tile before they wait for the grid (the ids are
# complete by the time it can start: the routed tiles let it be scheduled only after they saw them ready) ...
DOWN_PRELOAD = True
# ... and its last program runs the combine (and the next norm, with add_norm) instead of a kernel of its own.
# With moe_fuse_norm_in_grid, +0.8% at c=1 on an H200 (docs/results/2026-12-04-h200-z5); A/B switches.
DOWN_COMBINE = True


def new_sync(device: torch.device | str) -> torch.Tensor:
    """The flags :func:`fused_moe_routed` takes, at zero."""
    return torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device)


@triton.jit
def _abort():
    """Ends the kernel with an error (PTX ``trap``): its launch, and the CUDA context, fail."""
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _route_moe_kernel(x_ptr, rw_ptr, part_ptr, sync_ptr, logits_ptr, weights_ptr, ids_ptr, b_ptr, c_ptr,
                      H, N, ROWS, E, R, NT, spin_limit, stride_rw, stride_be, stride_bn, stride_bk,
                      BLOCK_RN: tl.constexpr, BLOCK_RK: tl.constexpr, RK_ITERS: tl.constexpr, BLOCK_S: tl.constexpr,
                      TOPK: tl.constexpr, PIECES: tl.constexpr, BLOCK_KK: tl.constexpr, SOFTMAX: tl.constexpr,
                      RENORM: tl.constexpr, GATED: tl.constexpr, BLOCK_SIZE_M: tl.constexpr,
                      BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr,
                      PDL: tl.constexpr = False):
    READY: tl.constexpr = 32  # SYNC_STRIDE
    FIN: tl.constexpr = 64
    pid = tl.program_id(0)
    wait_prior(PDL, LET_NEXT=False)
    if pid < R:  # the router's slice pid of the hidden size
        r_t = tl.arange(0, 16)
        r_n = tl.arange(0, BLOCK_RN)
        r_acc = tl.zeros((16, BLOCK_RN), dtype=tl.float32)
        for i in tl.static_range(RK_ITERS):
            r_k = (pid * RK_ITERS + i) * BLOCK_RK + tl.arange(0, BLOCK_RK)
            r_kmask = r_k < H
            r_x = tl.load(x_ptr + r_t[:, None] * 0 + r_k[None, :], mask=(r_t[:, None] == 0) & r_kmask[None, :],
                          other=0.0)
            r_w = tl.load(rw_ptr + r_n[None, :] * stride_rw + r_k[:, None],
                          mask=(r_n[None, :] < ROWS) & r_kmask[:, None], other=0.0)
            r_acc = tl.dot(r_x, r_w, acc=r_acc)
        r_part = tl.sum(tl.where(r_t[:, None] == 0, r_acc, 0.0), axis=0)
        tl.store(part_ptr + pid * BLOCK_RN + r_n, r_part)
        tl.debug_barrier()  # every thread's partial sums are written before the counter moves
        done = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
        if done == R - 1:  # the last slice: add them in order and route
            r_s = tl.arange(0, BLOCK_S)
            r_parts = tl.load(part_ptr + r_s[:, None] * BLOCK_RN + r_n[None, :], mask=(r_s < R)[:, None],
                              other=0.0)
            _route_parts(r_parts, logits_ptr, r_n, 0, weights_ptr, ids_ptr, E, ROWS, TOPK, BLOCK_RN, BLOCK_KK, SOFTMAX,
                         RENORM, PIECES, GATED)
            tl.debug_barrier()  # the routing is written before the ready flag
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + READY, 1, sem="release")
        let_next_start(PDL)
    else:  # an expert GEMM tile: pieces first, then the routed pairs
        u = pid - R
        pid_m = u // NT
        pid_n = u % NT
        routed = pid_m >= PIECES
        if routed:
            ready = tl.atomic_add(sync_ptr + READY, 0, sem="acquire")
            spins = 0
            while ready == 0:
                spins += 1
                if spins > spin_limit:  # the routing never came (see the module's docstring): fail, not hang
                    _abort()
                ready = tl.atomic_add(sync_ptr + READY, 0, sem="acquire")
        pair = tl.where(routed, pid_m - PIECES, TOPK + pid_m)  # its row of the routing (the pieces after top_k)
        expert = tl.where(routed, tl.load(ids_ptr + pair, mask=routed, other=0), E + pid_m).to(tl.int64)
        rows = tl.arange(0, BLOCK_SIZE_M)
        offs_token = tl.where(rows == 0, pair, TOPK + PIECES).to(tl.int64)
        token_mask = rows == 0
        offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        a_ptrs = x_ptr + rows[:, None] * 0 + offs_k[None, :]
        b_ptrs = b_ptr + expert * stride_be + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
        acc = tile_dot(a_ptrs, b_ptrs, token_mask, offs_k, H, 1, stride_bk, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K,
                       EVEN_K, False, "")
        let_next_start(PDL)
        store_swiglu_tile(acc, c_ptr, weights_ptr, offs_token, token_mask, pid_n, N, N // 2, 1, BLOCK_SIZE_M,
                          BLOCK_SIZE_N, False)
        if routed:  # the last routed tile resets the flags: every routed tile has read them by then
            tl.debug_barrier()
            fin = tl.atomic_add(sync_ptr + FIN, 1, sem="acq_rel")
            if fin == TOPK * NT - 1:
                tl.atomic_xchg(sync_ptr + FIN, 0)
                tl.atomic_xchg(sync_ptr + READY, 0)


def unsupported_reason(x: torch.Tensor, router_w: torch.Tensor, w13: torch.Tensor, num_experts: int, top_k: int,
                       method: str, pieces: int, gated: bool) -> str | None:
    """None when :func:`fused_moe_routed` takes these inputs, else why not."""
    why = unsupported(method, num_experts, top_k)
    if why is not None:
        return why
    if x.shape[0] != 1:
        return f"{x.shape[0]} tokens (one only)"
    if router_w.shape[0] > ROUTER_MAX_ROWS or router_w.shape[0] < num_experts + (1 if gated else 0):
        return f"{router_w.shape[0]} router rows for {num_experts} experts"
    if w13.shape[0] != num_experts + pieces or pieces < 1:
        return f"{w13.shape[0]} experts in w13, expected {num_experts} routed + {pieces} pieces (at least one)"
    if router_w.stride(1) != 1 or x.stride(1) != 1:
        return "the router weight and x need contiguous rows"
    return None


def fused_moe_routed(x: torch.Tensor, router_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, num_experts: int,
                     top_k: int, method: str, renormalize: bool, pieces: int, gated: bool, config: dict,
                     sync: torch.Tensor, out: torch.Tensor | None = None, add_norm=None,
                     spin_limit: int = SPIN_LIMIT, preload: bool | None = None, combine: bool | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's MoE with a fused shared expert, the routing inside the first expert GEMM's grid: ``(output
    [1, H], weights [1, k + P], ids [1, k + P], logits [1, rows])``, the routing as ``topk_route_partials`` of
    ``router_partials`` writes it, the output as ``triton_kernels.fused_moe`` computes it from that routing.

    ``w13`` ``[E + P, 2I, H]`` with gate/up rows interleaved (``interleave_gate_up``), the last ``P`` experts the
    shared expert's pieces; ``w2`` ``[E + P, H, I]``; ``router_w`` ``[rows, H]`` (the shared expert's gate in row
    ``E`` when ``gated``). ``sync``: :func:`new_sync`'s flags, at zero and left at zero (CUDA graphs replay against
    them; launches sharing them must not overlap). ``config``: the fused MoE's tile config. ``spin_limit``: the
    routed tiles' reads of the ready flag before they end the kernel with an error. ``preload``: the down GEMM's
    tiles load their first weight tile before they wait for the grid (default :data:`DOWN_PRELOAD`). ``combine``:
    the down GEMM's last program runs the combine (and ``add_norm``), counted on the fourth flag (default
    :data:`DOWN_COMBINE`)."""
    preload = DOWN_PRELOAD if preload is None else preload
    combine = DOWN_COMBINE if combine is None else combine
    why = unsupported_reason(x, router_w, w13, num_experts, top_k, method, pieces, gated)
    if why is None and (sync.dtype != torch.int32 or sync.numel() < SYNC_WORDS):
        why = f"flags of {sync.numel()} {sync.dtype} (new_sync's {SYNC_WORDS} int32)"
    if why is not None:
        raise ValueError(f"fused_moe_routed: {why}")
    h = x.shape[1]
    rows = router_w.shape[0]
    two_i = w13.shape[1]
    dev = x.device
    block_rn = max(16, triton.next_power_of_2(rows))
    rk_iters = max(1, triton.cdiv(h, ROUTER_BLOCK_K * ROUTER_SPLITS))
    r = triton.cdiv(h, ROUTER_BLOCK_K * rk_iters)
    width = top_k + pieces
    parts = torch.empty((r, block_rn), dtype=torch.float32, device=dev)
    weights = torch.empty((1, width), dtype=torch.float32, device=dev)
    ids = torch.empty((1, width), dtype=torch.int32, device=dev)
    logits = torch.empty((1, rows), dtype=router_w.dtype, device=dev)
    act = torch.empty((width, two_i // 2), dtype=x.dtype, device=dev)
    bn, bk = int(config["BLOCK_SIZE_N"]), int(config["BLOCK_SIZE_K"])
    nt = triton.cdiv(two_i, bn)
    grid = (r + width * nt,)
    _route_moe_kernel[grid](
        x, router_w, parts, sync, logits, weights, ids, w13, act, h, two_i, rows, num_experts, r, nt, spin_limit,
        router_w.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), BLOCK_RN=block_rn, BLOCK_RK=ROUTER_BLOCK_K,
        RK_ITERS=rk_iters, BLOCK_S=triton.next_power_of_2(r), TOPK=top_k, PIECES=pieces,
        BLOCK_KK=triton.next_power_of_2(width), SOFTMAX=method == "softmax", RENORM=renormalize, GATED=gated,
        BLOCK_SIZE_M=PAIRWISE_BLOCK_M, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, EVEN_K=h % bk == 0,
        num_warps=int(config.get("num_warps", 4)), num_stages=int(config.get("num_stages", 3)), **launch_kwargs(1))
    flat_w, flat_ids = weights.reshape(-1), ids.reshape(-1)
    down = torch.empty((width, h), dtype=x.dtype, device=dev)
    if out is None:
        out = torch.empty((1, h), dtype=x.dtype, device=dev)
    fuse = combine and h <= MAX_NORM_HIDDEN and out.stride(1) == 1 and (
        add_norm is None or add_norm.residual.stride(1) == 1)
    invoke_fused_moe_kernel(act, w2, down, flat_w, flat_ids, flat_ids, flat_ids, 1, config, pairwise=True, tokens=1,
                            preload_b=preload,
                            combine={"fin": sync[3 * SYNC_STRIDE:], "out": out, "add_norm": add_norm} if fuse else None)
    if fuse:
        return out, weights, ids, logits
    return moe_combine(down, width, None, out, add_norm), weights, ids, logits
