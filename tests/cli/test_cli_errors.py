"""Every failure a user can cause, through the real command line: a non-zero exit, exactly one line on stderr
that names the problem, and no traceback. Each case fails before a model loads (a load would log a line of
its own), so the table runs in a few seconds per case, several cases at a time."""
import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cli_utils import cli_env, default_sigint, run_cli
from hf_models import make_checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_errors")
    make_checkpoint("qwen2_moe", d / "model")
    truncated = d / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((d / "model" / "config.json").read_text())
    shard = next((d / "model").glob("*.safetensors"))
    (truncated / shard.name).write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    config_only = d / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((d / "model" / "config.json").read_text())
    bad_json = d / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text('{"model_type": "qwen2_moe",')
    (d / "bad.yaml").write_text("model: tiny\nbackends: [moe: torch\n")
    (d / "list.yaml").write_text("- tiny\n")
    (d / "hub").mkdir()
    return d


@pytest.fixture(scope="module")
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def cases(files: Path, busy: int):
    """(name, argv, what the one line must contain)"""
    serve = ["serve"]
    gen = ["generate", "tiny", "--device", "cpu"]
    table = [
        ("no model", serve, "no model given: moeserve serve MODEL"),
        ("two models", serve + ["tiny", "--model", "qwen3-30b-a3b"], "the positional MODEL ('tiny') and --model"),
        ("port in use", serve + ["tiny", "--port", str(busy)], f"cannot listen on 127.0.0.1:{busy}: Address already in use"),
        ("address not here", serve + ["tiny", "--host", "203.0.113.7", "--port", "0"],
         "cannot listen on 203.0.113.7:0: Cannot assign requested address"),
        ("port out of range", serve + ["tiny", "--port", "70000"], "server.port"),
        ("port not a number", serve + ["tiny", "--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
        ("truncated safetensors", serve + [str(files / "truncated")], "is not a readable safetensors file"),
        ("config-only directory", serve + [str(files / "config-only")], "has no weight files (*.safetensors)"),
        ("config.json not JSON", serve + [str(files / "bad-json")], "config.json' is not a readable JSON file"),
        ("unknown model", serve + ["no-such-model"], "'no-such-model' is neither a preset"),
        ("missing directory", serve + ["./no/such/dir"], "'./no/such/dir' is neither a preset"),
        ("hub id not cached offline", serve + ["acme/no-such-moe"],
         "'acme/no-such-moe' is not a local directory, not in the Hugging Face cache"),
        ("token ids not integers", gen + ["--prompt-token-ids", "1,a"],
         "argument --prompt-token-ids: '1,a' is not a list of token ids: 'a'"),
        ("token id beyond the vocabulary", gen + ["--prompt-token-ids", "1,99999"],
         "--prompt-token-ids #1: every token id must be an integer in [0, 1024)"),
        ("text without a tokenizer", gen + ["--prompt", "hello"], "--prompt: this model has no tokenizer"),
        ("no prompt", gen, "give --prompt TEXT or --prompt-token-ids"),
        ("top-p out of range", gen + ["--prompt-token-ids", "1,2", "--top-p", "2"], "--top-p: must be in (0, 1], got 2.0"),
        ("unknown backend", serve + ["tiny", "--backend", "moe=cutlas"], "backends.moe: 'cutlas' is not a moe backend"),
        ("unknown operator", serve + ["tiny", "--backend", "mlp=torch"], "'mlp' is not an operator"),
        ("backend this machine cannot run", serve + ["tiny", "--device", "cpu", "--backend", "moe=flashinfer"],
         "backends.moe: 'flashinfer' is not available: needs a CUDA GPU"),
        ("dtype not a choice", serve + ["tiny", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        ("bad YAML", serve + ["--config", str(files / "bad.yaml")], "is not valid YAML"),
        ("YAML not a mapping", serve + ["--config", str(files / "list.yaml")], "must hold a mapping of fields"),
        ("missing config file", serve + ["--config", str(files / "missing.yaml")], "missing.yaml' does not exist"),
        ("--set unknown field", serve + ["tiny", "--set", "max_num_seqz=4"], "max_num_seqz: unknown field"),
        ("--set without a value", serve + ["tiny", "--set", "max_num_seqs"], "must look like field=value"),
        ("max_model_len beyond the model's", serve + ["tiny", "--max-model-len", "100000"],
         "max_model_len: 100000 exceeds the model's max_position_embeddings"),
        ("unknown command", ["sreve", "tiny"], "argument COMMAND: invalid choice: 'sreve'"),
        ("result file missing", ["compare", str(files / "a.json"), str(files / "b.json")], "a.json' does not exist"),
    ]
    if not torch.cuda.is_available():
        table.append(("cuda without a GPU", serve + ["tiny", "--device", "cuda"],
                      "device: 'cuda' was asked for but this machine has no CUDA GPU"))
    return table


def test_every_user_mistake_is_one_line_without_a_traceback(files, busy_port):
    env = cli_env(HF_HUB_CACHE=str(files / "hub"), HF_HUB_OFFLINE="1")
    table = cases(files, busy_port)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda case: run_cli(case[1], env), table))
    problems = []
    for (name, argv, needle), r in zip(table, results):
        lines = r.stderr.strip().splitlines()
        if r.returncode == 0 or len(lines) != 1 or needle not in lines[0] or "Traceback" in r.stderr:
            problems.append(f"{name}: moeserve {' '.join(argv)} -> exit {r.returncode}, stderr:\n{r.stderr}")
    assert not problems, "\n\n".join(problems)


def test_verbose_adds_the_traceback_to_the_one_line(files):
    r = run_cli(["serve", str(files / "config-only"), "-v"])
    assert r.returncode == 2 and "Traceback" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: model ") and "has no weight files" in r.stderr


def test_ctrl_c_exits_130_quietly():
    """SIGINT while generating: exit status 130, no traceback (the engine is loaded and running)."""
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "generate", "tiny", "--device", "cpu",
                             "--max-model-len", "2048", "--num-kv-pages", "160", "--prompt-token-ids", "1,2,3",
                             "--max-tokens", "2000", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "engine ready" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the command ended before the engine was ready"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
        rest = proc.stderr.read()
        assert rc == 130 and "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_the_cli_runs_a_model_from_the_local_hub_cache(files, tmp_path):
    """A hub id found in the local Hugging Face cache (offline) gives the tokens its directory gives."""
    from hf_cache import add_to_hub_cache
    add_to_hub_cache(tmp_path, "acme/tiny-qwen2-moe", files / "model")
    env = cli_env(HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    r = run_cli(["generate", "acme/tiny-qwen2-moe", "--device", "cpu", "--prompt-token-ids", "3,14,15",
                 "--max-tokens", "4", "--ignore-eos", "--json"], env)
    assert r.returncode == 0, r.stderr
    from moeserve import LLM, SamplingParams
    by_dir = LLM(model=str(files / "model"), device="cpu").generate(
        {"prompt_token_ids": [3, 14, 15]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert json.loads(r.stdout)["outputs"][0]["token_ids"] == by_dir[0].outputs[0].token_ids
