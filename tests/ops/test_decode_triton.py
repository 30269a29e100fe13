"""The one-kernel decode attention (q/k norm, rotary embedding, KV append, split-KV attention merged in the kernel)
against its torch reference: on the CPU under Triton's interpreter (float32, one subprocess), on a GPU (``-m gpu``)
in bf16 at the Qwen1.5-MoE and Qwen3-MoE attention shapes, also against the path it replaces (the QKV kernel and
FlashInfer's decode) and inside a CUDA graph replayed with new positions.

Each case is a decode step of several requests of different lengths (one with no history) whose pages are
scattered over the cache; the split count is varied through the workspace's SM count, so one split, several, and
splits with no keys all run. The whole cache is compared, so a write to a wrong slot fails too. Inputs are fresh
random each run; the seed is in failure messages (``MOESERVE_TEST_SEED`` replays one).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from test_qkv_triton import make_case  # noqa: E402
from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
BF16_REL = 1e-2  # relative Frobenius error of bf16 results

# name: (Hq, Hkv, D, rotary dim, q/k norm, page size, [(cached, 1) per request])
CASES = {
    "mha": (4, 4, 32, 32, False, 4, [(137, 1), (0, 1), (11, 1)]),
    "gqa-norm": (8, 2, 32, 32, True, 4, [(3, 1), (45, 1), (16, 1)]),
    "partial-rotary": (4, 2, 32, 16, True, 8, [(23, 1), (1, 1)]),
    "odd-heads": (6, 3, 32, 32, False, 4, [(2, 1), (30, 1)]),
}
SMS = [1, 8, 128]  # the workspace's SM count: 1 split, a few, 16 (most of them empty)


def decode_args(args):
    """``make_case``'s arguments without the batch indices (a decode step's token t is request t)."""
    return args[:7] + args[8:]


def _num_splits(spec, sms):
    from moeserve.ops.attention.decode_triton import num_splits
    return num_splits(len(spec[6]), spec[1], sms)


# ---------------------------------------------------------------- CPU: Triton interpreter

def _interpreter_worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.attention import decode_triton
    from moeserve.ops.attention.decode_triton import DecodeWorkspace, qkv_decode_attention
    out = {}
    for (name, sms), (args, scale) in torch.load(in_path).items():
        hq, hkv, d = args[3], args[4], args[5]
        ws = DecodeWorkspace(8, hq, hkv, d, torch.device("cpu"), num_sms=sms)
        cache = args[6].clone()
        # 16 keys per iteration: several splits hold keys; then the default tile on a fresh copy of the cache
        o = qkv_decode_attention(*args[:6], cache, *args[8:], eps=1e-6, scale=scale, workspace=ws, block=16)
        o64 = qkv_decode_attention(*args[:6], args[6].clone(), *args[8:], eps=1e-6, scale=scale, workspace=ws)
        # the new token's key and value read after the cached keys (NEW_EARLY off), on a fresh copy of the cache
        decode_triton.NEW_EARLY = not decode_triton.NEW_EARLY
        late_cache = args[6].clone()
        late = qkv_decode_attention(*args[:6], late_cache, *args[8:], eps=1e-6, scale=scale, workspace=ws, block=16)
        decode_triton.NEW_EARLY = not decode_triton.NEW_EARLY
        # again on the same workspace (the counters must be back at zero), into a given buffer
        buf = torch.full((o.shape[0] + 2, hq, d), float("nan"))
        again = qkv_decode_attention(*args[:6], args[6].clone(), *args[8:], eps=1e-6, scale=scale, workspace=ws,
                                     out=buf[:o.shape[0]], block=16)
        out[(name, sms)] = (o, o64, cache, buf, again.data_ptr() == buf.data_ptr(), ws.counter.clone(), late,
                            late_cache)
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {}
    for name, spec in CASES.items():
        args = make_case(spec, torch.float32, gen, num_pages=48, max_pos=256)
        for sms in SMS:
            inputs[(name, sms)] = (args, spec[2] ** -0.5)
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("decode"), SEED)


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("name", list(CASES))
def test_decode_kernel_matches_the_reference_under_the_interpreter(interpreted, name, sms):
    from moeserve.ops.attention.decode_triton import decode_attention_reference
    inputs, outputs = interpreted
    args, scale = inputs[(name, sms)]
    o, o64, cache, buf, in_place, counter, late, late_cache = outputs[(name, sms)]
    t = args[0].shape[0]
    ref_cache = args[6].clone()
    ref = decode_attention_reference(*args[:6], ref_cache, *args[8:], eps=1e-6, scale=scale)
    assert o.shape == ref.shape == (t, args[3], args[5])
    torch.testing.assert_close(o, ref, **FP32_TOL, msg=lambda m: f"seed {SEED}, {name}, sms {sms}: out: {m}")
    torch.testing.assert_close(o64, ref, **FP32_TOL, msg=lambda m: f"seed {SEED}, {name}, sms {sms}: 64 keys: {m}")
    torch.testing.assert_close(cache, ref_cache, **FP32_TOL, msg=lambda m: f"seed {SEED}: cache: {m}")
    # both places of the new token's reads (decode_triton.NEW_EARLY): the same output and cache
    torch.testing.assert_close(late, o, **FP32_TOL, msg=lambda m: f"seed {SEED}, {name}, sms {sms}: late: {m}")
    assert torch.equal(late_cache, cache), "the new key and value must reach the same slots either way"
    assert not torch.equal(cache, args[6]), "no key was written"
    assert in_place and torch.equal(buf[:t], o) and buf[t:].isnan().all(), "out= must get the output, nothing past it"
    assert not counter.any(), "every (token, head) counter must be back at zero"


def test_the_cases_cover_one_split_several_and_empty_ones():
    from moeserve.ops.attention.decode_triton import BLOCK_N
    splits = {_num_splits(spec, sms) for spec in CASES.values() for sms in SMS}
    assert 1 in splits and max(splits) == 16 and len(splits) >= 3
    # splits are whole tiles: with 16 splits a request of at most 16 * 16 keys leaves some without keys, and with
    # the default tile a request longer than one tile fills two splits or more when there are several
    lens = [c + 1 for spec in CASES.values() for c, _ in spec[6]]
    assert max(lens) < 16 * 16 and max(lens) > BLOCK_N


def test_steps_with_too_few_programs_for_the_sms_are_left_to_flashinfer():
    from moeserve.ops.attention.decode_triton import DecodeWorkspace
    mha = DecodeWorkspace(32, 16, 16, 128, torch.device("cpu"), num_sms=132)  # Qwen1.5-MoE: 256 programs at 1
    assert [mha.serves(t) for t in (1, 2, 32, 33)] == [True, True, True, False]
    gqa = DecodeWorkspace(32, 32, 4, 128, torch.device("cpu"), num_sms=132)  # Qwen3-MoE: 64 programs per token
    assert [gqa.serves(t) for t in (1, 2, 3, 32)] == [False, False, True, True]


def test_steps_with_a_request_past_the_context_bound_are_left_to_flashinfer():
    """``attention_decode_triton_max_context``: a step runs the kernel only while its longest request holds at
    most that many tokens (the bound itself included); without a length (graph capture) only the token count
    decides."""
    from moeserve.ops.attention.decode_triton import DecodeWorkspace
    ws = DecodeWorkspace(32, 16, 16, 128, torch.device("cpu"), num_sms=132, max_context=4096)
    assert [ws.serves(8, n) for n in (1, 560, 4096, 4097, 16384)] == [True, True, True, False, False]
    assert ws.serves(8) and not ws.serves(33, 100)
    unbounded = DecodeWorkspace(32, 16, 16, 128, torch.device("cpu"), num_sms=132)
    assert unbounded.serves(8, 1 << 20)


def test_bad_inputs_are_refused_by_name():
    from moeserve.ops.attention.decode_triton import DecodeWorkspace, qkv_decode_attention
    args = make_case(CASES["mha"], torch.float32, torch.Generator().manual_seed(0), num_pages=48, max_pos=256)
    small = DecodeWorkspace(2, 4, 4, 32, torch.device("cpu"), num_sms=4)
    with pytest.raises(ValueError, match="workspace holds 2"):
        qkv_decode_attention(*decode_args(args), eps=1e-6, scale=1.0, workspace=small)
    ws = DecodeWorkspace(8, 4, 4, 32, torch.device("cpu"), num_sms=4)
    with pytest.raises(ValueError, match="qkv_decode_attention: out"):
        qkv_decode_attention(*decode_args(args), eps=1e-6, scale=1.0, workspace=ws, out=torch.empty(3, 4, 31))
    bad_rot = list(args)
    bad_rot[2] = torch.zeros(64, 24)  # 8 dims unrotated: too few for the kernel's tiles
    with pytest.raises(ValueError, match="rotary width 24"):
        qkv_decode_attention(*decode_args(bad_rot), eps=1e-6, scale=1.0, workspace=ws)
    one_norm = list(args)
    assert one_norm[11] is None and one_norm[12] is None  # (q_norm, k_norm) of the MHA case
    one_norm[11] = torch.ones(32)
    with pytest.raises(ValueError, match="qkv_decode_attention: q_norm and k_norm go together"):
        qkv_decode_attention(*decode_args(one_norm), eps=1e-6, scale=1.0, workspace=ws)


def test_reference_is_plain_softmax_attention_over_the_written_cache():
    """The reference against an independent gather: each request's keys from its page list after the append."""
    from moeserve.ops.attention.decode_triton import decode_attention_reference
    from moeserve.ops.attention.qkv_triton import qkv_rope_append_reference
    gen = torch.Generator().manual_seed(SEED)
    spec = CASES["gqa-norm"]
    args = make_case(spec, torch.float32, gen, num_pages=48, max_pos=256)
    out = decode_attention_reference(*args[:6], args[6].clone(), *args[8:], eps=1e-6, scale=0.3)
    cache = args[6].clone()
    q = qkv_rope_append_reference(*args[:6], cache, *args[7:], eps=1e-6)
    hq, hkv, page = spec[0], spec[1], spec[5]
    indices, indptr = args[9].tolist(), args[10].tolist()
    for i, (cached, _) in enumerate(spec[6]):
        n = cached + 1
        slots = [(indices[indptr[i] + p // page], p % page) for p in range(n)]
        k = torch.stack([cache[pg, 0, off] for pg, off in slots])  # [n, hkv, d]
        v = torch.stack([cache[pg, 1, off] for pg, off in slots])
        for hh in range(hq):
            kv = hh // (hq // hkv)
            w = torch.softmax(k[:, kv] @ q[i, hh] * 0.3, dim=0)
            torch.testing.assert_close(out[i, hh], w @ v[:, kv], rtol=1e-5, atol=1e-6)


if __name__ == "__main__" and is_worker(sys.argv):
    _interpreter_worker(sys.argv[2], sys.argv[3])


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Qwen1.5-MoE (MHA 16/16) and Qwen3-MoE (GQA 32/4, q/k norm) decode shapes
GPU_CASES = {
    "qwen1.5-c1": (16, 16, 128, 128, False, 16, [(560, 1)]),
    "qwen1.5-c4": (16, 16, 128, 128, False, 16, [(500, 1), (37, 1), (0, 1), (1030, 1)]),
    "qwen1.5-c32": (16, 16, 128, 128, False, 16, [((97 * i) % 700, 1) for i in range(32)]),
    "qwen3-c3": (32, 4, 128, 128, True, 16, [(511, 1), (3, 1), (2047, 1)]),
}


def _rope_cache(rot, max_pos=4096):
    from moeserve.ops.basic import rope_cos_sin_cache
    return rope_cos_sin_cache(rot, max_pos, 1e6, None, torch.device("cuda"))


def _gpu_args(spec, gen):
    args = make_case(spec, torch.bfloat16, gen, "cuda", num_pages=1024, max_pos=4096)
    args[2] = _rope_cache(spec[3])
    return args


@gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_decode_kernel_matches_the_reference_and_flashinfer_gpu(name):
    """bf16: against the torch reference, and against the path it replaces (the QKV kernel, then FlashInfer's
    decode over the same pages)."""
    import flashinfer

    from moeserve.ops.attention.decode_triton import DecodeWorkspace, decode_attention_reference, qkv_decode_attention
    from moeserve.ops.attention.qkv_triton import qkv_rope_append
    gen = torch.Generator().manual_seed(SEED)
    spec = GPU_CASES[name]
    hq, hkv, d, page = spec[0], spec[1], spec[2], spec[5]
    args = _gpu_args(spec, gen)
    scale = d ** -0.5
    ws = DecodeWorkspace(64, hq, hkv, d, torch.device("cuda"))
    cache = args[6].clone()
    out = qkv_decode_attention(*args[:6], cache, *args[8:], eps=1e-6, scale=scale, workspace=ws)
    ref_cache = args[6].clone()
    ref = decode_attention_reference(*args[:6], ref_cache, *args[8:], eps=1e-6, scale=scale)
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < BF16_REL, f"seed {SEED}: relative error {err:.2e}"
    assert torch.equal(cache, ref_cache) or (cache.float() - ref_cache.float()).abs().max() < 1.6e-2
    assert not ws.counter.any()

    fi_cache = args[6].clone()
    q = qkv_rope_append(*args[:6], fi_cache, *args[7:], eps=1e-6)
    seq_lens = torch.tensor([c + 1 for c, _ in spec[6]], dtype=torch.int32)
    last = ((seq_lens - 1) % page + 1).int()
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=hq // hkv >= 4)
    wrapper.plan(args[10].cpu(), args[9], last, hq, hkv, d, page, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=scale)
    fi_out = wrapper.run(q, fi_cache)
    torch.cuda.synchronize()
    assert torch.equal(cache, fi_cache), "the same keys and values must reach the same slots"
    err = (out.float() - fi_out.float()).norm() / fi_out.float().norm()
    assert err < BF16_REL, f"seed {SEED}: against FlashInfer: relative error {err:.2e}"


@gpu
@needs_cuda
def test_decode_kernel_replays_in_a_cuda_graph_with_new_positions():
    """Captured once at a split count above one, replayed with new inputs, positions and pages in the same
    buffers: the output follows them and the counters return to zero each replay."""
    from moeserve.ops.attention.decode_triton import DecodeWorkspace, decode_attention_reference, qkv_decode_attention
    gen = torch.Generator().manual_seed(SEED)
    spec = (16, 16, 128, 128, False, 16, [(40, 1), (7, 1), (300, 1)])
    args = _gpu_args(spec, gen)
    pages = torch.zeros(64, dtype=torch.int32, device="cuda")  # the page list's fixed buffer, refilled per replay
    pages[:len(args[9])] = args[9]
    args[9] = pages
    ws = DecodeWorkspace(8, 16, 16, 128, torch.device("cuda"))
    assert _num_splits(spec, ws.num_sms) > 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qkv_decode_attention(*decode_args(args), eps=1e-6, scale=0.1, workspace=ws)  # load the kernel first
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qkv_decode_attention(*decode_args(args), eps=1e-6, scale=0.1, workspace=ws)
    for step in range(3):
        lens = [(41 + step * 50, 1), (8 + step, 1), (301 + step * 7, 1)]
        new = make_case(spec[:6] + (lens,), torch.bfloat16, gen, "cuda", num_pages=64)
        for i in (0, 1, 8, 10):  # qkv, positions, kv positions, indptr: same buffers, new values
            args[i].copy_(new[i])
        pages.zero_()
        pages[:len(new[9])] = new[9]
        expect_cache = args[6].clone()
        expect = decode_attention_reference(*args[:6], expect_cache, *args[8:], eps=1e-6, scale=0.1)
        graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - expect.float()).norm() / expect.float().norm()
        assert err < BF16_REL, f"seed {SEED}, replay {step}: relative error {err:.2e}"
        assert (args[6].float() - expect_cache.float()).abs().max() < 1.6e-2
        assert not ws.counter.any()
