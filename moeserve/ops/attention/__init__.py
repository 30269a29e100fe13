"""Paged attention: the per-step inputs every backend reads, and the backends themselves."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def decode_kernel_takes_rotary(head_dim: int, rotary_dim: int) -> bool:
    """Whether the one-kernel Triton decode (``moeserve.ops.attention.decode_triton``) fits a rotary width: its
    tiles take the rotated halves and an unrotated rest of at least 16 dims, or no rest."""
    return rotary_dim >= head_dim or head_dim - rotary_dim >= 16


@dataclass
class AttentionInputs:
    """One step's batch in FlashInfer's CSR form.

    Request b feeds ``query_lens[b]`` new tokens and afterwards holds ``seq_lens[b]`` tokens in pages
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; the last page holds ``kv_last_page_len[b]`` of them.
    ``*_host`` tensors live in (pinned) host memory for ``plan()``; the rest are on the device.
    """

    num_seqs: int
    num_tokens: int
    query_lens: list[int]
    seq_lens: list[int]
    is_decode: bool
    qo_indptr_host: torch.Tensor
    kv_indptr_host: torch.Tensor
    kv_indices_host: torch.Tensor
    kv_last_page_len_host: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset of each new token
    batch_indices: torch.Tensor  # [T] int32: which request each new token belongs to
    token_positions: torch.Tensor  # [T] int32: each new token's position within its request


@dataclass
class AttentionSplit:
    """Where a piecewise CUDA-graph capture cuts a layer: ``q`` is the fixed buffer the QKV kernel writes the
    queries into; ``attend(layer, q)`` ends the piece and returns the fixed buffer the attention's output will be
    in when the piece after it runs."""
    q: torch.Tensor
    attend: Callable[[int, torch.Tensor], torch.Tensor]
