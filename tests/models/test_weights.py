"""Checkpoint loading: sharded checkpoints, stacked expert tensors, and errors that name the tensor."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import hf_greedy, make_checkpoint
from moeserve import LLM, SamplingParams
from moeserve.weights import WeightError

PROMPT = [3, 14, 15, 92, 65, 35]


def greedy(path):
    llm = LLM(model=str(path), dtype="float32")
    return llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids


def test_sharded_checkpoint_with_index(tmp_path):
    hf = make_checkpoint("qwen2_moe", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert greedy(tmp_path / "sharded") == hf_greedy(hf, PROMPT, 6)


def test_stacked_expert_tensors(tmp_path):
    hf = make_checkpoint("qwen3_moe", tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    for layer in range(hf.config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        e = hf.config.num_experts
        gate_up = torch.stack([torch.cat([sd.pop(f"{p}.{x}.gate_proj.weight"), sd.pop(f"{p}.{x}.up_proj.weight")])
                               for x in range(e)])
        down = torch.stack([sd.pop(f"{p}.{x}.down_proj.weight") for x in range(e)])
        sd[f"{p}.gate_up_proj"], sd[f"{p}.down_proj"] = gate_up, down
    save_file(sd, path)
    assert greedy(tmp_path) == hf_greedy(hf, PROMPT, 6)


def test_missing_tensor_is_named(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, path)
    with pytest.raises(WeightError, match=r"lacks 1 tensor\(s\) the model needs: model.layers.1.self_attn.k_proj.weight"):
        LLM(model=str(tmp_path))


def test_misshaped_tensor_is_named(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    sd["model.layers.0.mlp.experts.3.up_proj.weight"] = torch.zeros(7, 64)
    save_file(sd, path)
    with pytest.raises(WeightError, match=r"'model.layers.0.mlp.experts.3.up_proj.weight' has shape \[7, 64\] but the "
                                          r"model \(qwen3_moe\) expects \[32, 64\]"):
        LLM(model=str(tmp_path))


def test_index_naming_absent_shard(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(WeightError, match="missing.safetensors"):
        LLM(model=str(tmp_path))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_truncated_or_corrupt_shard_is_named_before_the_model_is_built(tmp_path, damage):
    from moeserve.config import resolve_model_source
    from moeserve.weights import check_weight_source
    make_checkpoint("qwen2_moe", tmp_path)
    shard = next(tmp_path.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if damage == "truncate" else b"not a checkpoint" * 4)
    with pytest.raises(WeightError, match=f"{shard} is not a readable safetensors file"):
        check_weight_source(resolve_model_source(str(tmp_path)), "auto")
    with pytest.raises(WeightError, match=f"{shard} is not a readable safetensors file"):
        LLM(model=str(tmp_path))


def test_a_directory_without_weights_is_refused_unless_dummy_weights_are_asked_for(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path / "c")
    (tmp_path / "config.json").write_text((tmp_path / "c" / "config.json").read_text())
    for fmt in ("safetensors", "auto"):
        with pytest.raises(WeightError, match=f"model '{tmp_path}' has no weight files"):
            LLM(model=str(tmp_path), load_format=fmt)
    assert LLM(model=str(tmp_path), load_format="dummy").engine.runner.load_format == "dummy"
    assert LLM(model="tiny").engine.runner.load_format == "dummy"  # a preset has no weights by design


def test_dummy_weights_have_unit_norms_zero_biases_and_initializer_range_matrices():
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    from moeserve.weights import NORM_NAMES
    model = LLMEngine(make_config(model="tiny", dtype="float32"), capture_graphs=False).runner.model
    params = dict(model.named_parameters())
    norms = [n for n in params if n.rsplit(".", 1)[-1] in NORM_NAMES]
    assert len(norms) >= 3 and all(torch.equal(params[n], torch.ones_like(params[n])) for n in norms)
    biases = [n for n in params if n.endswith("bias")]
    assert all(torch.count_nonzero(params[n]) == 0 for n in biases)
    experts = [p for n, p in params.items() if p.dim() == 3]
    assert experts and all(abs(p.std().item() - model.arch.initializer_range) < 0.1 * model.arch.initializer_range
                           for p in experts)


def test_loading_counts_the_shards_on_a_progress_bar(tmp_path, capsys):
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    from moeserve.weights import load_checkpoint
    make_checkpoint("qwen2_moe", tmp_path / "one").save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = len(list((tmp_path / "sharded").glob("*.safetensors")))
    model = LLMEngine(make_config(model=str(tmp_path / "sharded"), dtype="float32"), capture_graphs=False).runner.model
    assert "Loading safetensors shards" not in capsys.readouterr().err  # stderr is no terminal here: no bar
    load_checkpoint(model, tmp_path / "sharded", progress=True)
    err = capsys.readouterr().err
    assert "Loading safetensors shards" in err and f"{shards}/{shards}" in err
