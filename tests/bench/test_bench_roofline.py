"""The decode roofline: bytes per step on a hand-computed tiny model, and the fractions it yields."""
import pytest
import torch

from moeserve.bench.roofline import (attach_roofline_fractions, decode_step_bytes, expected_active_experts,
                                     measure_copy_bandwidth, roofline_table)
from moeserve.models.arch import ArchConfig
from moeserve.ops.moe.routing import RoutingConfig


def tiny_arch():
    """2 layers (dense, then MoE), H=8, 2 query heads and 1 KV head of 4, E=4 top-2, I=3, shared expert 6."""
    return ArchConfig(
        model_type="qwen2_moe", vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
        max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4, rotary_dim=4, rope_scaling=None,
        qkv_bias=True, o_bias=False, qk_norm=False, dense_intermediate_size=5, moe_intermediate_size=3,
        num_experts=4, routing=RoutingConfig("softmax", 2), moe_layers=(False, True),
        shared_expert_intermediate_size=6, shared_expert_gate=True)


def test_expected_active_experts():
    assert expected_active_experts(4, 2, 1) == pytest.approx(2)
    assert expected_active_experts(4, 2, 2) == pytest.approx(3)  # 4 * (1 - 0.5^2)
    assert expected_active_experts(60, 4, 1000) == pytest.approx(60)
    assert expected_active_experts(60, 4, 8) < 60


def test_decode_step_bytes_by_hand():
    b = decode_step_bytes(tiny_arch(), batch=2, context_len=10, weight_bytes=2, kv_bytes=2)
    # attention per layer: qkv 8*(8+4+4) + o 8*8 + qkv bias 16 = 208, two layers
    assert b["attention"] == 2 * 208 * 2
    assert b["norms"] == (2 * 2 * 8 + 8) * 2
    assert b["dense_mlp"] == 3 * 8 * 5 * 2
    assert b["router"] == 8 * 4 * 2
    assert b["experts"] == pytest.approx(3 * 3 * 8 * 3 * 2)  # 3 distinct experts expected for 2 tokens
    assert b["shared_expert"] == (3 * 8 * 6 + 8) * 2
    assert b["lm_head"] == 10 * 8 * 2 and b["embedding_rows"] == 2 * 8 * 2
    assert b["kv_cache"] == 2 * 10 * 2 * 2 * 1 * 4 * 2
    assert b["total"] == pytest.approx(2144 + 640)


def test_table_and_fractions():
    bw = {"bytes_per_s": 2784.0 * 100, "method": "given"}
    roof = roofline_table(tiny_arch(), [2], prompt_len=6, output_len=8, bandwidth=bw, weight_bytes=2, kv_bytes=2)
    row = roof["per_concurrency"][0]
    assert row["context_len"] == 10
    assert row["floor_step_s"] == pytest.approx(0.01)
    assert row["ceiling_decode_tok_s"] == pytest.approx(200.0)
    engines = [{"results": [{"workload": "decode", "concurrency": 2, "decode_tok_s": 50.0},
                            {"workload": "mixed", "concurrency": 2, "total_tok_s": 50.0}]}]
    attach_roofline_fractions(engines, roof)
    assert engines[0]["results"][0]["roofline_fraction"] == pytest.approx(0.25)
    assert "roofline_fraction" not in engines[0]["results"][1]


def test_copy_bandwidth_is_positive_on_cpu():
    bw = measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, repeats=3)
    assert bw["bytes_per_s"] > 0 and len(bw["seconds"]) == 3 and "copy" in bw["method"]


def test_fp8_weights_count_one_byte_where_quantised():
    b16 = decode_step_bytes(tiny_arch(), 2, 10, 2, 2)
    b8 = decode_step_bytes(tiny_arch(), 2, 10, 2, 2, quantized_bytes=1)
    for k in ("attention", "experts", "shared_expert", "dense_mlp"):
        assert b8[k] == pytest.approx(b16[k] / 2)
    for k in ("router", "norms", "lm_head", "embedding_rows", "kv_cache"):
        assert b8[k] == b16[k]


@pytest.mark.gpu
def test_copy_bandwidth_on_the_gpu():
    bw = measure_copy_bandwidth(torch.device("cuda"), nbytes=64 << 20, repeats=3)
    assert bw["bytes_per_s"] > 0 and "CUDA events" in bw["method"]
