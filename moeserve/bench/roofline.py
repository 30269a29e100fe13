"""The memory-bound floor of a decode step, against the copy bandwidth measured in the same run.

A decode step at batch ``c`` and mean context ``L`` must read at least: the routed experts the batch
touches (``c`` tokens each picking ``top_k`` of ``E`` experts uniformly touch ``E*(1-(1-k/E)^c)``
distinct experts per MoE layer on average, each ``3*H*I`` weights), the shared expert, attention
(q/k/v and o projections), the router, dense MLP layers, norms, the LM head (``V*H``), the ``c``
embedding rows, and the KV cache (``c*L*layers*2*Hkv*D`` elements). That many bytes over the measured
device copy bandwidth (bytes read plus bytes written per second) is the floor of the step time; ``c``
over the floor is the ceiling of decode tokens per second. Each engine's decode figure is reported as
a fraction of that ceiling.
"""
from __future__ import annotations

import statistics
import time

import torch

from moeserve.models.arch import ArchConfig

GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20
COPY_REPEATS = 10


def expected_active_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts hit when ``batch`` tokens each pick ``top_k`` of ``num_experts`` uniformly."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_step_bytes(arch: ArchConfig, batch: int, context_len: float, weight_bytes: float, kv_bytes: float,
                      quantized_bytes: float | None = None) -> dict:
    """Bytes one decode step must read, by component, and their ``total``.

    ``quantized_bytes`` is the bytes per weight of the layers FP8 quantisation stores in 8 bits (attention
    projections, routed and shared experts, dense MLPs); embeddings, LM head, router and norms stay at
    ``weight_bytes``. It defaults to ``weight_bytes``.
    """
    h, d = arch.hidden_size, arch.head_dim
    hq, hkv = arch.num_heads, arch.num_kv_heads
    q_out, kv_out = hq * d, hkv * d
    parts = {"attention": 0.0, "router": 0.0, "experts": 0.0, "shared_expert": 0.0, "dense_mlp": 0.0,
             "norms": 0.0}
    active = expected_active_experts(arch.num_experts, arch.top_k, batch)
    for i in range(arch.num_layers):
        attn = h * (q_out + 2 * kv_out) + q_out * h
        attn += (q_out + 2 * kv_out) if arch.qkv_bias else 0
        attn += h if arch.o_bias else 0
        attn += 2 * d if arch.qk_norm else 0
        parts["attention"] += attn
        parts["norms"] += 2 * h
        if arch.layer_is_moe(i):
            parts["router"] += h * arch.num_experts
            parts["experts"] += active * 3 * h * arch.moe_intermediate_size
            if arch.shared_expert_intermediate_size:
                parts["shared_expert"] += 3 * h * arch.shared_expert_intermediate_size
                parts["shared_expert"] += h if arch.shared_expert_gate else 0
        else:
            parts["dense_mlp"] += 3 * h * arch.dense_intermediate_size
    parts["norms"] += h
    parts["lm_head"] = arch.vocab_size * h
    parts["embedding_rows"] = batch * h
    q = weight_bytes if quantized_bytes is None else quantized_bytes
    quantized = ("attention", "experts", "shared_expert", "dense_mlp")
    out = {k: v * (q if k in quantized else weight_bytes) for k, v in parts.items()}
    out["kv_cache"] = batch * context_len * arch.num_layers * 2 * hkv * d * kv_bytes
    out["total"] = sum(out.values())
    out["active_experts_per_layer"] = active
    return out


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = COPY_REPEATS) -> dict:
    """Median bandwidth of a large copy on ``device``: (bytes read + bytes written) / time."""
    is_cuda = device.type == "cuda"
    nbytes = nbytes or (GPU_COPY_BYTES if is_cuda else CPU_COPY_BYTES)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    samples = []
    if is_cuda:
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        method = f"device-to-device copy of {nbytes >> 20} MiB, CUDA events, median of {repeats}"
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - t0)
        method = f"host memory copy of {nbytes >> 20} MiB, perf_counter, median of {repeats}"
    del src, dst
    if is_cuda:
        torch.cuda.empty_cache()
    seconds = statistics.median(samples)
    return {"bytes_per_s": 2 * nbytes / seconds, "method": method, "seconds": samples, "device": str(device)}


def decode_context_len(prompt_len: int, output_len: int) -> float:
    """Mean context a decode step of the benchmark reads: the prompt plus half the output."""
    return prompt_len + output_len / 2


def roofline_table(arch: ArchConfig, concurrency: list[int], prompt_len: int, output_len: int,
                   bandwidth: dict, weight_bytes: float, kv_bytes: float, quantized_bytes: float | None = None) -> dict:
    """``result["roofline"]``: the bytes, floor step time and ceiling decode tok/s per concurrency."""
    bw = bandwidth["bytes_per_s"]
    ctx = decode_context_len(prompt_len, output_len)
    rows = []
    for c in sorted(set(concurrency)):
        parts = decode_step_bytes(arch, c, ctx, weight_bytes, kv_bytes, quantized_bytes)
        floor = parts["total"] / bw
        rows.append({"concurrency": c, "context_len": ctx, "bytes": parts, "floor_step_s": floor,
                     "ceiling_decode_tok_s": c / floor})
    return {"bandwidth_bytes_per_s": bw, "bandwidth_method": bandwidth["method"],
            "bandwidth_samples_s": bandwidth.get("seconds"), "weight_bytes_per_element": weight_bytes,
            "quantized_weight_bytes_per_element": weight_bytes if quantized_bytes is None else quantized_bytes,
            "kv_bytes_per_element": kv_bytes, "per_concurrency": rows}


def attach_roofline_fractions(engines: list[dict], roofline: dict) -> None:
    """Set ``roofline_fraction`` = measured / ceiling on every engine's decode rows."""
    ceilings = {r["concurrency"]: r["ceiling_decode_tok_s"] for r in roofline.get("per_concurrency", [])}
    for e in engines:
        for row in e.get("results", []):
            c = row.get("concurrency")
            if row.get("workload") == "decode" and c in ceilings and "decode_tok_s" in row:
                row["roofline_fraction"] = row["decode_tok_s"] / ceilings[c]
