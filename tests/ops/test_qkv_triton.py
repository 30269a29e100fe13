"""The attention's QKV kernel (q/k RMSNorm, neox rotary embedding, q out, k and v into the paged cache) against
its torch reference: on the CPU under Triton's interpreter (float32, one subprocess), on a GPU (``-m gpu``) in
bf16 at the Qwen1.5-MoE and Qwen3-MoE attention shapes, also against FlashInfer's unfused rotary, norm and append
kernels (the path it replaces) and inside a CUDA graph.

Each case is a step of several requests with cached history and new tokens (decodes and prefill chunks) whose
pages are scattered over the cache; the whole cache is compared, so a write to a wrong slot fails too. Inputs are
fresh random each run; the seed is in failure messages (``MOESERVE_TEST_SEED`` replays one).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_REL = 1e-2  # relative Frobenius error of bf16 results (one rounding apart at most)

# name: (Hq, Hkv, D, rotary dim, q/k norm, page size, [(cached, new) per request])
CASES = {
    "mha-decode": (4, 4, 32, 32, False, 4, [(5, 1), (0, 1), (11, 1)]),
    "gqa-norm-mixed": (8, 2, 64, 64, True, 4, [(3, 6), (9, 1), (0, 5)]),
    "partial-rotary-norm": (4, 2, 32, 16, True, 8, [(7, 3), (1, 1)]),
    "odd-heads": (6, 3, 32, 32, False, 4, [(2, 2), (4, 1)]),
    "empty": (4, 4, 32, 32, False, 4, []),
}


def make_case(spec, dtype, gen, device="cpu", num_pages=24, max_pos=64):
    hq, hkv, d, rot, norm, page, reqs = spec
    t = sum(new for _, new in reqs)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    cos_sin = torch.randn(max_pos, rot, generator=gen).float()  # any table: the kernel reads what it is given
    cache = torch.randn(num_pages, 2, page, hkv, d, generator=gen).to(dtype)
    free = torch.randperm(num_pages - 1, generator=gen).add(1).tolist()
    pos, bidx, indptr, indices = [], [], [0], []
    for b, (cached, new) in enumerate(reqs):
        n = -(-(cached + new) // page)
        indices += [free.pop() for _ in range(n)]
        indptr.append(len(indices))
        pos += list(range(cached, cached + new))
        bidx += [b] * new
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    qn = torch.randn(d, generator=gen).to(dtype) if norm else None
    kn = torch.randn(d, generator=gen).to(dtype) if norm else None
    args = [qkv, i32(pos), cos_sin, hq, hkv, d, cache, i32(bidx), i32(pos), i32(indices), i32(indptr), qn, kn]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def run_both(args, fn, ref):
    """``(q, cache)`` of the kernel and of the reference, each on its own copy of the cache."""
    a, b = list(args), list(args)
    a[6], b[6] = args[6].clone(), args[6].clone()
    return (fn(*a, eps=1e-6), a[6]), (ref(*b, eps=1e-6), b[6])


# ---------------------------------------------------------------- CPU: Triton interpreter

def _interpreter_worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.attention.qkv_triton import qkv_rope_append
    out = {}
    for name, args in torch.load(in_path).items():
        cache = args[6].clone()
        q = qkv_rope_append(*args[:6], cache, *args[7:], eps=1e-6)
        # the same into the first rows of a given buffer (the piecewise graphs' fixed q), the rest poisoned
        t, hq, d = args[0].shape[0], args[3], args[5]
        buf = torch.full((t + 3, hq, d), float("nan"))
        view = buf[:t]
        into = qkv_rope_append(*args[:6], args[6].clone(), *args[7:], eps=1e-6, out=view)
        out[name] = (q, cache, buf, into is view)
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {name: make_case(spec, torch.float32, gen) for name, spec in CASES.items()}
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("qkv"), SEED)


@pytest.mark.parametrize("name", list(CASES))
def test_qkv_kernel_matches_the_reference_under_the_interpreter(interpreted, name):
    from moeserve.ops.attention.qkv_triton import qkv_rope_append_reference
    inputs, outputs = interpreted
    args = inputs[name]
    q, cache, buf, in_place = outputs[name]
    t = args[0].shape[0]
    assert in_place and torch.equal(buf[:t], q) and buf[t:].isnan().all(), "out= must get q and nothing past it"
    ref_cache = args[6].clone()
    ref_q = qkv_rope_append_reference(*args[:6], ref_cache, *args[7:], eps=1e-6)
    assert q.shape == (args[0].shape[0], args[3], args[5])
    torch.testing.assert_close(q, ref_q, **FP32_TOL, msg=lambda m: f"seed {SEED}: q: {m}")
    torch.testing.assert_close(cache, ref_cache, **FP32_TOL, msg=lambda m: f"seed {SEED}: cache: {m}")
    if args[0].shape[0]:
        assert not torch.equal(cache, args[6]), "no token was written"


def test_an_out_buffer_of_the_wrong_shape_or_layout_is_refused():
    from moeserve.ops.attention.qkv_triton import qkv_rope_append
    args = make_case(CASES["mha-decode"], torch.float32, torch.Generator().manual_seed(0))
    t, hq, d = args[0].shape[0], args[3], args[5]
    for bad in (torch.empty(t + 1, hq, d), torch.empty(t, hq, d, dtype=torch.bfloat16),
                torch.empty(hq, t, d).transpose(0, 1)):
        with pytest.raises(ValueError, match="qkv_rope_append: out"):
            qkv_rope_append(*args, out=bad)


def test_reference_rotates_like_the_torch_rope_backend():
    """The reference's rotation is the engine's torch rotary embedding (no norms), and its writes go to the
    slots the torch attention backend computes from ``slot_mapping``."""
    from moeserve.ops.attention.qkv_triton import qkv_rope_append_reference
    from moeserve.ops.basic import TorchRope
    gen = torch.Generator().manual_seed(SEED)
    args = make_case(CASES["partial-rotary-norm"][:4] + (False,) + CASES["partial-rotary-norm"][5:], torch.float32,
                     gen)
    qkv, pos, cos_sin, hq, hkv, d, cache = args[:7]
    before = cache.clone()
    q = qkv_rope_append_reference(*args, eps=1e-6)
    rq, rk = TorchRope(d, cos_sin.shape[1], cos_sin).apply(pos.long(), qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d])
    torch.testing.assert_close(q.view(len(pos), -1), rq, **FP32_TOL)
    page = cache.shape[2]
    indices, indptr, bidx = args[9].long(), args[10].long(), args[7].long()
    slots = indices[indptr[bidx] + pos.long() // page] * page + pos.long() % page
    flat = cache.view(cache.shape[0], 2, page, -1).transpose(1, 2).reshape(-1, 2, hkv * d)
    torch.testing.assert_close(flat[slots, 0], rk, **FP32_TOL)
    torch.testing.assert_close(flat[slots, 1], qkv[:, (hq + hkv) * d:], **FP32_TOL)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    flat_before = before.view(before.shape[0], 2, page, -1).transpose(1, 2).reshape(-1, 2, hkv * d)
    assert torch.equal(flat[untouched], flat_before[untouched])


if __name__ == "__main__" and is_worker(sys.argv):
    _interpreter_worker(sys.argv[2], sys.argv[3])


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Qwen1.5-MoE (MHA, no q/k norm, bias-free here) and Qwen3-MoE (GQA 32/4, q/k norm) attention shapes
GPU_CASES = {
    "qwen1.5-decode": (16, 16, 128, 128, False, 16, [(500, 1), (37, 1), (0, 1), (130, 1)]),
    "qwen1.5-mixed": (16, 16, 128, 128, False, 16, [(100, 1), (0, 300), (16, 17)]),
    "qwen3-decode": (32, 4, 128, 128, True, 16, [(511, 1), (3, 1)]),
    "qwen3-prefill": (32, 4, 128, 128, True, 16, [(0, 512), (64, 100)]),
}


def _rope_cache(rot, max_pos=4096):
    from moeserve.ops.basic import rope_cos_sin_cache
    return rope_cos_sin_cache(rot, max_pos, 1e6, None, torch.device("cuda"))


@gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_qkv_kernel_matches_the_reference_and_flashinfer_gpu(name):
    """bf16 on the GPU: against the torch reference, and against the path it replaces (FlashInfer's norm, its
    rotary embedding in place, the copy of q, ``append_paged_kv_cache``)."""
    from flashinfer.norm import rmsnorm
    from flashinfer.page import append_paged_kv_cache
    from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

    from moeserve.ops.attention.qkv_triton import qkv_rope_append, qkv_rope_append_reference
    gen = torch.Generator().manual_seed(SEED)
    spec = GPU_CASES[name]
    args = make_case(spec, torch.bfloat16, gen, "cuda", num_pages=96, max_pos=4096)
    args[2] = _rope_cache(spec[3])
    (q, cache), (ref_q, ref_cache) = run_both(args, qkv_rope_append, qkv_rope_append_reference)
    torch.cuda.synchronize()
    assert (q.float() - ref_q.float()).norm() / ref_q.float().norm() < BF16_REL, f"seed {SEED}"
    assert (cache.float() - ref_cache.float()).norm() / ref_cache.float().norm() < BF16_REL, f"seed {SEED}"

    qkv, pos, cos_sin, hq, hkv, d, cache0, bidx, kvpos, indices, indptr, qn, kn = args
    t = qkv.shape[0]
    qq, kk, vv = qkv.clone().split([hq * d, hkv * d, hkv * d], dim=-1)
    qq, kk = qq.reshape(t, hq, d).contiguous(), kk.reshape(t, hkv, d).contiguous()
    if qn is not None:
        qq, kk = rmsnorm(qq, qn, 1e-6), rmsnorm(kk, kn, 1e-6)
    qq, kk = qq.view(t, -1), kk.view(t, -1)
    apply_rope_with_cos_sin_cache_inplace(pos, qq, kk, d, cos_sin, is_neox=True)
    fi_cache = cache0.clone()
    page = cache0.shape[2]
    seq_lens = torch.tensor([c + n for c, n in spec[6]], dtype=torch.int32, device="cuda")
    last = ((seq_lens - 1) % page + 1).int()
    append_paged_kv_cache(kk.view(t, hkv, d), vv.reshape(t, hkv, d), bidx, kvpos, fi_cache, indices, indptr, last,
                          kv_layout="NHD")
    torch.cuda.synchronize()
    # the same rounding points: bit-equal or one bf16 rounding apart
    torch.testing.assert_close(q.view(t, -1), qq, rtol=1.6e-2, atol=1e-2, msg=lambda m: f"seed {SEED}: q: {m}")
    torch.testing.assert_close(cache, fi_cache, rtol=1.6e-2, atol=1e-2, msg=lambda m: f"seed {SEED}: cache: {m}")


@gpu
@needs_cuda
def test_qkv_kernel_replays_in_a_cuda_graph_with_new_positions():
    """Captured once, replayed with new inputs and positions in the same buffers: the writes follow the buffers."""
    from moeserve.ops.attention.qkv_triton import qkv_rope_append, qkv_rope_append_reference
    gen = torch.Generator().manual_seed(SEED)
    spec = (16, 16, 128, 128, False, 16, [(40, 1), (7, 1), (200, 1)])
    args = make_case(spec, torch.bfloat16, gen, "cuda", num_pages=64)
    args[2] = _rope_cache(128)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        qkv_rope_append(*args, eps=1e-6)  # load the kernel outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = qkv_rope_append(*args, eps=1e-6)
    new = make_case(spec[:6] + ([(41, 1), (8, 1), (201, 1)],), torch.bfloat16, gen, "cuda", num_pages=64)
    for i in (0, 1, 7, 8, 9, 10):  # qkv, positions, batch, kv positions, pages, indptr: same buffers, new values
        args[i].copy_(new[i])
    expect_cache = args[6].clone()
    expect_q = qkv_rope_append_reference(*args[:6], expect_cache, *args[7:], eps=1e-6)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q, qkv_rope_append(*args[:6], args[6].clone(), *args[7:], eps=1e-6))
    assert (q.float() - expect_q.float()).norm() / expect_q.float().norm() < BF16_REL
    assert (args[6].float() - expect_cache.float()).norm() / expect_cache.float().norm() < BF16_REL
