"""Where the fused combine + norm's residual and FlashInfer's fused_add_rmsnorm's differ: many seeds, T = 1, 7,
64, PDL on and off; for each mismatch, the inputs of that element and the torch arithmetic of both roundings."""
import os
import sys

import flashinfer.norm
import torch

from moeserve.ops import pdl
from moeserve.ops.moe.combine import AddNorm
from moeserve.ops.moe.combine_triton import moe_combine_triton

H, k, EPS = 2048, 4, 1e-6
rows, bad_cases, total = [], 0, 0
for pdl_max in (64, 0):
    for seed in range(int(sys.argv[1])):
        for T in (1, 7, 64):
            gen = torch.Generator(device="cuda").manual_seed(seed + 3000 + T)
            down = torch.randn(T * k, H, generator=gen, device="cuda").bfloat16()
            shared = torch.randn(T, H, generator=gen, device="cuda").bfloat16()
            gate = torch.randn(T, 1, generator=gen, device="cuda").bfloat16() * 3
            residual = (torch.randn(T, H, generator=gen, device="cuda") * 4).bfloat16()
            weight = (1 + 0.5 * torch.randn(H, generator=gen, device="cuda")).bfloat16()
            with pdl.enabled_as(pdl_max):
                res = residual.clone()
                moe_combine_triton(down, k, shared, gate, add_norm=AddNorm(res, weight, EPS))
                plain = moe_combine_triton(down, k, shared, gate)
            plain0 = plain.clone()
            ref_res = residual.clone()
            flashinfer.norm.fused_add_rmsnorm(plain, ref_res, weight, EPS)
            torch.cuda.synchronize()
            total += 1
            torch_res = (plain0.float() + residual.float()).bfloat16()
            idx = (res != ref_res).nonzero()
            if len(idx):
                bad_cases += 1
                for t, c in idx[:4].tolist():
                    rows.append(dict(pdl=pdl_max, seed=seed, T=T, t=t, c=c, n=len(idx),
                                     fused=res[t, c].item(), flashinfer=ref_res[t, c].item(),
                                     torch=torch_res[t, c].item(), plain=plain0[t, c].item(),
                                     residual=residual[t, c].item(),
                                     down=down[t * k:(t + 1) * k, c].float().tolist(), shared=shared[t, c].item(),
                                     gate=gate[t, 0].item(),
                                     torch_combine=(down[t * k:(t + 1) * k, c].float().sum()
                                                    + shared[t, c].float() * torch.sigmoid(gate[t, 0].float())
                                                    ).item()))
print(f"{bad_cases} of {total} cases with a residual mismatch")
for r in rows[:30]:
    print(r)
torch.save(rows, os.path.join(os.environ.get("OUT", "."), "combine-diag.pt"))
