"""FlashInfer operators against the torch reference on fresh random inputs (needs a CUDA GPU).

Tolerances: bf16 results are compared by relative Frobenius error, ``|out - ref| / |ref|``; bf16 operands
land between 1e-3 and 1e-2, so 2e-2 is the bound unless a test states another.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

BF16_REL = 2e-2


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def dev():
    return torch.device("cuda", 0)


# --- attention ---------------------------------------------------------------------------------

def _paged_case(gen, page_size, num_kv_heads, head_dim, specs, num_pages=512):
    """A KV cache with random history and a batch of (cached, new) token counts per request."""
    from moeserve.ops.kv_cache import KVCache
    from moeserve.engine.sampling_params import SamplingParams
    from moeserve.engine.scheduler import ScheduledSeq
    from moeserve.engine.sequence import Sequence
    kv = KVCache(1, num_pages, page_size, num_kv_heads, head_dim, torch.bfloat16, dev())
    kv.data.normal_(generator=gen)
    free = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0)).add(1).tolist()
    items = []
    for i, (cached, new) in enumerate(specs):
        s = Sequence(f"s{i}", [1] * (cached + new), SamplingParams())
        npages = -(-(cached + new) // page_size)
        s.pages = [free.pop() for _ in range(npages)]
        items.append(ScheduledSeq(s, cached, new).request())
    return kv, items


def _run_attention(cls, kv, items, num_heads, num_kv_heads, head_dim, q, k, v, **kw):
    from moeserve.engine.batch import BatchBuilder
    builder = BatchBuilder(kv.page_size, 8192, 64, kv.num_pages + 64, dev())
    batch = builder.build(items)
    attn = cls(kv, num_heads, num_kv_heads, head_dim, head_dim ** -0.5, dev(), torch.bfloat16, **kw)
    attn.begin(batch.attn)
    return attn.forward(0, q, k, v)


@pytest.mark.parametrize("heads, kv_heads", [(16, 16), (32, 4)])  # CUDA-core decode; tensor-core decode (group 8)
@pytest.mark.parametrize("kind", ["prefill", "chunked", "decode", "mixed"])
def test_flashinfer_attention_matches_torch(heads, kv_heads, kind):
    from moeserve.ops.attention.flashinfer import FlashInferAttention
    from moeserve.ops.attention.torch_ref import TorchAttention
    g = torch.Generator(device=dev()).manual_seed(hash((heads, kind)) % 1000)
    head_dim, page_size = 128, 16
    specs = {
        "prefill": [(0, 37), (0, 100), (0, 1)],
        "chunked": [(64, 50), (17, 30), (100, 7)],
        "decode": [(5, 1), (130, 1), (1000, 1), (16, 1)],
        "mixed": [(300, 1), (0, 45), (77, 20), (9, 1)],
    }[kind]
    kv, items = _paged_case(g, page_size, kv_heads, head_dim, specs)
    t = sum(n for _, n in specs)
    q = torch.randn(t, heads, head_dim, device=dev(), dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, kv_heads, head_dim, device=dev(), dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, kv_heads, head_dim, device=dev(), dtype=torch.bfloat16, generator=g)
    kv_ref = type(kv).__new__(type(kv))
    kv_ref.__dict__.update(kv.__dict__)
    kv_ref.data = kv.data.clone()
    ref = _run_attention(TorchAttention, kv_ref, items, heads, kv_heads, head_dim, q, k, v)
    out = _run_attention(FlashInferAttention, kv, items, heads, kv_heads, head_dim, q, k, v)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < BF16_REL
    # FlashInfer's append wrote exactly what the reference wrote
    assert torch.equal(kv.data, kv_ref.data)


def test_flashinfer_decode_graph_matches_eager():
    from moeserve.engine.batch import BatchBuilder
    from moeserve.ops.attention.flashinfer import FlashInferAttention
    g = torch.Generator(device=dev()).manual_seed(7)
    heads, kv_heads, head_dim, page_size, bucket = 32, 4, 128, 16, 8
    kv, _ = _paged_case(g, page_size, kv_heads, head_dim, [])
    attn = FlashInferAttention(kv, heads, kv_heads, head_dim, head_dim ** -0.5, dev(), torch.bfloat16)
    attn.init_graph(bucket, 64)
    builder = BatchBuilder(page_size, 8192, 64, kv.num_pages + 64, dev())
    q = torch.zeros(bucket, heads, head_dim, device=dev(), dtype=torch.bfloat16)
    k = torch.zeros(bucket, kv_heads, head_dim, device=dev(), dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    attn.begin_graph(bucket, builder.build([], pad_to=bucket).attn)
    attn.forward(0, q, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = attn.forward(0, q, k, v)
    for trial, specs in enumerate([[(10, 1), (200, 1), (33, 1)], [(500, 1)] * 8, [(1, 1), (63, 1)]]):
        kv2, items = _paged_case(g, page_size, kv_heads, head_dim, specs)
        kv.data.copy_(kv2.data)
        n = len(specs)
        q[:] = torch.randn(bucket, heads, head_dim, device=dev(), dtype=torch.bfloat16, generator=g)
        k[:] = torch.randn(bucket, kv_heads, head_dim, device=dev(), dtype=torch.bfloat16, generator=g)
        v[:] = torch.randn(bucket, kv_heads, head_dim, device=dev(), dtype=torch.bfloat16, generator=g)
        snapshot = kv.data.clone()
        attn.begin_graph(bucket, builder.build(items, pad_to=bucket).attn)
        graph.replay()
        got = out_static[:n].clone()
        kv.data.copy_(snapshot)
        eager = _run_attention(FlashInferAttention, kv, items, heads, kv_heads, head_dim, q[:n], k[:n], v[:n])
        assert rel_err(got, eager) < 1e-3, f"trial {trial}"


@pytest.mark.parametrize("copies", [False, True])
def test_triton_decode_graph_follows_its_steps_with_the_copies_left_to_the_caller(copies):
    """A decode graph of the one-kernel Triton decode (``forward_qkv``), replayed over new steps: with
    ``begin_graph(..., copies=[])`` the backend plans nothing and hands over the step's positions, ``kv_indptr`` and
    ``kv_indices``, which ``feed_step_inputs`` copies in (as the engine's replay does); without, it plans and copies
    them itself. Either way each replay matches the same step run eagerly by a fresh backend (bf16 tolerance) and
    writes the same keys and values into the cache (bit for bit, the padding rows' page 0 aside)."""
    from moeserve.engine.batch import BatchBuilder
    from moeserve.ops.attention.flashinfer import FlashInferAttention
    from moeserve.ops.basic import rope_cos_sin_cache
    from moeserve.ops.inputs_triton import feed_step_inputs
    g = torch.Generator(device=dev()).manual_seed(23)
    heads, kv_heads, head_dim, page_size, bucket = 16, 16, 128, 16, 4
    kv, _ = _paged_case(g, page_size, kv_heads, head_dim, [])
    cos_sin = rope_cos_sin_cache(head_dim, 4096, 1e6, None, dev())

    def backend(cache):
        a = FlashInferAttention(cache, heads, kv_heads, head_dim, head_dim ** -0.5, dev(), torch.bfloat16)
        assert a.enable_triton_decode(8, head_dim)
        return a
    attn = backend(kv)
    attn.init_graph(bucket, 64)
    assert attn.graph_variants(bucket) == ("triton", "flashinfer")
    builder = BatchBuilder(page_size, 8192, 64, kv.num_pages + 64, dev())
    qkv = torch.zeros(bucket, (heads + 2 * kv_heads) * head_dim, device=dev(), dtype=torch.bfloat16)
    pos = torch.zeros(bucket, dtype=torch.int32, device=dev())
    attn.begin_graph(bucket, builder.build([], pad_to=bucket).attn, "triton")
    attn.forward_qkv(0, qkv, pos, cos_sin, None, None, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = attn.forward_qkv(0, qkv, pos, cos_sin, None, None, 1e-6)
    for trial, specs in enumerate([[(10, 1), (200, 1), (33, 1)], [(500, 1)] * 4, [(1, 1), (63, 1)]]):
        kv2, items = _paged_case(g, page_size, kv_heads, head_dim, specs)
        kv.data.copy_(kv2.data)
        n = len(specs)
        batch = builder.build(items, pad_to=bucket)
        qkv.copy_(torch.randn(qkv.shape, device=dev(), dtype=torch.bfloat16, generator=g))
        snapshot = kv.data.clone()
        handed = [] if copies else None
        assert attn.begin_graph(bucket, batch.attn, copies=handed) == "triton"
        if copies:  # the positions, the page list's offsets and the pages; nothing planned
            assert [b.data_ptr() for _, b in handed] == [attn.graphs[bucket].inputs.kv_indptr.data_ptr(),
                                                         attn.graphs[bucket].inputs.kv_indices.data_ptr(),
                                                         attn.graphs[bucket].inputs.token_positions.data_ptr()]
        feed_step_inputs(torch.empty_like(pos), pos, batch.input_ids, batch.positions, copies=handed or ())
        graph.replay()
        got = out_static[:n].clone()
        got_cache = kv.data.clone()
        kv.data.copy_(snapshot)
        ref_attn = backend(kv)
        eager_batch = BatchBuilder(page_size, 8192, 64, kv.num_pages + 64, dev()).build(items)  # own buffers
        ref_attn.begin(eager_batch.attn)
        assert ref_attn.decode_variant == "triton"
        eager = ref_attn.forward_qkv(0, qkv[:n], eager_batch.positions, cos_sin, None, None, 1e-6)
        torch.cuda.synchronize()
        assert rel_err(got, eager) < BF16_REL, f"trial {trial}"
        # page 0 takes the padding rows' keys in the graph only
        assert torch.equal(got_cache[:, 1:], kv.data[:, 1:]), f"trial {trial}: the cache"


# --- norm, rope, activation --------------------------------------------------------------------

def test_flashinfer_norms_match_torch():
    from moeserve.ops.basic import FlashInferNorm, TorchNorm
    g = torch.Generator(device=dev()).manual_seed(1)
    x = torch.randn(77, 2048, device=dev(), dtype=torch.bfloat16, generator=g)
    r = torch.randn(77, 2048, device=dev(), dtype=torch.bfloat16, generator=g)
    w = torch.rand(2048, device=dev(), dtype=torch.bfloat16, generator=g) + 0.5
    fi, ref = FlashInferNorm(), TorchNorm()
    assert rel_err(fi.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6)) < BF16_REL
    heads = torch.randn(77, 8, 128, device=dev(), dtype=torch.bfloat16, generator=g)
    hw = torch.rand(128, device=dev(), dtype=torch.bfloat16, generator=g) + 0.5
    assert rel_err(fi.rmsnorm(heads, hw, 1e-6), ref.rmsnorm(heads, hw, 1e-6)) < BF16_REL
    y_ref, res_ref = ref.add_rmsnorm(x, r, w, 1e-6)
    y, res = fi.add_rmsnorm(x.clone(), r.clone(), w, 1e-6)
    assert rel_err(res, res_ref) < 1e-2 and rel_err(y, y_ref) < BF16_REL


@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_flashinfer_rope_matches_torch(rotary_dim):
    from moeserve.ops.basic import FlashInferRope, TorchRope, rope_cos_sin_cache
    g = torch.Generator(device=dev()).manual_seed(2)
    cache = rope_cos_sin_cache(rotary_dim, 4096, 1e6, None, dev())
    pos = torch.randint(0, 4096, (50,), device=dev(), generator=g)
    q = torch.randn(50, 16 * 128, device=dev(), dtype=torch.bfloat16, generator=g)
    k = torch.randn(50, 4 * 128, device=dev(), dtype=torch.bfloat16, generator=g)
    q_ref, k_ref = TorchRope(128, rotary_dim, cache).apply(pos, q.clone(), k.clone())
    q_fi, k_fi = FlashInferRope(128, rotary_dim, cache).apply(pos, q.clone(), k.clone())
    assert rel_err(q_fi, q_ref) < BF16_REL and rel_err(k_fi, k_ref) < BF16_REL


def test_flashinfer_silu_and_mul_matches_torch():
    from moeserve.ops.basic import FlashInferActivation, TorchActivation
    x = torch.randn(33, 2 * 1408, device=dev(), dtype=torch.bfloat16)
    assert rel_err(FlashInferActivation().silu_and_mul(x), TorchActivation().silu_and_mul(x)) < BF16_REL


# --- MoE -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("E, I, H, k", [(60, 1408, 2048, 4), (128, 768, 2048, 8)])
@pytest.mark.parametrize("T", [1, 16, 300])
def test_flashinfer_cutlass_moe_matches_torch(E, I, H, k, T):
    from types import SimpleNamespace

    from moeserve.ops.moe.flashinfer_backend import FlashInferMoE
    from moeserve.ops.moe.routing import RoutingConfig, softmax_topk
    from moeserve.ops.moe.torch_ref import torch_moe
    g = torch.Generator(device=dev()).manual_seed(T)
    x = torch.randn(T, H, device=dev(), dtype=torch.bfloat16, generator=g)
    w13 = (torch.randn(E, 2 * I, H, device=dev(), generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev(), generator=g) / I ** 0.5).bfloat16()
    weights, ids = softmax_topk(torch.randn(T, E, device=dev(), generator=g), k, True)
    ref = torch_moe(x.float(), w13.float(), w2.float(), weights, ids)
    layer = SimpleNamespace(w13=torch.nn.Parameter(w13.clone(), requires_grad=False), w2=w2, top_k=k,
                            routing=RoutingConfig("softmax", k, True), num_experts=E, w13_scale_inv=None,
                            w2_scale_inv=None, w13_order="gate_up")
    moe = FlashInferMoE(dev(), torch.bfloat16)
    moe.prepare(layer)
    assert layer.w13_order == "up_gate"
    out = moe.experts(x, weights, ids, layer)
    assert out.shape == (T, H) and rel_err(out, ref) < BF16_REL


# --- sampling ------------------------------------------------------------------------------------

def _batch(n, **kw):
    from moeserve.ops.sampling import SamplingBatch
    d = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    d.update(kw)
    return SamplingBatch(
        temperature=torch.full((n,), d["temperature"], device=dev()),
        top_k=torch.full((n,), d["top_k"], dtype=torch.int32, device=dev()),
        top_p=torch.full((n,), d["top_p"], device=dev()), min_p=torch.full((n,), d["min_p"], device=dev()),
        greedy=[d["temperature"] == 0] * n, seeds=kw.get("seeds", [None] * n), steps=[0] * n,
        keys=[f"r{i}" for i in range(n)], filters=[(d["top_k"] > 0, d["top_p"] < 1, d["min_p"] > 0)] * n)


@pytest.mark.parametrize("filters", [dict(), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.6),
                                     dict(min_p=0.2), dict(top_k=8, top_p=0.8), dict(top_k=6, min_p=0.1)])
def test_flashinfer_sampler_distribution_matches_torch(filters):
    """Same logits in every row; the empirical distributions of both samplers must agree (total variation
    distance < 0.05 with 20000 draws each) and FlashInfer must never draw a token the filters exclude."""
    from moeserve.ops.sampling import FlashInferSampler, TorchSampler, _filter_logits
    n, vocab = 20000, 32
    g = torch.Generator(device=dev()).manual_seed(11)
    logits = (torch.randn(1, vocab, device=dev(), generator=g) * 2).expand(n, vocab).contiguous()
    batch = _batch(n, **filters)
    fi = FlashInferSampler(dev(), seed=1).sample(logits, batch)
    ref = TorchSampler(dev(), seed=1).sample(logits, _batch(n, **filters))
    p_fi = torch.bincount(fi, minlength=vocab).float() / n
    p_ref = torch.bincount(ref, minlength=vocab).float() / n
    allowed = torch.isfinite(_filter_logits(logits[:1] / filters.get("temperature", 1.0), batch.top_k[:1],
                                            batch.top_p[:1], batch.min_p[:1]))[0]
    assert p_fi[~allowed].sum() == 0
    assert 0.5 * (p_fi - p_ref).abs().sum().item() < 0.05


def test_flashinfer_seeded_rows_do_not_depend_on_the_batch():
    from moeserve.ops.sampling import FlashInferSampler
    s = FlashInferSampler(dev(), seed=3)
    logits = torch.randn(4, 1000, device=dev())
    a = s.sample(logits, _batch(4, top_p=0.9, seeds=[5, None, 6, None]))
    b = s.sample(logits[2:3], _batch(1, top_p=0.9, seeds=[6]))
    c = s.sample(logits[:1], _batch(1, top_p=0.9, seeds=[5]))
    assert b.item() == a[2].item() and c.item() == a[0].item()
