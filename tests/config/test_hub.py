"""Models named by Hugging Face hub id, resolved from a local hub cache made in the test (offline)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from hf_cache import COMMIT, add_to_hub_cache
from moeserve.config import ConfigError, make_config, resolve_model_source
from moeserve.hub import HubError, looks_like_hub_id


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = tmp_path / "files"
    files.mkdir()
    (files / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(files / "model.safetensors"))
    add_to_hub_cache(cache, "acme/tiny-moe", files)
    return cache


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(hub_cache):
    src = resolve_model_source("acme/tiny-moe")
    snapshot = hub_cache / "models--acme--tiny-moe" / "snapshots" / COMMIT
    assert src.name == "acme/tiny-moe" and src.config["num_experts"] == 8
    assert src.config_dir == str(snapshot) and src.weights_dir == str(snapshot)
    assert resolve_model_source("acme/tiny-moe", revision=COMMIT).config_dir == str(snapshot)


def test_a_hub_id_absent_from_the_cache_offline_is_one_line_naming_it(hub_cache):
    with pytest.raises(HubError) as e:
        resolve_model_source("acme/absent")
    msg = str(e.value)
    assert "'acme/absent'" in msg and "HF_HUB_OFFLINE" in msg and str(hub_cache) in msg and "\n" not in msg
    with pytest.raises(HubError, match="not in the Hugging Face cache"):
        resolve_model_source("acme/tiny-moe", revision="v2")


def test_the_config_accepts_a_hub_id_and_looks_it_up_only_when_resolved(hub_cache):
    cfg = make_config(model="acme/absent")  # validation needs no network and no cache
    assert cfg.model == "acme/absent"
    with pytest.raises(ConfigError, match="neither a preset"):
        make_config(model="no-such-model")


@pytest.mark.parametrize("name, expected", [
    ("Qwen/Qwen1.5-MoE-A2.7B", True), ("zai-org/GLM-4.5-Air", True), ("org/name_v1.0", True),
    ("tiny", False), ("./org/name", False), ("/abs/path", False), ("a/b/c", False), ("org/../x", False),
    ("org/config.json", False), ("org name/x", False),
])
def test_what_looks_like_a_hub_id(name, expected):
    assert looks_like_hub_id(name) is expected
