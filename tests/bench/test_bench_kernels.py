"""The kernel bench on CPU: its torch references against naive loops, the skip rules, and the whole
check-and-time loop with the GPU kernels replaced by torch stand-ins (the real ones need CUDA)."""
import types

import pytest
import torch

from moeserve.bench import kernel_cases as C
from moeserve.bench import kernels as K
from moeserve.config import make_config, resolve_model_source
from moeserve.models import arch_from_hf


def shapes(**kw):
    base = dict(num_heads=4, num_kv_heads=2, head_dim=8, page_size=4, num_experts=4, intermediate=6, hidden=8,
                top_k=2, dtype=torch.float32, context_len=10, prompt_len=6, max_step_tokens=64)
    return K.Shapes(**dict(base, **kw))


def naive_attention(sh, inp):
    """One query at a time, gathering keys and values page by page."""
    out = torch.empty(inp["q"].shape, dtype=torch.float32)
    n, qn = inp["kv_len"], inp["q_len"]
    group = sh.num_heads // sh.num_kv_heads
    for b in range(inp["batch"]):
        pages = inp["block_tables"][b].tolist()
        toks = [(p, o) for p in pages for o in range(sh.page_size)][:n]
        keys = torch.stack([inp["kv"][p, 0, o] for p, o in toks]).float()  # [n, Hkv, D]
        vals = torch.stack([inp["kv"][p, 1, o] for p, o in toks]).float()
        for i in range(qn):
            pos = n - qn + i
            for h in range(sh.num_heads):
                q = inp["q"][b * qn + i, h].float()
                s = keys[: pos + 1, h // group] @ q * sh.scale
                out[b * qn + i, h] = torch.softmax(s, 0) @ vals[: pos + 1, h // group]
    return out


@pytest.mark.parametrize("q_len", [1, 6])
def test_attention_reference_matches_a_naive_loop(q_len):
    sh = shapes()
    gen = torch.Generator().manual_seed(0)
    inp = K.paged_inputs(sh, batch=3, kv_len=10 if q_len == 1 else 6, q_len=q_len, device="cpu", gen=gen)
    assert inp["block_tables"].shape == (3, -(-inp["kv_len"] // 4))
    assert 0 not in inp["indices"].tolist()  # page 0 stays unused, as in the engine
    torch.testing.assert_close(K.attention_reference(sh, inp), naive_attention(sh, inp), atol=1e-5, rtol=1e-5)


def test_skip_rules_name_the_hardware():
    assert "FA3 needs sm90" in K.skip_reason("sm90", (8, 0), True)
    assert K.skip_reason("sm90", (9, 0), True) is None
    assert "XQA" in K.skip_reason("xqa", (8, 9), True) and K.skip_reason("xqa", (9, 0), True) is None
    assert "sm100" in K.skip_reason("sm100", (9, 0), True)
    assert "no module for sm80" in K.skip_reason("cutlass", (8, 0), True)
    assert K.skip_reason("cutlass", (9, 0), True) is None
    assert K.skip_reason("any", (7, 5), False) is None


def test_check_and_time_loop_with_torch_stand_ins(monkeypatch):
    def attn(sh, inp, ws, *a):
        return (lambda q, kv: K.attention_reference(sh, dict(inp, q=q, kv=kv)).to(q.dtype)), (inp["q"], inp["kv"]), True

    def moe(sh, inp, w):
        from moeserve.ops.moe.torch_ref import torch_moe
        run = lambda x, tw, ids: torch_moe(x, w["w13"], w["w2"], tw, ids)  # noqa: E731
        return run, (inp["x"], inp["weights"], inp["ids"]), False

    def broken(sh, inp, w):
        return (lambda x: x), (inp["x"],), False  # wrong output: must be reported as a mismatch

    for name in ("fi_decode", "fi_prefill", "trtllm_decode"):
        monkeypatch.setattr(K, name, attn)
    monkeypatch.setattr(K, "triton_moe", moe)
    monkeypatch.setattr(K, "cutlass_moe", broken)
    monkeypatch.setattr(C, "time_us", lambda fn, args, graph: (100.0, "stand-in"))
    cfg = make_config(model="tiny", bench={"prompt_len": 16, "output_len": 8, "concurrency": [1, 2]})
    arch = arch_from_hf(resolve_model_source("tiny").config)
    args = types.SimpleNamespace(allow_slow_jit=True, time_budget=None, quick=False, batch_sizes=None)
    saved = []
    rows = K.run_rows(cfg, arch, torch.bfloat16, torch.device("cpu"), (9, 0), [1, 2], [2], args,
                      lambda s: None, saved.append)
    assert saved and saved[-1] is rows
    by = {(r["kernel"], r["batch"], r["tokens"]): r for r in rows}
    assert by[("flashinfer decode (CUDA cores)", 2, 2)]["status"] == "ok"
    assert by[("flashinfer prefill fa3", 2, 32)]["status"] == "ok"  # 2 requests x 16 prompt tokens
    assert by[("trtllm-gen decode", 1, 1)]["status"] == "skipped"
    tri = by[("moeserve triton fused_moe", 2, 32)]
    assert tri["status"] == "ok" and tri["op"] == "moe-prefill" and tri["max_error"] < K.MOE_TOL
    assert tri["time_us"] == 100.0 and tri["gbps"] > 0 and tri["tflops"] > 0
    assert by[("flashinfer cutlass_fused_moe", 1, 1)]["status"] in ("mismatch", "failed")


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [True, False])
def test_kernel_timers_time_a_copy(graph):
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    us, how = C.time_us(lambda a, b: b.copy_(a), (x, y), graph)
    assert us > 0 and ("cold L2" in how or "flush" in how)
    us2, _ = C.own_time_us(lambda a, b: b.copy_(a), (x, y), graph, repeats=5)
    assert us2 > 0


def csr_attention(sh, q, kv, qo_indptr, kv_indptr, indices, last):
    """float32 causal attention straight from FlashInfer-style CSR page tables (what the kernels are given)."""
    outs, group = [], sh.num_heads // sh.num_kv_heads
    for r in range(len(qo_indptr) - 1):
        qs = q[int(qo_indptr[r]):int(qo_indptr[r + 1])].float()
        pages = indices[int(kv_indptr[r]):int(kv_indptr[r + 1])].long()
        n = (len(pages) - 1) * sh.page_size + int(last[r])
        keys = kv[pages, 0].reshape(-1, sh.num_kv_heads, sh.head_dim)[:n].float().repeat_interleave(group, 1)
        vals = kv[pages, 1].reshape(-1, sh.num_kv_heads, sh.head_dim)[:n].float().repeat_interleave(group, 1)
        qn = qs.shape[0]
        mask = torch.arange(n)[None, :] <= torch.arange(n - qn, n)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(qs.transpose(0, 1), keys.transpose(0, 1),
                                                               vals.transpose(0, 1), attn_mask=mask, scale=sh.scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def test_mixed_step_page_tables_describe_the_reference():
    """The one-plan tables (all rows) and the POD tables (chunk, decodes) over the shared cache give the
    reference the mixed kernels are checked against."""
    from moeserve.bench import kernels_mixed as km
    sh = shapes(prompt_len=6, context_len=10)
    inp = km.mixed_inputs(sh, 3, "cpu", torch.Generator().manual_seed(1))
    ref = km.mixed_reference(sh, inp)
    assert ref.shape == (6 + 3, sh.num_heads, sh.head_dim)
    every = csr_attention(sh, inp["q"], inp["kv"], inp["qo_indptr_host"], inp["indptr_host"], inp["indices"],
                          inp["last_host"])
    torch.testing.assert_close(every, ref, atol=1e-5, rtol=1e-5)
    p, d = inp["p"], inp["d"]
    parts = torch.cat([csr_attention(sh, inp["q_p"], inp["kv"], p["qo_indptr_host"], p["indptr_host"], p["indices"],
                                     p["last_host"]),
                       csr_attention(sh, inp["q_d"], inp["kv"], d["qo_indptr_host"], d["indptr_host"],
                                     inp["indices_d"], d["last_host"])])
    torch.testing.assert_close(parts, ref, atol=1e-5, rtol=1e-5)
    assert len(set(inp["indices"].tolist())) == inp["indices"].numel()  # no page shared


def test_mixed_rows_are_checked_and_timed(monkeypatch):
    from moeserve.bench import kernels_mixed as km

    def stand_in(sh, inp, ws, *a):
        tables = (inp["qo_indptr_host"], inp["indptr_host"], inp["indices"], inp["last_host"])
        return (lambda q, kv: csr_attention(sh, q, kv, *tables).to(q.dtype)), (inp["q"], inp["kv"]), False

    monkeypatch.setattr(km, "fi_prefill", stand_in)
    monkeypatch.setattr(km, "batched_pod", lambda sh, inp, ws: ((lambda q: q), (inp["q"],), False))  # wrong
    monkeypatch.setattr(C, "time_us", lambda fn, args, graph: (50.0, "stand-in"))
    cfg = make_config(model="tiny", bench={"prompt_len": 16, "output_len": 8, "concurrency": [1, 2]})
    arch = arch_from_hf(resolve_model_source("tiny").config)
    args = types.SimpleNamespace(allow_slow_jit=False, time_budget=None, quick=False, batch_sizes=None)
    rows = K.run_rows(cfg, arch, torch.bfloat16, torch.device("cpu"), (9, 0), [2], [2], args, lambda s: None,
                      lambda r: None)
    by = {r["kernel"]: r for r in rows if r["op"] == "attention-mixed"}
    assert set(by) == {name for name, _ in km.MIXED_KERNELS}
    one = by["flashinfer mixed: one prefill plan (fa3)"]
    assert one["status"] == "ok" and one["tokens"] == 16 + 2 and one["time_us"] == 50.0 and one["gbps"] > 0
    assert by["flashinfer mixed: batched POD (fa2)"]["status"] in ("mismatch", "failed")
    args.kernels = "POD"
    rows = K.run_rows(cfg, arch, torch.bfloat16, torch.device("cpu"), (9, 0), [2], [2], args, lambda s: None,
                      lambda r: None)
    ran = {r["kernel"] for r in rows if r["status"] != "skipped"}
    assert ran == {"flashinfer mixed: batched POD (fa2)"}
    assert all("--kernels" in r["reason"] for r in rows if r["status"] == "skipped")
