"""The run configuration: YAML + overrides, and errors that name the field."""
import pytest

from moeserve.args import config_from_args
from moeserve.cli import build_parser
from moeserve.config import ConfigError, load_config, make_config, resolve_model_source


def test_defaults_and_yaml_and_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("model: tiny\ndtype: float32\nmax_num_seqs: 8\nbackends:\n  moe: torch\nbench:\n  concurrency: [1, 4]\n")
    cfg = load_config(p, {"max_num_seqs": 4, "bench.runs": 5})
    assert cfg.model == "tiny" and cfg.dtype == "float32"
    assert cfg.max_num_seqs == 4  # the override wins over the file
    assert cfg.backends.moe == "torch" and cfg.backends.attention == "auto"
    assert cfg.bench.concurrency == [1, 4] and cfg.bench.runs == 5


def test_cli_flags_override_yaml(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("model: tiny\npage_size: 8\n")
    args = build_parser().parse_args(["generate", "--config", str(p), "--page-size", "32", "--backend", "moe=torch",
                                      "--set", "bench.prompt_len=64", "--prompt-token-ids", "1,2"])
    cfg = config_from_args(args)
    assert cfg.page_size == 32 and cfg.backends.moe == "torch" and cfg.bench.prompt_len == 64


@pytest.mark.parametrize("fields, needle", [
    ({"model": "no-such-model"}, "model: 'no-such-model' is neither a preset"),
    ({"dtype": "float64"}, "dtype: 'float64' is not allowed"),
    ({"max_num_seqs": 0}, "max_num_seqs: "),
    ({"max_num_seqs": "many"}, "max_num_seqs: "),
    ({"backends": {"moe": "cutlas"}}, "backends.moe: 'cutlas' is not a moe backend; choose one of auto, flashinfer, torch, triton"),
    ({"backends": {"attentoin": "torch"}}, "backends.attentoin: unknown field"),
    ({"device": "tpu"}, "device: 'tpu' is not a device"),
    ({"gpu_arch": "hopper"}, "gpu_arch: 'hopper' is not a GPU architecture"),
    ({"bench": {"concurrency": [1, 0]}}, "bench.concurrency: "),
    ({"page_sise": 16}, "page_sise: unknown field"),
])
def test_bad_fields_are_named(fields, needle):
    with pytest.raises(ConfigError) as e:
        make_config(**fields)
    assert needle in str(e.value)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(p)


def test_model_sources(tmp_path):
    src = resolve_model_source("qwen1.5-moe-a2.7b")
    assert src.config["num_experts"] == 60 and src.weights_dir is None
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert resolve_model_source(str(tmp_path)).config_dir == str(tmp_path)
    assert resolve_model_source(str(tmp_path / "config.json")).weights_dir is None
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_source(str(tmp_path / ".."))
    with pytest.raises(ValueError, match="weights_dir"):
        resolve_model_source("tiny", str(tmp_path))
