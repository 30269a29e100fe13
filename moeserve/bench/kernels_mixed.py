"""Mixed prefill + decode attention for ``moeserve bench kernels``: one prefill plan over every row (what the
engine runs for a mixed step) against FlashInfer's batched POD attention (prefill and decode in one launch).

A mixed step here is one prompt chunk of ``prompt_len`` new tokens beside ``b`` decode rows of
``context_len`` cached tokens, on one shuffled paged cache. Both kernels are checked against the float32
reference of each part before they are timed (without CUDA graphs: FlashInfer's batched POD wrapper does
not support them, and the engine runs mixed steps eagerly).
"""
from __future__ import annotations

import torch

from moeserve.bench.kernel_cases import _flashinfer, attention_reference, attention_traffic, fi_prefill, paged_inputs

MIXED_KERNELS = (  # (name, needs)
    ("flashinfer mixed: one prefill plan (fa3)", "sm90"),
    ("flashinfer mixed: one prefill plan (fa2)", "any"),
    ("flashinfer mixed: batched POD (fa2)", "any"),
)


def mixed_inputs(sh, decodes: int, device, gen) -> dict:
    """The prompt chunk and the decode rows on one cache: ``q`` is the chunk's rows then one row per decode
    request; the CSR tables of all rows together under the keys ``paged_inputs`` uses (so ``fi_prefill``
    takes them as they are), and each part's in ``p`` and ``d`` (the decode pages at ``indices_d``)."""
    p = paged_inputs(sh, 1, sh.prompt_len, sh.prompt_len, device, gen)
    d = paged_inputs(sh, decodes, sh.context_len, 1, device, gen)
    n_p = p["kv"].shape[0]
    d_indices = d["indices"] + n_p
    ind_p, ind_d = p["indptr_host"], d["indptr_host"]
    return {
        "p": p, "d": d, "kv": torch.cat([p["kv"], d["kv"]]), "q": torch.cat([p["q"], d["q"]]),
        "q_p": p["q"], "q_d": d["q"], "indices_d": d_indices,
        "qo_indptr_host": torch.cat([p["qo_indptr_host"], d["qo_indptr_host"][1:] + p["qo_indptr_host"][-1]]),
        "indptr_host": torch.cat([ind_p, ind_d[1:] + ind_p[-1]]),
        "indices": torch.cat([p["indices"], d_indices]),
        "last_host": torch.cat([p["last_host"], d["last_host"]]),
    }


def mixed_reference(sh, inp: dict) -> torch.Tensor:
    return torch.cat([attention_reference(sh, inp["p"]), attention_reference(sh, inp["d"])])


def mixed_traffic(sh, inp: dict) -> tuple[float, float]:
    (mp, fp), (md, fd) = attention_traffic(sh, inp["p"]), attention_traffic(sh, inp["d"])
    return mp + md, fp + fd


def batched_pod(sh, inp: dict, ws: torch.Tensor):
    """FlashInfer's ``BatchPODWithPagedKVCacheWrapper``: the prompt chunk (causal) and the decode rows in one
    launch; its two outputs are concatenated in the reference's row order."""
    fi = _flashinfer()
    p, d = inp["p"], inp["d"]
    w = fi.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
    dev = inp["q"].device
    w.plan(p["qo_indptr_host"].to(dev), p["indptr_host"].to(dev), p["indices"], p["last_host"],
           d["qo_indptr_host"].to(dev), d["indptr_host"].to(dev), inp["indices_d"], d["last_host"],
           num_qo_heads=sh.num_heads, num_kv_heads=sh.num_kv_heads, head_dim=sh.head_dim, page_size=sh.page_size,
           q_data_type=sh.dtype, kv_data_type=sh.dtype, sm_scale=sh.scale)

    def run(q_p, q_d, kv):
        out_p, out_d = w.run(q_p, kv, q_d, kv, causal_p=True)
        return torch.cat([out_p, out_d])
    return run, (inp["q_p"], inp["q_d"], inp["kv"]), False


def maker(name: str, sh, ws: torch.Tensor):
    """``inputs -> (fn, args, use_cuda_graph)`` for one of ``MIXED_KERNELS``."""
    if "one prefill plan" in name:  # what the engine does: decode rows are 1-token queries of one causal plan
        backend = "fa3" if name.endswith("(fa3)") else "fa2"
        return lambda inp: fi_prefill(sh, inp, ws, backend)
    return lambda inp: batched_pod(sh, inp, ws)
