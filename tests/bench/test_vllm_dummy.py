"""vLLM's dummy weights drawn by moeserve's rule: the initializer on a vLLM-like module tree, the plugin's
entry point, and the worker environment that carries it."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from moeserve.bench.vllm_baseline import worker_env
from moeserve.bench.vllm_dummy import PLUGIN_GROUP, init_like_moeserve, register, write_plugin_dist
from moeserve.config import make_config
from moeserve.quant.fp8 import block_dequant_fp8

REPO = Path(__file__).resolve().parents[2]
STD = 0.05


class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n))


class Fp8Linear(torch.nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.zeros((n + 127) // 128, (k + 127) // 128))


class FusedMoE(torch.nn.Module):
    def __init__(self, e, n, h):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(e, 2 * n, h, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w13_weight_scale_inv = torch.nn.Parameter(torch.zeros(e, 2 * n // 128, h // 128))
        self.e_score_correction_bias = torch.nn.Parameter(torch.ones(e))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(256)
        self.qkv_proj = torch.nn.Linear(256, 384, bias=True, dtype=torch.bfloat16)
        self.o_proj = Fp8Linear(256, 384)
        self.gate = torch.nn.Linear(256, 4, bias=False)
        self.experts = FusedMoE(4, 128, 256)


def model_config():
    return types.SimpleNamespace(hf_config=types.SimpleNamespace(initializer_range=STD))


def vllm_style_load(model):
    """vLLM's DummyModelLoader calls the initializer on every module of the model, root first."""
    for module in model.modules():
        init_like_moeserve(module, model_config())


def test_tensors_get_moeserves_rule_not_vllms():
    torch.manual_seed(0)
    model = torch.nn.ModuleList([Layer(), Layer()])
    vllm_style_load(model)
    a, b = model[0], model[1]
    assert torch.equal(a.input_layernorm.weight, torch.ones(256))
    assert torch.count_nonzero(a.qkv_proj.bias) == 0 and torch.count_nonzero(a.experts.e_score_correction_bias) == 0
    w = a.qkv_proj.weight.float()
    assert w.std().item() == pytest.approx(STD, rel=0.05) and abs(w.mean().item()) < 2e-3
    assert not torch.equal(a.qkv_proj.weight, b.qkv_proj.weight)  # vLLM's seeding would make these equal
    assert a.gate.weight.std().item() == pytest.approx(STD, rel=0.1)
    # FP8: a bf16 draw quantised with 128x128 block scales; dequantised it is N(0, STD) again
    deq = block_dequant_fp8(a.o_proj.weight, a.o_proj.weight_scale_inv)
    assert deq.std().item() == pytest.approx(STD, rel=0.05)
    amax_block = deq[:128, :128].abs().max()
    assert a.o_proj.weight_scale_inv[0, 0].item() == pytest.approx(amax_block.item() / 448, rel=0.07)
    experts = block_dequant_fp8(a.experts.w13_weight, a.experts.w13_weight_scale_inv)
    assert experts.shape == (4, 256, 256) and experts.std().item() == pytest.approx(STD, rel=0.05)
    assert not torch.equal(experts[0], experts[1])


def test_each_parameter_is_drawn_once_although_vllm_calls_the_initializer_per_module(capsys):
    layer = Layer()
    init_like_moeserve(layer, model_config())
    weights = [n for n, p in layer.named_parameters() if not n.endswith(("_scale_inv", "_scale"))]
    assert f"[moeserve dummy init] {len(weights)} tensors drawn" in capsys.readouterr().err  # seen in vLLM's log
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    for module in layer.modules():
        init_like_moeserve(module, model_config())
    assert all(torch.equal(before[k].float(), v.float()) for k, v in layer.state_dict().items())
    assert "[moeserve dummy init] 0 tensors drawn" in capsys.readouterr().err


def test_fp8_tensor_without_block_scale_keeps_its_values(caplog):
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.full((8, 8), 0.5).to(torch.float8_e4m3fn), requires_grad=False)
    init_like_moeserve(m, model_config())
    assert torch.equal(m.weight.float(), torch.full((8, 8), 0.5)) and "keep vLLM's values" in caplog.text


def test_register_replaces_vllms_initializer(monkeypatch):
    pkg = "vllm.model_executor.model_loader"
    mods = {name: types.ModuleType(name) for name in
            ("vllm", "vllm.model_executor", pkg, f"{pkg}.dummy_loader", f"{pkg}.weight_utils")}
    mods[pkg].dummy_loader, mods[pkg].weight_utils = mods[f"{pkg}.dummy_loader"], mods[f"{pkg}.weight_utils"]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    register()
    assert mods[f"{pkg}.dummy_loader"].initialize_dummy_weights is init_like_moeserve
    assert mods[f"{pkg}.weight_utils"].initialize_dummy_weights is init_like_moeserve


def test_the_plugin_entry_point_is_found_on_the_worker_path(tmp_path):
    write_plugin_dist(tmp_path)
    code = ("from importlib.metadata import entry_points\n"
            f"print([(e.name, e.value) for e in entry_points(group={PLUGIN_GROUP!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)), cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "('moeserve_dummy_init', 'moeserve.bench.vllm_dummy:register')" in out.stdout


@pytest.mark.parametrize("dummy_init, dummy, plugged", [("moeserve", True, True), ("vllm", True, False),
                                                        ("moeserve", False, False)])
def test_worker_env_carries_the_plugin_only_for_dummy_weights_by_moeserves_rule(tmp_path, dummy_init, dummy,
                                                                                 plugged):
    cfg = make_config(model="tiny", bench={"vllm": {"dummy_init": dummy_init}})
    env, note = worker_env(cfg, tmp_path, share_kernel_cache=False, dummy_weights=dummy)
    site = tmp_path / "vllm-site"
    assert (str(site) in env["PYTHONPATH"].split(os.pathsep)) is plugged
    assert any(site.glob("*.dist-info/entry_points.txt")) is plugged
    assert (note is not None and "moeserve's rule" in note) is plugged


def test_bench_vllm_plugin_mode_writes_the_entry_point_and_prints_the_path(tmp_path, capsys):
    from moeserve.cli import main
    assert main(["bench", "vllm-plugin", "--out", str(tmp_path / "plug")]) == 0
    out = capsys.readouterr().out
    assert f"export PYTHONPATH={tmp_path / 'plug'}{os.pathsep}{REPO}" in out
    assert (next((tmp_path / "plug").glob("*.dist-info")) / "entry_points.txt").read_text().startswith(
        f"[{PLUGIN_GROUP}]")
