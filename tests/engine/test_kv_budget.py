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
