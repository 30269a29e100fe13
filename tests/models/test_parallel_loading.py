"""How a model splits over ranks: each rank reads only its part of every checkpoint tensor (slices, never the
whole tensor; nothing of the experts other ranks hold), the parts are the right rows and columns, FP8 block
scales split on block boundaries only, and a model that cannot be split is refused in one line."""
import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

import moeserve.weights as weights_mod
from hf_models import make_checkpoint, plan_model
from moeserve.config import ConfigError, make_config
from moeserve.models.layers import MoECausalLM
from moeserve.models.parallel import Shard, check_parallel, padded_vocab
from moeserve.plan import resolve_plan
from moeserve.weights import WeightError, load_checkpoint, read_part


class SpyFile:
    """A safetensors file handle that records how many elements of each tensor were read, and how."""

    def __init__(self, f, log):
        self.f, self.log = f, log

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.log.append((name, "whole", t.numel()))
        return t

    def get_slice(self, name):
        sl, log = self.f.get_slice(name), self.log

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, idx):
                t = sl[idx]
                log.append((name, "slice", t.numel()))
                return t
        return Slice()


def rank_model(path, rank: int, expert_parallel: bool) -> MoECausalLM:
    """Rank ``rank`` of 2's model (torch backends), built without a process group: loading needs none."""
    cfg = make_config(model=str(path), device="cpu", dtype="float32", tensor_parallel_size=2,
                      enable_expert_parallel=expert_parallel)
    return plan_model(resolve_plan(cfg, rank=rank))


def spied_load(monkeypatch, model, path) -> list:
    """Load, logging each tensor read: through safetensors (a whole tensor or slices) or as a byte copy."""
    log = []
    real = weights_mod.safe_open
    monkeypatch.setattr(weights_mod, "safe_open", lambda *a, **k: SpyFile(real(*a, **k), log))

    class SpyReader(weights_mod.ByteReader):
        def add(self, name, begin, end, dest):
            log.append((name, "whole", (end - begin) // dest.element_size()))
            super().add(name, begin, end, dest)
    monkeypatch.setattr(weights_mod, "ByteReader", SpyReader)
    load_checkpoint(model, path)
    return log


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_reads_only_its_part(tmp_path, monkeypatch, expert_parallel):
    make_checkpoint("glm4_moe", tmp_path, num_hidden_layers=2, vocab_size=250)
    sd = load_file(tmp_path / "model.safetensors")
    replicated = {"norm", "layernorm", "q_norm", "k_norm", "mlp.gate.", "o_proj.bias"}
    for rank in (0, 1):
        model = rank_model(tmp_path, rank, expert_parallel)
        log = spied_load(monkeypatch, model, tmp_path)
        read = {}
        local = range(4 * rank, 4 * rank + 4)
        expert_of = lambda name: int(name.split(".experts.")[1].split(".")[0])  # noqa: E731
        for name, how, n in log:
            if how == "whole":  # replicated tensors, and the whole experts this rank holds
                assert any(k in name for k in replicated) or (expert_parallel and ".experts." in name
                                                              and expert_of(name) in local), (name, rank)
            read[name] = read.get(name, 0) + n
        for name, t in sd.items():
            if ".experts." in name and expert_parallel:
                assert read.get(name, 0) == (t.numel() if expert_of(name) in local else 0), name
            elif name.startswith(("model.embed_tokens", "lm_head")):
                assert read[name] == (128 if rank == 0 else 122) * t.shape[1], name  # 250 rows padded to 256
            elif not any(k in name for k in replicated):
                assert read[name] == t.numel() // 2, name

        # the parts are the right rows and columns
        half = lambda t, dim: t.chunk(2, dim)[rank]  # noqa: E731
        layer = model.layers[1]
        attn, moe = layer.self_attn, layer.mlp
        p = "model.layers.1"
        qs, ks = attn.q_size, attn.kv_size
        w = attn.qkv_proj.weight
        assert torch.equal(w[:qs], half(sd[f"{p}.self_attn.q_proj.weight"], 0))
        assert torch.equal(w[qs + ks:], half(sd[f"{p}.self_attn.v_proj.weight"], 0))
        assert torch.equal(attn.qkv_proj.bias[qs:qs + ks], half(sd[f"{p}.self_attn.k_proj.bias"], 0))
        assert torch.equal(attn.o_proj.weight, half(sd[f"{p}.self_attn.o_proj.weight"], 1))
        se = moe.shared_expert
        assert torch.equal(se.gate_up_proj.weight[se.intermediate:], half(sd[f"{p}.mlp.shared_experts.up_proj.weight"], 0))
        assert torch.equal(se.down_proj.weight, half(sd[f"{p}.mlp.shared_experts.down_proj.weight"], 1))
        x = 5
        lx, xs = (x - 4 * rank, slice(None)) if expert_parallel else (x, None)
        if not expert_parallel or x in local:
            up = sd[f"{p}.mlp.experts.{x}.up_proj.weight"]
            down = sd[f"{p}.mlp.experts.{x}.down_proj.weight"]
            i = moe.intermediate
            assert torch.equal(moe.w13[lx, i:], up if xs is not None else half(up, 0))
            assert torch.equal(moe.w2[lx], down if xs is not None else half(down, 1))
        emb = sd["model.embed_tokens.weight"]
        assert torch.equal(model.embed_tokens[:122 if rank else 128], emb[128 * rank:128 * rank + (122 if rank else 128)])
        if rank == 1:
            assert not model.embed_tokens[122:].any()  # padding rows are zero


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_stacked_expert_tensors_split(tmp_path, monkeypatch, expert_parallel):
    make_checkpoint("qwen3_moe", tmp_path, num_hidden_layers=1)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    p = "model.layers.0.mlp.experts"
    gate_up = torch.stack([torch.cat([sd.pop(f"{p}.{x}.gate_proj.weight"), sd.pop(f"{p}.{x}.up_proj.weight")])
                           for x in range(8)])
    down = torch.stack([sd.pop(f"{p}.{x}.down_proj.weight") for x in range(8)])
    sd[f"{p}.gate_up_proj"], sd[f"{p}.down_proj"] = gate_up, down
    save_file(sd, path)
    model = rank_model(tmp_path, 1, expert_parallel)
    log = spied_load(monkeypatch, model, tmp_path)
    assert not [n for n, how, _ in log if how == "whole" and "experts" in n]
    moe = model.layers[0].mlp
    if expert_parallel:
        assert torch.equal(moe.w13, gate_up[4:]) and torch.equal(moe.w2, down[4:])
    else:  # each expert's gate rows [16, 32) and up rows [48, 64) of the stacked [gate | up]
        assert torch.equal(moe.w13, torch.cat([gate_up[:, 16:32], gate_up[:, 48:64]], dim=1))
        assert torch.equal(moe.w2, down[:, :, 16:])


def test_shard_ranges():
    assert Shard(0, 1, 2).ranges(8) == [(4, 8)]
    assert Shard(1, 1, 2, parts=2).ranges(8) == [(2, 4), (6, 8)]
    assert Shard(0, 1, 2, size=128).ranges(250) == [(128, 250)]
    assert Shard(0, 1, 2).shape((8, 3)) == (4, 3)
    with pytest.raises(ValueError, match="does not split into 1 x 2"):
        Shard(0, 0, 2).ranges(7)
    assert padded_vocab(250, 2) == 256 and padded_vocab(151936, 2) == 151936 and padded_vocab(250, 1) == 250


def test_fp8_block_scales_split_on_block_boundaries_only(tmp_path):
    from safetensors import safe_open
    w = torch.randn(512, 256).to(torch.float8_e4m3fn)
    s = torch.arange(8.0).view(4, 2)
    save_file({"w": w, "w_scale_inv": s}, tmp_path / "t.safetensors")
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        rows = Shard(0, 1, 2)
        assert torch.equal(read_part(f, "w", rows).view(torch.uint8), w[256:].view(torch.uint8))
        assert torch.equal(read_part(f, "w_scale_inv", rows, rows.scale_ranges((512, 256), "w")), s[2:])
        cols = Shard(1, 1, 2)
        assert torch.equal(read_part(f, "w_scale_inv", cols, cols.scale_ranges((512, 256), "w")), s[:, 1:])
        with pytest.raises(ValueError, match=r"w: this rank's part \[64, 128\) of dimension 1 does not start"):
            Shard(1, 1, 4).scale_ranges((512, 256), "w")


def test_fp8_model_with_unaligned_parts_is_refused(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path, num_hidden_layers=1)
    cfg = make_config(model=str(tmp_path), device="cpu", quantization="fp8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"FP8 with tensor_parallel_size 2: each rank's query heads x head_dim \(32\) "
                                         r"is not a multiple of 128"):
        resolve_plan(cfg)


def test_models_that_cannot_be_split_are_refused(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path, num_hidden_layers=2)
    cfg = make_config(model=str(tmp_path))
    arch = resolve_plan(cfg).arch
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide num_attention_heads \(4\)"):
        check_parallel(arch, 3, False, "none")
    with pytest.raises(ValueError, match=r"must divide num_key_value_heads \(3\) or be a multiple"):
        check_parallel(dataclasses.replace(arch, num_kv_heads=3, num_heads=12), 2, False, "none")
    with pytest.raises(ValueError, match=r"does not divide moe_intermediate_size \(30\)"):
        check_parallel(dataclasses.replace(arch, moe_intermediate_size=30), 4, False, "none")
    check_parallel(dataclasses.replace(arch, moe_intermediate_size=30), 4, True, "none")  # whole experts: fine
    with pytest.raises(ValueError, match=r"8 routed experts do not split evenly over 3 ranks"):
        check_parallel(dataclasses.replace(arch, num_heads=6, num_kv_heads=3, shared_expert_intermediate_size=6,
                                           dense_intermediate_size=6), 3, True, "none")
    # more ranks than kv heads: kv heads are replicated (each rank holds the one its query heads use)
    check_parallel(dataclasses.replace(arch, num_kv_heads=1), 2, False, "none")


def test_config_errors():
    with pytest.raises(ConfigError, match="enable_expert_parallel: needs tensor_parallel_size > 1"):
        make_config(enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="device: 'cuda:1' names one GPU but tensor_parallel_size is 2"):
        make_config(device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        make_config(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="torch_compile: not supported with tensor_parallel_size > 1"):
        make_config(tensor_parallel_size=2, torch_compile=True)


def test_misshaped_part_is_named(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path, num_hidden_layers=1)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 66)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"'model.layers.0.self_attn.o_proj.weight' has shape \[64, 33\] \(this "
                                          r"rank's part\) but the model \(qwen3_moe\) expects \[64, 32\]"):
        load_checkpoint(rank_model(tmp_path, 0, False), tmp_path)
