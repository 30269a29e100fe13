"""``quantization: fp8`` through the whole engine on CPU, the backend registry's answers for the FP8 linear
backend, and FP8 dummy weights.

End-to-end criterion (teacher-forced: both engines see the same schedule and are fed the float32 engine's
greedy tokens, so every sampled row is compared): per-row cosine similarity of the FP8 engine's logits to
the float32 engine's has median >= 0.98 and mean >= 0.93, and the argmax agrees on >= 50% of rows. Measured
on these small random models (seeds 0-3): median 0.985-0.995, mean 0.945-0.995, agreement 0.56-0.83. The
agreement is low because random models' logits are nearly flat, so a W8A8 error of a few percent per
layer flips close calls, and grouped sigmoid routing turns some flips into a different expert; a broken FP8
path (wrong scales, swapped halves) gives cosines near 0.
"""
import pytest
import torch

from hf_models import make_checkpoint
from lockstep import lockstep, random_prompts
from moeserve.config import make_config
from moeserve.engine.engine import LLMEngine
from moeserve.engine.sampling_params import SamplingParams
from moeserve.hardware import probe
from moeserve import backends as registry

ALIGNED = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=32, moe_intermediate_size=128,
               intermediate_size=128, num_hidden_layers=2)
MEDIAN_COS, MEAN_COS, AGREEMENT = 0.98, 0.93, 0.5


def engine(path, **kw):
    cfg = make_config(model=str(path), dtype="float32", device="cpu", max_num_batched_tokens=32, page_size=8,
                      max_num_seqs=4, max_model_len=128, **kw)
    return LLMEngine(cfg)


@pytest.mark.parametrize("kind, shape, seed", [("qwen3_moe", ALIGNED, 0), ("glm4_moe", {}, 2)])
def test_fp8_engine_close_to_float32(tmp_path, kind, shape, seed):
    make_checkpoint(kind, tmp_path, seed=seed, **shape)
    fp8, ref = engine(tmp_path, quantization="fp8"), engine(tmp_path)
    assert fp8.runner.quantization == "fp8" and ref.runner.quantization == "none"
    assert fp8.runner.backend_names["linear"] == "torch" and fp8.runner.backend_names["moe"] == "torch"
    # FP8 weights take about a quarter of the float32 bytes of the layers they replace
    assert fp8.runner.weights_bytes < ref.runner.weights_bytes
    prompts = random_prompts(256, seed, (3, 17, 40, 9))
    r = lockstep(fp8, ref, prompts, max_tokens=12)
    assert r.cos.median() >= MEDIAN_COS and r.cos.mean() >= MEAN_COS, r.cos
    assert r.agreement >= AGREEMENT


def test_fp8_dummy_weights_are_the_quantised_float32_dummy_weights():
    from moeserve.quant.fp8 import block_quant_fp8
    fp8 = engine("tiny", quantization="fp8", load_format="dummy")
    ref = engine("tiny", load_format="dummy")
    a, b = fp8.runner.model.layers[1], ref.runner.model.layers[1]
    q, s = block_quant_fp8(b.mlp.w13.data)
    assert torch.equal(a.mlp.w13.float(), q.float()) and torch.equal(a.mlp.w13_scale_inv, s)
    q, s = block_quant_fp8(b.self_attn.o_proj.weight.data)
    assert torch.equal(a.self_attn.o_proj.weight.float(), q.float())
    assert torch.equal(a.mlp.gate.weight, b.mlp.gate.weight)  # the router stays high precision
    out = fp8.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while fp8.has_unfinished():
        fp8.step()
    assert len(out.output_token_ids) == 3


def test_registry_refuses_flashinfer_linear_with_the_reason():
    hw = probe()
    cpu = torch.device("cpu")
    with pytest.raises(registry.BackendUnavailable,
                       match=r"backends\.linear: 'flashinfer' is not available: serves only fp8 weights "
                             r"\(quantization is none\)"):
        registry.resolve("linear", "flashinfer", hw, cpu, torch.bfloat16, "none")
    with pytest.raises(registry.BackendUnavailable,
                       match=r"backends\.linear: 'flashinfer' is not available: needs a CUDA GPU"):
        registry.resolve("linear", "flashinfer", hw, cpu, torch.bfloat16, "fp8")
    assert registry.resolve("linear", "auto", hw, cpu, torch.float32, "fp8").name == "torch"
    with pytest.raises(registry.BackendUnavailable, match=r"backends\.linear: 'flashinfer' is not available"):
        engine("tiny", quantization="fp8", backends={"linear": "flashinfer"})


def test_fp8_kv_cache_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"kv_cache_dtype: 'fp8' is not supported"):
        engine("tiny", kv_cache_dtype="fp8")
