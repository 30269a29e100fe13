"""Custom kernel launches are marked to run eagerly under torch.compile without importing TorchDynamo at start
(``torch.compiler.disable`` imports it, ~2 s of every start); the marks take effect when something compiles."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_starting_an_engine_does_not_import_dynamo_and_compiling_applies_the_marks():
    code = """
import sys
from moeserve.engine.engine import LLMEngine
from moeserve.config import EngineConfig
from moeserve.ops.moe.triton_backend import TritonMoE
from moeserve.ops.linear_triton import TritonLinear
LLMEngine(EngineConfig(model="tiny", max_num_batched_tokens=32))
assert "torch._dynamo" not in sys.modules, "TorchDynamo imported by an engine that compiles nothing"
from moeserve.ops.eager import apply_eager_marks, marked
names = {f.__qualname__ for f in marked()}
assert {"TritonMoE.experts", "TritonLinear._gemv"} <= names, names
plain = TritonMoE.experts
assert apply_eager_marks() == len(marked())
assert TritonMoE.experts is not plain and TritonMoE.experts.__wrapped__ is plain
assert apply_eager_marks() == 0  # idempotent
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
