"""The vLLM baseline's worker plumbing, against a stand-in ``vllm`` package (CPU, no real vLLM):
the worker process, readiness, results, log parsing, and stopping a worker that never gets ready."""
import os
import textwrap
import time

import pytest

from moeserve.bench.vllm_baseline import (VLLM_CONFIGS, hf_model_dir, parse_log, run_vllm_config,
                                          run_vllm_configs_together, shared_engine_args)
from moeserve.bench.workloads import WorkloadCase
from moeserve.config import make_config, resolve_model_source

FAKE_VLLM = '''
import os, sys, time
__version__ = "0.0.fake"

class SamplingParams:
    def __init__(self, temperature=1.0, ignore_eos=False, max_tokens=16, detokenize=True):
        assert temperature == 0.0 and ignore_eos and not detokenize
        self.max_tokens = max_tokens

class EngineArgs:
    def __init__(self, **kw):
        self.kw = kw

class CompletionOutput:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class RequestOutput:
    def __init__(self, request_id, outputs, finished):
        self.request_id, self.outputs, self.finished = request_id, outputs, finished

class LLMEngine:
    @classmethod
    def from_engine_args(cls, args, usage_context=None):
        assert usage_context == "LLM_CLASS" and args.kw["skip_tokenizer_init"]
        if args.kw.get("attention_backend") == "FLASHINFER":
            print("INFO [engine.py] waiting forever", flush=True)
            time.sleep(3600)
        print("INFO [cuda.py:1] Using FLASH_ATTN attention backend out of potential backends: [x]", flush=True)
        print("WARNING [fused_moe.py:2] Using default MoE config. Performance might be sub-optimal!", flush=True)
        print("INFO [gpu_model_runner.py:3] Model loading took 1.50 GiB memory and 2.5 seconds", flush=True)
        print("INFO [gpu_worker.py:4] Available KV cache memory: 12.25 GiB", flush=True)
        return cls()

    def __init__(self):
        self.reqs = {}

    def add_request(self, request_id, prompt, params):
        self.reqs[request_id + "-x"] = [0, params.max_tokens]
        return request_id + "-x"

    def step(self):
        time.sleep(0.001)
        out = []
        for rid, st in list(self.reqs.items()):
            st[0] += 1
            done = st[0] >= st[1]
            out.append(RequestOutput(rid, [CompletionOutput(list(range(st[0])))], done))
            if done:
                del self.reqs[rid]
        return out
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    root = tmp_path / "fake_site"
    (root / "vllm" / "usage").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (root / "vllm" / "usage" / "__init__.py").write_text("")
    (root / "vllm" / "usage" / "usage_lib.py").write_text("class UsageContext:\n    LLM_CLASS = 'LLM_CLASS'\n")
    monkeypatch.setenv("PYTHONPATH", str(root))
    return root


def _args(tmp_path):
    cfg = make_config(model="tiny", max_model_len=256)
    model_dir, fmt = hf_model_dir(cfg, resolve_model_source("tiny"), tmp_path)
    return cfg, shared_engine_args(cfg, model_dir, fmt, "bfloat16", 256, 0.5)


def test_engine_args_match_moeserve(tmp_path):
    cfg, args = _args(tmp_path)
    assert (tmp_path / "hf-config-tiny" / "config.json").is_file()
    assert args["load_format"] == "dummy" and args["dtype"] == "bfloat16" and args["max_model_len"] == 256
    assert args["max_num_seqs"] == cfg.max_num_seqs and args["max_num_batched_tokens"] == cfg.max_num_batched_tokens
    assert VLLM_CONFIGS["flashinfer"] == {"attention_backend": "FLASHINFER", "moe_backend": "flashinfer_cutlass"}


def test_engine_args_carry_the_parallel_layout(tmp_path):
    cfg = make_config(model="tiny", max_model_len=256)
    model_dir, fmt = hf_model_dir(cfg, resolve_model_source("tiny"), tmp_path)
    assert "tensor_parallel_size" not in shared_engine_args(cfg, model_dir, fmt, "bfloat16", 256, 0.5)
    for ep in (False, True):
        cfg = make_config(model="tiny", max_model_len=256, tensor_parallel_size=2, enable_expert_parallel=ep)
        args = shared_engine_args(cfg, model_dir, fmt, "bfloat16", 256, 0.5)
        assert args["tensor_parallel_size"] == 2 and args["enable_expert_parallel"] is ep


def test_worker_runs_the_workloads_and_reports_backends(fake_vllm, tmp_path):
    cfg, args = _args(tmp_path)
    cases = [WorkloadCase("decode", 2, 8, 5), WorkloadCase("mixed", 2, 8, 5)]
    logs = []
    e = run_vllm_config("default", args, cases, 1024, 1, 0, tmp_path, 60, 120, cfg, logs.append)
    assert e["available"], e.get("reason")
    assert e["label"] == "vllm:default" and e["backends"]["attention"] == "FLASH_ATTN"
    assert any("Using default MoE config" in n for n in e["notes"])
    assert e["memory"]["weights_bytes"] == int(1.5 * 2**30) and e["memory"]["kv_cache_bytes"] == int(12.25 * 2**30)
    assert e["start_seconds"] >= 0 and e["versions"]["vllm"] == "0.0.fake"
    rows = {r["workload"]: r for r in e["results"]}
    assert rows["decode"]["decode_tok_s"] > 0 and rows["mixed"]["total_tok_s"] > 0
    assert all(q["num_tokens"] == 5 for q in rows["decode"]["runs"][0]["requests"])
    # the stand-in decodes 0, 1, 2, ... in every request: the batch is never diverse
    assert rows["decode"]["distinct_token_frac"] == pytest.approx(1 / 2)
    assert any("Using FLASH_ATTN" in line for line in logs)


def test_worker_that_never_gets_ready_is_stopped(fake_vllm, tmp_path):
    cfg, args = _args(tmp_path)
    t0 = time.monotonic()
    e = run_vllm_config("flashinfer", args, [WorkloadCase("decode", 1, 8, 4)], 1024, 1, 0, tmp_path, 4, 60,
                        cfg, lambda s: None)
    assert time.monotonic() - t0 < 40
    assert e["available"] is False and "not ready within 4 s" in e["reason"]
    pid = __import__("json").loads((tmp_path / "vllm-flashinfer.json").read_text())["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_configurations_started_together_run_their_workloads_one_at_a_time(fake_vllm, tmp_path):
    """Both workers start at once; the never-ready one is given up at the start timeout and the other then
    runs its cells behind its gate, so its timed runs begin only after every start has settled."""
    cfg, args = _args(tmp_path)
    t0 = time.monotonic()
    entries = run_vllm_configs_together(["default", "flashinfer"], args, [WorkloadCase("decode", 2, 8, 4)], 1024,
                                        1, 0, tmp_path, 6, 90, cfg, lambda s: None)
    by = {e["label"]: e for e in entries}
    assert by["vllm:flashinfer"]["available"] is False and "not ready within 6 s" in by["vllm:flashinfer"]["reason"]
    d = by["vllm:default"]
    assert d["available"] and d["results"][0]["decode_tok_s"] > 0
    assert (tmp_path / "vllm-default.go").exists() and not (tmp_path / "vllm-flashinfer.go").exists()
    # the gate opened only after the other worker's start timeout
    assert (tmp_path / "vllm-default.go").stat().st_mtime >= t0 + 6


def test_unknown_configuration_is_unavailable(tmp_path):
    cfg, args = _args(tmp_path)
    e = run_vllm_config("fastest", args, [], 1024, 1, 0, tmp_path, 1, 1, cfg, lambda s: None)
    assert e["available"] is False and "unknown vLLM configuration 'fastest'" in e["reason"]


def test_missing_vllm_is_reported_by_the_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nothing"))
    cfg, args = _args(tmp_path)
    e = run_vllm_config("default", args, [WorkloadCase("decode", 1, 8, 4)], 1024, 1, 0, tmp_path, 60, 60, cfg,
                        lambda s: None)
    assert e["available"] is False
    assert "vllm is not importable" in e["reason"] or "worker exited" in e["reason"]


def test_log_parsing_reads_vllm_lines():
    text = ("(EngineCore pid=1) INFO [cuda.py:1] Using FLASHINFER attention backend out of potential backends\n"
            "INFO [layer.py:2] Using 'FLASHINFER_CUTLASS' Unquantized MoE backend out of potential backends: [...]\n"
            "INFO GPU KV cache size: 1,234,567 tokens\n"
            "INFO [monitor.py] torch.compile takes 21.5 s in total\n")
    p = parse_log(text)
    assert p["backends"] == {"attention": "FLASHINFER", "moe": "FLASHINFER_CUTLASS"}
    assert p["memory"]["kv_cache_tokens"] == 1234567 and p["startup"]["torch_compile_seconds"] == 21.5
    assert len(p["notes"]) == 2
    fa = parse_log("Using FLASH_ATTN attention backend out of potential backends\nUsing FlashAttention version 3\n")
    assert fa["backends"]["attention"] == "FLASH_ATTN (FA3)"


def test_startup_worker_times_vllm_to_its_first_token(fake_vllm, tmp_path):
    """`moeserve bench startup`'s vLLM rows go through the same LLMEngine path as the offline worker."""
    import json
    import subprocess
    import sys
    cfg, args = _args(tmp_path)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"engine": "vllm", "mode": "vllm-cold", "engine_args": args,
                                "prompt_token_ids": [1, 2, 3, 4]}))
    out = tmp_path / "state.json"
    r = subprocess.run([sys.executable, "-m", "moeserve.bench.startup_worker", "--spec", str(spec), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    state = json.loads(out.read_text())
    assert r.returncode == 0, r.stderr[-2000:]
    assert state["status"] == "done" and state["versions"]["vllm"] == "0.0.fake"
    assert 0 <= state["ready_seconds"] <= state["first_token_seconds"] and state["ttft_seconds"] >= 0


def test_vllm_follows_the_prefix_caching_setting_of_the_run(tmp_path):
    for on in (True, False):
        cfg = make_config(model="tiny", max_model_len=256, enable_prefix_caching=on)
        model_dir, fmt = hf_model_dir(cfg, resolve_model_source("tiny"), tmp_path)
        assert shared_engine_args(cfg, model_dir, fmt, "bfloat16", 256, 0.5)["enable_prefix_caching"] is on
