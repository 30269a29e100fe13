"""How much memory the KV cache gets on a GPU (the arithmetic; the GPU path is in the gpu-marked tests)."""
from moeserve.engine.runner import kv_budget_bytes

GIB = 1 << 30


def test_another_process_on_the_gpu_does_not_shrink_the_budget():
    # 140 GiB card, another server already holds 56 GiB; this engine loaded 27 GiB of weights since it started
    alone = kv_budget_bytes(0.40, 140 * GIB, 140 * GIB, 113 * GIB, 2 * GIB)
    shared = kv_budget_bytes(0.40, 140 * GIB, 84 * GIB, 57 * GIB, 2 * GIB)
    assert alone == shared == int(0.40 * 140 * GIB - 27 * GIB - 2 * GIB)


def test_the_budget_never_exceeds_what_is_free():
    # 0.9 of the card asked for while another process holds half of it: only the free part can be had
    got = kv_budget_bytes(0.90, 100 * GIB, 50 * GIB, 40 * GIB, 1 * GIB)
    assert got == 39 * GIB


def test_weights_larger_than_the_share_leave_nothing():
    assert kv_budget_bytes(0.10, 100 * GIB, 100 * GIB, 80 * GIB, 0) < 0


def test_the_warm_up_sizes_start_each_tuned_tile_config_once():
    """Without a kernel cache listing them, the engine warms the first step size of every distinct MoE tile
    config: each size's config differs from the previous size's, and every size up to the limit shares a
    config with a listed one."""
    import torch

    from moeserve.config import resolve_model_source
    from moeserve.engine.runner import tuned_config_sizes
    from moeserve.models import arch_from_hf
    from moeserve.ops.moe.triton_configs import get_config
    arch = arch_from_hf(resolve_model_source("qwen1.5-moe-a2.7b").config)
    sizes = tuned_config_sizes(arch, torch.bfloat16, 8192)

    def cfg(t):
        return get_config(t, arch.num_experts, arch.moe_intermediate_size, arch.hidden_size, arch.top_k,
                          torch.bfloat16)[0]
    assert sizes[0] == 1 and sizes == sorted(sizes) and len(sizes) >= 3
    assert all(cfg(t) != cfg(t - 1) for t in sizes[1:])
    listed = [cfg(t) for t in sizes]
    assert all(cfg(t) in listed for t in range(1, 8193, 97))
