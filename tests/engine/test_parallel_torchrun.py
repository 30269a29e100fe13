"""The launch across hosts, on one CPU host: ``torchrun`` starts 2 processes running the same ``moeserve generate``
command line; rank 0 runs the command, rank 1 joins through torchrun's variables (``env://``) and receives the
steps by a gloo broadcast. The tokens are those of one process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_models import make_checkpoint
from moeserve.ops.parallel import free_port

pytestmark = pytest.mark.slow

PROMPTS = ["1,2,3,4,5", "9,8,7,6,5,4,3,2,1,17,33"]


def generate(cmd: list[str], path, *flags: str) -> list[list[int]]:
    args = ["generate", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--max-tokens", "8", "--json",
            *flags]
    for p in PROMPTS:
        args += ["--prompt-token-ids", p]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    return [r["token_ids"] for r in json.loads(text[text.index("{"):])["outputs"]]


def test_torchrun_ranks_give_the_tokens_of_one_process(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path, num_hidden_layers=2)
    from moeserve import LLM, SamplingParams
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32")
    outs = llm.generate([{"prompt_token_ids": [int(t) for t in p.split(",")]} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8))
    one = [o.outputs[0].token_ids for o in outs]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()), "-m", "moeserve.cli"]
    assert generate(torchrun, tmp_path, "-tp", "2", "--enable-expert-parallel") == one
