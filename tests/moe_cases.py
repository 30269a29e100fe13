"""Random MoE problems and a float64 per-expert reference, shared by the MoE kernel tests."""
import torch
import torch.nn.functional as F


def reference_moe(x, w13, w2, topk_weights, topk_ids, dtype=torch.float64):
    """Per-expert loop: ``sum_j w[t,j] * w2[e] @ (silu(gate_e x_t) * up_e x_t)`` computed in ``dtype``."""
    inter = w2.shape[2]
    x, w13, w2, topk_weights = x.to(dtype), w13.to(dtype), w2.to(dtype), topk_weights.to(dtype)
    ids = topk_ids.long()
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].T
        h = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (h @ w2[e].T) * topk_weights[tok, slot, None])
    return out


def random_routing(T, E, k, gen, device="cpu", ids_dtype=torch.int32):
    """``k`` distinct uniformly random experts per token and softmax weights (float32)."""
    ids = torch.rand(T, E, generator=gen, device=device).argsort(dim=1)[:, :k].to(ids_dtype)
    weights = torch.softmax(torch.randn(T, k, generator=gen, device=device), dim=1)
    return weights, ids


def random_moe_inputs(T, E, k, H, I, dtype, gen, device="cpu", ids_dtype=torch.int32):
    """Activations, weights scaled so outputs are O(1), and random routing."""
    x = torch.randn(T, H, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device=device) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen, device=device) / I ** 0.5).to(dtype)
    tw, ti = random_routing(T, E, k, gen, device, ids_dtype)
    return x, w13, w2, tw, ti
