"""The Triton residual add + RMSNorm (``norm_triton.add_rmsnorm``, the successor of a one-token step's norm
launched early under PDL) and the embedding with the first norm (``norm_triton.embed_rmsnorm``).

CPU: under Triton's interpreter (one subprocess) against ``TorchNorm.add_rmsnorm`` in float64: the new residual
bit for bit (one rounding of an exact sum) and the normalised rows within a rounding, on odd hidden sizes; the
embedding's rows bit for bit and their norm within a rounding. GPU (``-m gpu``): against FlashInfer's
``fused_add_rmsnorm`` (and ``F.embedding`` with FlashInfer's ``rmsnorm``) on Qwen1.5-MoE's hidden size, eagerly and
with PDL in a CUDA graph replayed on new inputs. Inputs are fresh random each run; the seed is in failure messages.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from graph_capture import capture_with_pdl  # noqa: E402
from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
# name: (T, H, dtype)
# (no bfloat16: the interpreter rounds casts to it toward zero; the GPU test takes Qwen1.5-MoE's bfloat16)
CASES = {"T1-H2048-fp16": (1, 2048, torch.float16), "T3-H100-fp32": (3, 100, torch.float32),
         "T2-H72-fp16": (2, 72, torch.float16)}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative, one rounding of the output


def _worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.norm_triton import add_rmsnorm
    inputs = torch.load(in_path)
    from moeserve.ops.norm_triton import embed_rmsnorm
    out = {}
    for name, case in inputs.items():
        if name.startswith("embed-"):
            out[name] = embed_rmsnorm(*case, 1e-6)
            continue
        x, res, w = case
        x, res = x.clone(), res.clone()
        add_rmsnorm(x, res, w, 1e-6)
        out[name] = (x, res)
    torch.save(out, out_path)


def _embed_case(t, v, h, dtype, gen):
    """ids (int32, repeats and the last row among them), a [V, H] table, a norm weight."""
    ids = torch.randint(0, v, (t,), generator=gen, dtype=torch.int32)
    ids[0] = v - 1
    return ids, (torch.randn(v, h, generator=gen) * 2).to(dtype), (1 + 0.5 * torch.randn(h, generator=gen)).to(dtype)


def _reference(x, res, w, eps=1e-6):
    s = x.double() + res.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.double(), (x.float() + res.float()).to(x.dtype)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {}
    for name, (t, h, dtype) in CASES.items():
        inputs[name] = (torch.randn(t, h, generator=gen).to(dtype), (torch.randn(t, h, generator=gen) * 3).to(dtype),
                        (1 + 0.5 * torch.randn(h, generator=gen)).to(dtype))
        inputs[f"embed-{name}"] = _embed_case(t + 2, 37, h, dtype, gen)
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("norm"), SEED)


@pytest.mark.parametrize("name", list(CASES))
def test_add_rmsnorm_interpreter(interpreted, name):
    inputs, outputs = interpreted
    x, res, w = inputs[name]
    y, new_res = outputs[name]
    ref_y, ref_res = _reference(x, res, w)
    assert torch.equal(new_res, ref_res), f"seed {SEED}: the new residual differs"
    err = float((y.double() - ref_y).abs().max() / ref_y.abs().max())
    assert y.dtype == x.dtype and err < TOL[x.dtype], f"seed {SEED}: max relative error {err:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_embed_rmsnorm_interpreter(interpreted, name):
    inputs, outputs = interpreted
    ids, table, w = inputs[f"embed-{name}"]
    y, res = outputs[f"embed-{name}"]
    rows = table[ids.long()]
    assert torch.equal(res, rows), f"seed {SEED}: the residual is not the embedding's rows"
    ref = rows.double() * torch.rsqrt(rows.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    assert y.dtype == table.dtype and y.shape == rows.shape and err < TOL[table.dtype], \
        f"seed {SEED}: max relative error {err:.3g}"


def test_embed_rmsnorm_refuses_what_it_cannot_take():
    from moeserve.ops.norm_triton import embed_rmsnorm
    with pytest.raises(ValueError, match="at most 16384"):
        embed_rmsnorm(torch.zeros(1, dtype=torch.int32), torch.zeros(2, 16385), torch.zeros(16385), 1e-6)
    with pytest.raises(ValueError, match=r"\[T\] ids"):
        embed_rmsnorm(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(2, 8), torch.zeros(8), 1e-6)


def test_add_rmsnorm_refuses_rows_it_cannot_hold():
    from moeserve.ops.norm_triton import add_rmsnorm
    with pytest.raises(ValueError, match="at most 16384"):
        add_rmsnorm(torch.zeros(1, 16385), torch.zeros(1, 16385), torch.zeros(16385), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_add_rmsnorm_against_flashinfer_in_a_cuda_graph():
    import flashinfer.norm as fn

    from moeserve.ops.norm_triton import add_rmsnorm
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    h = 2048
    w = (1 + 0.5 * torch.randn(h, generator=gen, device="cuda")).bfloat16()
    x = torch.randn(1, h, generator=gen, device="cuda").bfloat16()
    res = (torch.randn(1, h, generator=gen, device="cuda") * 3).bfloat16()
    fx, fres = x.clone(), res.clone()
    fn.fused_add_rmsnorm(fx, fres, w, 1e-6)
    tx, tres = x.clone(), res.clone()
    add_rmsnorm(tx, tres, w, 1e-6)
    assert torch.equal(tres, fres), f"seed {SEED}: residual differs from FlashInfer's"
    assert float((tx.float() - fx.float()).abs().max() / fx.float().abs().max()) < TOL[torch.bfloat16]
    gx, gres = torch.empty_like(x), torch.empty_like(res)
    graph, _ = capture_with_pdl(lambda: add_rmsnorm(gx, gres, w, 1e-6))
    for _ in range(3):
        nx = torch.randn(1, h, generator=gen, device="cuda").bfloat16()
        nres = torch.randn(1, h, generator=gen, device="cuda").bfloat16()
        gx.copy_(nx)
        gres.copy_(nres)
        graph.replay()
        ex, eres = nx.clone(), nres.clone()
        add_rmsnorm(ex, eres, w, 1e-6)
        assert torch.equal(gx, ex) and torch.equal(gres, eres), f"seed {SEED}: graph replay differs from eager"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_embed_rmsnorm_against_flashinfer_in_a_cuda_graph():
    """The embedding's rows bit for bit and their norm within a bf16 rounding of ``F.embedding`` + FlashInfer's
    ``rmsnorm``, eagerly and replayed in a CUDA graph with PDL on new ids."""
    import flashinfer.norm as fn
    import torch.nn.functional as F

    from moeserve.ops.norm_triton import embed_rmsnorm
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    v, h = 1000, 2048
    table = (torch.randn(v, h, generator=gen, device="cuda") * 0.02).bfloat16()
    w = (1 + 0.5 * torch.randn(h, generator=gen, device="cuda")).bfloat16()

    def check(ids, y, res):
        rows = F.embedding(ids, table)
        ref = fn.rmsnorm(rows, w, 1e-6)
        assert torch.equal(res, rows), f"seed {SEED}: rows differ from F.embedding's"
        err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
        assert err < TOL[torch.bfloat16], f"seed {SEED}: max relative error {err:.3g} against FlashInfer's"
    ids = torch.randint(0, v, (3,), generator=gen, device="cuda", dtype=torch.int32)
    check(ids, *embed_rmsnorm(ids, table, w, 1e-6))
    gids = torch.zeros(1, dtype=torch.int32, device="cuda")
    graph, (gy, gres) = capture_with_pdl(lambda: embed_rmsnorm(gids, table, w, 1e-6))
    for _ in range(3):
        gids.copy_(torch.randint(0, v, (1,), generator=gen, device="cuda", dtype=torch.int32))
        graph.replay()
        check(gids, gy, gres)


if __name__ == "__main__" and is_worker(sys.argv):
    _worker(sys.argv[2], sys.argv[3])
