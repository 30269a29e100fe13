"""The benchmark's shared random checkpoint: written under Hugging Face names that transformers loads without
a missing or unexpected tensor, read back by moeserve's loader to the same weights (same greedy tokens and
logits as transformers on it), and reused on a second call."""
import json

import pytest
import torch

from hf_models import hf_greedy, hf_logits, make_checkpoint
from moeserve import LLM, SamplingParams
from moeserve.bench.checkpoint import MARKER, write_random_checkpoint

PROMPT = [3, 17, 42, 7, 99, 5]


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "glm4_moe"])
def test_random_checkpoint_loads_in_transformers_and_moeserve_alike(tmp_path, kind):
    import transformers
    make_checkpoint(kind, tmp_path / "hf")  # only its config.json is used: the shape of the model
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    out = write_random_checkpoint(str(cfg_dir), tmp_path / "ckpt", dtype="float32", seed=3, device="cpu",
                                  log=lambda s: None)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                 torch_dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    llm = LLM(model=str(out), dtype="float32", load_format="safetensors")
    got = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert got[0].outputs[0].token_ids == hf_greedy(hf.eval(), PROMPT, 6)
    # a unit-norm, N(0, initializer_range) draw: the norms are ones, a matrix has the configured spread
    std = json.loads((cfg_dir / "config.json").read_text())["initializer_range"]
    emb = hf.get_input_embeddings().weight
    assert abs(float(emb.std()) - std) < 0.1 * std
    assert torch.equal(hf.model.norm.weight, torch.ones_like(hf.model.norm.weight))
    logits = hf_logits(hf.eval(), PROMPT)
    assert torch.isfinite(logits).all() and float(logits.std()) > 0


def test_the_checkpoint_is_reused_and_rewritten_when_its_seed_differs(tmp_path):
    out = write_random_checkpoint("tiny", tmp_path / "ckpt", dtype="float32", seed=0, device="cpu", log=lambda s: None)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    said = []
    write_random_checkpoint("tiny", out, dtype="float32", seed=0, device="cpu", log=said.append)
    assert "reusing" in said[0] and {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == stamp
    write_random_checkpoint("tiny", out, dtype="float32", seed=1, device="cpu", log=said.append)
    assert "wrote" in said[1] and json.loads((out / MARKER).read_text())["seed"] == 1
    assert sorted(p.name for p in out.glob("*.safetensors")) == files


def test_the_benchmark_points_both_engines_at_the_same_checkpoint(tmp_path):
    import torch as _torch

    from moeserve.bench.cli import shared_weights_note, use_shared_checkpoint
    from moeserve.bench.vllm_baseline import hf_model_dir
    from moeserve.config import make_config, resolve_model_source
    cfg = make_config(model="tiny", bench={"output_dir": str(tmp_path / "out")})
    assert cfg.bench.weights == "shared-checkpoint"
    source = use_shared_checkpoint(cfg, resolve_model_source("tiny"), _torch.float32, log=lambda s: None)
    assert source.weights_dir == cfg.model and cfg.load_format == "safetensors"
    assert shared_weights_note(cfg, source) == "shared-checkpoint"
    assert hf_model_dir(cfg, source, tmp_path) == (source.weights_dir, "auto")  # what vLLM loads
    assert LLM(config=cfg).engine.runner.load_format == "safetensors"
    dummy = make_config(model="tiny", bench={"weights": "dummy"})
    kept = use_shared_checkpoint(dummy, resolve_model_source("tiny"), _torch.float32, log=lambda s: None)
    assert kept.weights_dir is None and shared_weights_note(dummy, kept) == "dummy"
