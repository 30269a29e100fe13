"""Trees for the A/B of the GEMVs' first weight tile loaded before the PDL wait (branch gemv-preload): copies of
this tree whose linear_triton.py ends with overrides adding "preload" to the QKV projection's tiles
(gemv_config, 6144 x 2048), the output projection's (gemv_row_config, at most 4,096 rows), or both. Prints the
--tree/--arm arguments. One more arm, lmgemv, runs the LM head of one-token steps through the Triton GEMV
(_gemv_kernel's built-in tiles, PDL) instead of cuBLAS: GEMV_MAX_N raised and MoECausalLM.compute_logits sent
through the linear backend (an experiment's copy only: page r timed the GEMV at 144.9 against cuBLAS's 152.7 us
on the LM head, and cuBLAS is not launched under PDL). And pmoe: the routed MoE grid's router slices and shared
expert pieces load their first weights before the PDL wait (routed_moe_triton.PRELOAD)."""
import os, shutil, sys
here = os.getcwd()
ARMS = {"pqkv": (True, False), "po": (False, True), "pboth": (True, True)}
TAIL = '''

_QKV, _O = {qkv}, {o}  # appended for an A/B


def gemv_config(n, k, _base=gemv_config):  # noqa: F811
    c = _base(n, k)
    return {{**c, "preload": True}} if _QKV and (n, k) == (6144, 2048) else c


def gemv_row_config(n, k, _base=gemv_row_config):  # noqa: F811
    c = _base(n, k)
    return {{**c, "preload": True}} if _O and c is not None else c
'''
LM_TAIL = '''

def _compute_logits_gemv(self, hidden):  # appended for an A/B: the LM head through the linear backend
    logits = self.ops.linear.linear(hidden, self.lm_head)
    p = self.ops.parallel
    if p.is_parallel:
        logits = p.all_gather(logits, dim=-1)[:, :self.arch.vocab_size]
    return logits.float()


MoECausalLM.compute_logits = _compute_logits_gemv
'''
if __name__ == "__main__":
    args = []
    for name, (qkv, o) in ARMS.items():
        root = f"tree-{name}"
        shutil.rmtree(root, ignore_errors=True)
        for d in ("moeserve", "scripts"):
            shutil.copytree(f"{here}/{d}", f"{root}/{d}", ignore=shutil.ignore_patterns("__pycache__"))
        with open(f"{root}/moeserve/ops/linear_triton.py", "a") as f:
            f.write(TAIL.format(qkv=qkv, o=o))
        print(f"{name}: preload QKV {qkv}, output projection {o}", file=sys.stderr)
        args.append(f"--tree {name}={root} --arm {name}@{name}")
    root = "tree-lmgemv"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("moeserve", "scripts"):
        shutil.copytree(f"{here}/{d}", f"{root}/{d}", ignore=shutil.ignore_patterns("__pycache__"))
    with open(f"{root}/moeserve/ops/linear_triton.py", "a") as f:
        f.write("\n\nGEMV_MAX_N = 1 << 20  # appended for an A/B: the LM head too\n")
    with open(f"{root}/moeserve/models/layers.py", "a") as f:
        f.write(LM_TAIL)
    print("lmgemv: the LM head of one-token steps through the GEMV", file=sys.stderr)
    args.append(f"--tree lmgemv={root} --arm lmgemv@lmgemv")
    root = "tree-pmoe"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("moeserve", "scripts"):
        shutil.copytree(f"{here}/{d}", f"{root}/{d}", ignore=shutil.ignore_patterns("__pycache__"))
    with open(f"{root}/moeserve/ops/moe/routed_moe_triton.py", "a") as f:
        f.write("\n\nPRELOAD = True  # appended for an A/B\n")
    print("pmoe: the routed grid's router slices and pieces load their first weights before the PDL wait",
          file=sys.stderr)
    args.append(f"--tree pmoe={root} --arm pmoe@pmoe")
    print(" ".join(args))
