"""How a model is split across tensor- and expert-parallel ranks: which part of each checkpoint tensor a rank
holds (``Shard``), the per-rank sizes, the checks that a model can be split at all, and the hook that moves a
MoE layer's tokens to its experts and back (``MoEParallel``).

Tensor parallel (Megatron / vLLM layout): q/k/v are split by heads (kv heads are replicated when there are
fewer of them than ranks), gate/up by intermediate rows (both halves alike), o_proj and down_proj by input
columns followed by an all-reduce; the embedding and the LM head by vocabulary rows (padded to a multiple of
``64 * tp``); the KV cache holds each rank's kv heads; the router and the norms are replicated.

Expert parallel: each rank holds ``E / ep`` whole routed experts (ranks in order); the shared expert is split
like a dense MLP. The experts kernels see the ids of local experts only (``expert_map``: global id -> local id
or -1; a backend that maps ids itself, as FlashInfer's ``cutlass_fused_moe`` with ``ep_size/ep_rank``, gets
the global ones), and the partial sums of the ranks are combined by an all-reduce, or by all-gather /
reduce-scatter (``allgather_reducescatter``; the seam where an all-to-all dispatch goes later).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.models.arch import ArchConfig
from moeserve.ops.parallel import Parallel
from moeserve.quant.fp8 import BLOCK

VOCAB_PADDING = 64


@dataclass(frozen=True)
class Shard:
    """This rank's part of a checkpoint tensor along ``dim``: ``world`` equal parts, part ``rank``.

    ``parts > 1``: the dimension is that many equal blocks (a stacked gate | up) and each is split alike;
    ``size``: a padded split (the vocabulary): rank r reads ``[r * size, (r + 1) * size)`` clipped to the
    tensor, so the last rank's part may be short or empty."""

    dim: int
    rank: int
    world: int
    parts: int = 1
    size: int | None = None

    def ranges(self, n: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` index ranges this rank reads along a dimension of length ``n``."""
        if self.size is not None:
            start = min(self.rank * self.size, n)
            return [(start, min(start + self.size, n))]
        if n % (self.parts * self.world):
            raise ValueError(f"a dimension of {n} does not split into {self.parts} x {self.world} equal parts")
        block = n // self.parts
        per = block // self.world
        return [(p * block + self.rank * per, p * block + (self.rank + 1) * per) for p in range(self.parts)]

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        d = self.dim % len(full)
        return (*full[:d], sum(b - a for a, b in self.ranges(full[d])), *full[d + 1:])

    def scale_ranges(self, full: tuple[int, ...], name: str) -> list[tuple[int, int]] | None:
        """The ranges of the 128x128 block-scale tensor of a weight of shape ``full`` (None: same as the
        weight's, the split is not along a block-scaled dimension); refuses a split off block boundaries."""
        d = self.dim % len(full)
        if d < len(full) - 2:
            return None
        out = []
        for a, b in self.ranges(full[d]):
            if a % BLOCK or (b % BLOCK and b != full[d]):
                raise ValueError(f"{name}: this rank's part [{a}, {b}) of dimension {d} does not start and end on "
                                 f"{BLOCK}-element block boundaries, so its FP8 block scales cannot be split")
            out.append((a // BLOCK, -(-b // BLOCK)))
        return out


def local_heads(arch: ArchConfig, p: Parallel) -> tuple[int, int, Shard | None]:
    """``(query heads, kv heads, the kv heads' shard)`` of this rank. With more ranks than kv heads each
    rank holds one kv head, the one its query heads use (replicated over ``tp / num_kv_heads`` ranks)."""
    tp, kv = p.tp_size, arch.num_kv_heads
    if tp == 1:
        return arch.num_heads, kv, None
    if tp <= kv:
        return arch.num_heads // tp, kv // tp, Shard(0, p.tp_rank, tp)
    return arch.num_heads // tp, 1, Shard(0, p.tp_rank // (tp // kv), kv)


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rows of a split embedding / LM head: a multiple of ``64 * tp`` (as vLLM pads to 64 per
    partition); unchanged on one rank."""
    if tp == 1:
        return vocab
    step = VOCAB_PADDING * tp
    return -(-vocab // step) * step


def check_parallel(arch: ArchConfig, tp: int, expert_parallel: bool, quantization: str) -> None:
    """Refuse, in one line, a model that cannot be split over ``tp`` ranks."""
    if tp == 1:
        return
    name = arch.model_type
    need = [("num_attention_heads", arch.num_heads)]
    if any(not m for m in arch.moe_layers) and arch.dense_intermediate_size:
        need.append(("intermediate_size", arch.dense_intermediate_size))
    if arch.shared_expert_intermediate_size:
        need.append(("shared_expert_intermediate_size", arch.shared_expert_intermediate_size))
    if not expert_parallel:
        need.append(("moe_intermediate_size", arch.moe_intermediate_size))
    for field, n in need:
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {field} ({n}) of this {name} model")
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size {tp} must divide num_key_value_heads ({kv}) or be a multiple of "
                         f"it (kv heads are then replicated)")
    if expert_parallel and arch.num_experts % tp:
        raise ValueError(f"enable_expert_parallel: {arch.num_experts} routed experts do not split evenly over "
                         f"{tp} ranks")
    if quantization == "fp8":
        hd = arch.head_dim
        sizes = [("query heads x head_dim", arch.num_heads // tp * hd),
                 ("kv heads x head_dim", max(kv // tp, 1) * hd)]
        sizes += [(f, n // tp) for f, n in need[1:] if f != "moe_intermediate_size"]
        if not expert_parallel:
            sizes.append(("moe_intermediate_size", arch.moe_intermediate_size // tp))
        for what, n in sizes:
            if n % BLOCK:
                raise ValueError(f"FP8 with tensor_parallel_size {tp}: each rank's {what} ({n}) is not a multiple of "
                                 f"{BLOCK}, so the 128x128 block scales cannot be split; use fewer ranks"
                                 + (" or enable_expert_parallel" if what == "moe_intermediate_size" else ""))


def collectives(tp: int, expert_parallel: bool, dispatch: str, device_type: str) -> dict:
    """What a step exchanges between ranks with this layout (for ``moeserve env`` and the run's report)."""
    if tp == 1:
        return {"ranks": 1, "collectives": []}
    moe = ("routed experts: whole experts per rank; " + (
        "all-gather of hidden states, weights and ids, then reduce-scatter and all-gather of the rows"
        if dispatch == "allgather_reducescatter" else "one all-reduce of their partial sums with the shared expert")
        if expert_parallel else "routed experts: each sliced by intermediate rows; one all-reduce with the shared expert")
    return {
        "ranks": tp, "backend": "nccl" if device_type == "cuda" else "gloo",
        "collectives": ["all-reduce after o_proj and after each dense MLP (row-parallel)",
                        "all-reduce of the embedding (vocabulary split)", moe,
                        "all-gather of the logits (LM head split by vocabulary rows)"],
    }


# --- the MoE layer's dispatch and combine ---------------------------------------------------------------

def local_experts(num_experts: int, p: Parallel) -> range:
    """The global ids of the routed experts this rank holds."""
    n = num_experts // p.ep_size
    return range(p.ep_rank * n, (p.ep_rank + 1) * n)


def expert_map(num_experts: int, p: Parallel, device) -> torch.Tensor:
    """int32 ``[E]``: the local id of each global expert on this rank, -1 where another rank holds it."""
    m = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    r = local_experts(num_experts, p)
    m[r.start:r.stop] = torch.arange(len(r), dtype=torch.int32, device=device)
    return m


class MoEParallel:
    """Runs a ``SparseMoE`` block's experts across the ranks (``block.moe_parallel``; None on one rank).

    ``run_experts(x, weights, ids, shared)`` computes this rank's share: the local experts' weighted outputs
    plus this rank's slice of the shared expert (its partial sum). The ranks' shares add up to the layer's
    output:

    - tensor parallel, or expert parallel with ``allreduce``: every rank has every token; one all-reduce.
    - ``allgather_reducescatter``: each rank brings rows ``[r * n, (r + 1) * n)`` of the (padded) tokens with
      their routing; all-gather of hidden states, weights and ids (dispatch), local experts on all tokens,
      reduce-scatter (combine) back to each rank's rows, all-gather of the rows to every rank. With tokens
      already on every rank (no data-parallel attention) the dispatch gathers what each rank has: it is the
      place where a data-parallel or all-to-all dispatch (NCCL, FlashInfer ``MoeAlltoAll``) plugs in.
    """

    def __init__(self, p: Parallel, num_experts: int, device, maps_ids_itself: bool):
        self.p = p
        self.expert_parallel = p.ep_size > 1
        self.expert_map = expert_map(num_experts, p, device) if self.expert_parallel and not maps_ids_itself else None
        self.gather_scatter = self.expert_parallel and p.expert_dispatch == "allgather_reducescatter"

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if self.expert_map is None:
            return ids
        return self.expert_map[ids.long()]

    def __call__(self, run_experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared):
        if not self.gather_scatter:
            return self.p.all_reduce(run_experts(x, weights, self.local_ids(ids), shared))
        return self._gather_scatter(run_experts, x, weights, ids, shared)

    def _gather_scatter(self, run_experts, x, weights, ids, shared):
        p, t = self.p, x.shape[0]
        n = -(-t // p.tp_size)
        pad = n * p.tp_size - t
        rows = slice(p.tp_rank * n, (p.tp_rank + 1) * n)
        # this rank's tokens and their routing (padding rows route to real experts with weight 0)
        mine = [F.pad(v, (0, 0, 0, pad))[rows] for v in (x, weights, ids)]
        x_all, w_all, ids_all = (p.all_gather(v, dim=0) for v in mine)  # dispatch
        if shared is not None and pad:
            shared = shared.padded(pad)
        out = run_experts(x_all, w_all, self.local_ids(ids_all), shared)
        mine_out = p.reduce_scatter(out)  # combine: this rank's rows, summed over the ranks' experts
        return p.all_gather(mine_out, dim=0)[:t]
