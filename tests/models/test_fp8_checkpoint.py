"""FP8 checkpoints in the DeepSeek-V3 / Qwen3-FP8 layout (e4m3 weights + ``weight_scale_inv`` + a
``quantization_config``), written by moeserve's own quantiser from transformers checkpoints.

A model loaded from such a checkpoint holds exactly the parameters of the same model quantised at load time
from the high-precision checkpoint, so its logits are identical. Broken checkpoints fail with the tensor named.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import make_checkpoint
from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError
from moeserve.quant.config import QuantizationError
from moeserve.tools.fp8_export import is_quantizable_weight, write_fp8_checkpoint
from moeserve.weights import WeightError

# Every merged weight's parts (q/k/v, gate/up) start and end on 128-row blocks, as in real checkpoints.
ALIGNED = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=32, moe_intermediate_size=128,
               intermediate_size=128, num_hidden_layers=2)
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [7, 1], list(range(40, 70))]
SMALL = dict(dtype="float32", device="cpu", max_num_seqs=4, max_model_len=128)


def logits_of(llm: LLM) -> list[torch.Tensor]:
    """Prefill logits of each prompt's last token and 6 greedy steps, through the engine."""
    from test_hf_equivalence import run_recording_logits
    seqs, rows = run_recording_logits(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return [rows[k] for k in sorted(rows)], [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for kind, shape in (("qwen3_moe", ALIGNED), ("glm4_moe", ALIGNED), ("qwen2_moe", {})):
        d = tmp_path_factory.mktemp(kind)
        overrides = dict(shape)
        if kind == "qwen2_moe":  # shared-expert and dense shapes aligned too, MHA with 128-wide heads
            overrides = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=128,
                             intermediate_size=128, shared_expert_intermediate_size=256, num_hidden_layers=2)
        make_checkpoint(kind, d / "hp", seed=2, **overrides)
        write_fp8_checkpoint(d / "hp", d / "fp8")
        out[kind] = d
    return out


def test_writer_layout(checkpoints):
    d = checkpoints["glm4_moe"] / "fp8"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "weight_block_size": [128, 128],
                                          "activation_scheme": "dynamic", "fmt": "e4m3"}
    sd = load_file(d / "model.safetensors")
    w = sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    s = sd["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1, 1)
    assert sd["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert sd["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 1)
    for kept in ("model.layers.1.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert sd[kept].dtype == torch.float32 and kept + "_scale_inv" not in sd
    assert not is_quantizable_weight("model.layers.1.mlp.shared_expert_gate.weight")
    assert is_quantizable_weight("model.layers.1.mlp.shared_expert.gate_proj.weight")


@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe", "qwen2_moe"])
def test_fp8_checkpoint_matches_load_time_quantisation(checkpoints, kind):
    d = checkpoints[kind]
    stored = LLM(model=str(d / "fp8"), max_num_batched_tokens=16, page_size=8, **SMALL)
    at_load = LLM(model=str(d / "hp"), quantization="fp8", max_num_batched_tokens=16, page_size=8, **SMALL)
    assert stored.engine.runner.quantization == "fp8"  # implied by quantization_config
    pa = dict(stored.engine.runner.model.named_parameters())
    pb = dict(at_load.engine.runner.model.named_parameters())
    assert pa.keys() == pb.keys()
    moe = next(n.removesuffix(".w13") for n in pa if n.endswith(".mlp.w13"))
    assert pa[f"{moe}.w13"].dtype == torch.float8_e4m3fn and pa[f"{moe}.w13_scale_inv"].shape == (8, 2, 1)
    assert pa["layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert pa[f"{moe}.gate.weight"].dtype == torch.float32 and pa["embed_tokens"].dtype == torch.float32
    for name in pa:
        assert torch.equal(pa[name].float(), pb[name].float()), name
    rows_a, toks_a = logits_of(stored)
    rows_b, toks_b = logits_of(at_load)
    assert toks_a == toks_b
    assert all(torch.equal(a, b) for a, b in zip(rows_a, rows_b))


def test_unaligned_shards_quantise_the_merged_weight_at_load(tmp_path):
    """q/k/v of 64/32/32 rows share 128-row blocks: they are staged and the merged qkv is quantised whole."""
    hf = make_checkpoint("qwen3_moe", tmp_path, seed=1)
    llm = LLM(model=str(tmp_path), quantization="fp8", **SMALL)
    attn = llm.engine.runner.model.layers[0].self_attn
    from moeserve.quant.fp8 import block_quant_fp8
    a = hf.model.layers[0].self_attn
    merged = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    q, s = block_quant_fp8(merged)
    assert torch.equal(attn.qkv_proj.weight.float(), q.float()) and torch.equal(attn.qkv_proj.weight_scale_inv, s)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_checkpoint_with_unaligned_shards_is_refused(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path / "hp", seed=1)  # k_proj fills rows [64, 96) of qkv
    write_fp8_checkpoint(tmp_path / "hp", tmp_path / "fp8")
    with pytest.raises(WeightError, match=r"'model\.layers\.\d+\.[\w.]+_proj\.weight' fills rows \[\d+, \d+\) "
                                          r"of a merged FP8 weight; FP8 tensors must start and end on 128-row"):
        LLM(model=str(tmp_path / "fp8"), **SMALL)


def _edit(d, fn):
    path = d / "model.safetensors"
    sd = load_file(path)
    fn(sd)
    save_file(sd, path)


def _edited_copy(src, d, fn):
    """A copy of checkpoint ``src`` at ``d`` whose tensors ``fn`` has edited."""
    import shutil
    shutil.copytree(src, d)
    _edit(d, fn)
    return d


def test_missing_scale_is_named(checkpoints, tmp_path):
    d = _edited_copy(checkpoints["qwen3_moe"] / "fp8", tmp_path / "bad",
                     lambda sd: sd.pop("model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"))
    with pytest.raises(WeightError, match=r"'model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight' is float8_e4m3fn but "
                                          r"its block scales 'model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight_scale_inv' "
                                          r"are not in the checkpoint"):
        LLM(model=str(d), **SMALL)


def test_misshaped_scale_is_named(checkpoints, tmp_path):
    d = _edited_copy(checkpoints["qwen3_moe"] / "fp8", tmp_path / "bad",
                     lambda sd: sd.__setitem__("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(3, 2)))
    with pytest.raises(WeightError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv' has shape \[3, 2\] but "
                                          r"'model\.layers\.0\.self_attn\.o_proj\.weight' of shape \[128, 256\] needs "
                                          r"128x128 block scales of shape \[1, 2\]"):
        LLM(model=str(d), **SMALL)


def test_fp8_tensor_into_a_high_precision_layer_is_dequantised(checkpoints, tmp_path):
    """A router stored as FP8 (some exporters do) is dequantised into moeserve's float32 router."""
    from moeserve.quant.fp8 import block_dequant_fp8, block_quant_fp8
    src = checkpoints["glm4_moe"] / "fp8"
    name = "model.layers.1.mlp.gate.weight"
    q, s = block_quant_fp8(load_file(src / "model.safetensors")[name])
    d = _edited_copy(src, tmp_path / "fp8router", lambda sd: sd.update({name: q, name + "_scale_inv": s}))
    llm = LLM(model=str(d), **SMALL)
    gate = llm.engine.runner.model.layers[1].mlp.gate.weight
    assert gate.dtype == torch.float32 and torch.equal(gate, block_dequant_fp8(q, s))


def test_quantization_mismatch_is_an_error(checkpoints):
    d = checkpoints["qwen3_moe"] / "fp8"
    with pytest.raises(QuantizationError, match=r"quantization: 'none' does not match the checkpoint, whose config\.json "
                                                 r"declares quantization_config\.quant_method 'fp8'"):
        LLM(model=str(d), quantization="none", **SMALL)
    assert issubclass(QuantizationError, ConfigError)


@pytest.mark.parametrize("qc, field", [({"quant_method": "awq"}, "quant_method 'awq'"),
                                       ({"quant_method": "fp8"}, "weight_block_size None"),
                                       ({"quant_method": "fp8", "weight_block_size": [64, 64]},
                                        r"weight_block_size \[64, 64\]"),
                                       ({"quant_method": "fp8", "weight_block_size": [128, 128],
                                         "activation_scheme": "static"}, "activation_scheme 'static'")])
def test_unsupported_quantization_config_is_named(tmp_path, qc, field):
    make_checkpoint("qwen3_moe", tmp_path, seed=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match=rf"config\.json quantization_config\.{field} is not supported"):
        LLM(model=str(tmp_path), **SMALL)


def test_fp8_bench_config_implies_fp8_with_dummy_weights(tmp_path):
    """A config-only FP8 directory (as the FP8 benchmarks use) runs FP8 on random weights when asked for them;
    without ``load_format: dummy`` it is refused (it has no weights)."""
    from moeserve.tools.fp8_export import write_fp8_config
    d = write_fp8_config("tiny", tmp_path / "tiny-fp8", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"has no weight files \(\*\.safetensors\).*--load-format dummy"):
        LLM(model=str(d), **SMALL)
    llm = LLM(model=str(d), load_format="dummy", **SMALL)
    runner = llm.engine.runner
    assert runner.load_format == "dummy" and runner.quantization == "fp8" and runner.arch.num_layers == 2
    assert runner.model.layers[0].mlp.w13.dtype == torch.float8_e4m3fn


def test_unaligned_dense_mlp_stays_in_high_precision(tmp_path):
    """A dense MLP 96 wide (not a multiple of 128, like GLM-4.5-Air's 10944) is written in high precision and
    listed in ignored_layers, as vLLM needs; the engine runs exactly those linears in the model dtype."""
    make_checkpoint("glm4_moe", tmp_path / "hp", seed=3, **dict(ALIGNED, intermediate_size=96))
    write_fp8_checkpoint(tmp_path / "hp", tmp_path / "fp8")
    qc = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    mlp0 = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    assert qc["ignored_layers"] == mlp0
    sd = load_file(tmp_path / "fp8" / "model.safetensors")
    hp = load_file(tmp_path / "hp" / "model.safetensors")
    for name in mlp0:
        assert torch.equal(sd[name + ".weight"], hp[name + ".weight"]) and name + ".weight_scale_inv" not in sd
    assert sd["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    llm = LLM(model=str(tmp_path / "fp8"), max_num_batched_tokens=16, page_size=8, **SMALL)
    runner = llm.engine.runner
    assert runner.quantization == "fp8" and runner.high_precision_modules == mlp0
    mlp = runner.model.layers[0].mlp
    w = torch.cat([hp["model.layers.0.mlp.gate_proj.weight"], hp["model.layers.0.mlp.up_proj.weight"]])
    assert mlp.gate_up_proj.weight_scale_inv is None and torch.equal(mlp.gate_up_proj.weight, w)
    assert mlp.down_proj.weight.dtype == torch.float32
    assert runner.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert runner.model.layers[1].mlp.w13.dtype == torch.float8_e4m3fn
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_modules_to_not_convert_keeps_matching_linears(checkpoints, tmp_path):
    """transformers' modules_to_not_convert (substrings): attention stored in high precision loads as such, with
    the high-precision weights, while the experts stay FP8."""
    src = checkpoints["qwen3_moe"]
    hp = load_file(src / "hp" / "model.safetensors")

    def dequantise_attention(sd):
        for name in [n for n in sd if ".self_attn." in n and n.endswith("_scale_inv")]:
            del sd[name]
            w = name.removesuffix("_scale_inv")
            sd[w] = hp[w]
    d = _edited_copy(src / "fp8", tmp_path / "fp8", dequantise_attention)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["self_attn"]
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(d), max_num_batched_tokens=16, page_size=8, **SMALL)
    kept = llm.engine.runner.high_precision_modules
    assert kept and all(".self_attn." in n for n in kept) and len(kept) == 2 * 4  # q, k, v, o of 2 layers
    attn = llm.engine.runner.model.layers[1].self_attn
    assert attn.qkv_proj.weight.dtype == torch.float32 and attn.o_proj.weight_scale_inv is None
    assert torch.equal(attn.o_proj.weight, hp["model.layers.1.self_attn.o_proj.weight"])
    assert llm.engine.runner.model.layers[1].mlp.w13.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("ignored, match", [
    (["model.layers.0.self_attn.q_proj"], r"keeps model\.layers\.0\.self_attn\.q_proj in high precision but not "
                                          r"model\.layers\.0\.self_attn\.k_proj"),
    (["model.layers.1.mlp.experts.0.up_proj"], r"routed experts in FP8 only"),
    ("self_attn", r"ignored_layers must be a list"),
])
def test_unservable_high_precision_lists_are_refused(checkpoints, tmp_path, ignored, match):
    import shutil
    d = tmp_path / "fp8"
    shutil.copytree(checkpoints["qwen3_moe"] / "fp8", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["ignored_layers"] = ignored
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match=match):
        LLM(model=str(d), **SMALL)
