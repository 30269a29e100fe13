"""Trees for one A/B at c=1 of both unmeasured branches merged (exp): the strided one-row QKV GEMV (three tiles) and
the Triton add + RMSNorm for one-token steps. Prints the --tree/--arm arguments."""
import os, shutil, sys
here = os.getcwd()
QKV = {"p8x1": {"row": True, "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1, "programs_per_sm": 1},
       "p16x1": {"row": True, "BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1, "programs_per_sm": 1},
       "p8x2": {"row": True, "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1, "programs_per_sm": 2}}
TAIL = '''

_OVERRIDE = {override}  # appended for an A/B


def gemv_row_config(n, k, _base=gemv_row_config):  # noqa: F811
    return _OVERRIDE if (n, k) == (6144, 2048) else _base(n, k)
'''
def tree(name):
    root = f"/tmp/tree-{name}"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("moeserve", "scripts"):
        shutil.copytree(f"{here}/{d}", f"{root}/{d}", ignore=shutil.ignore_patterns("__pycache__"))
    return root
if __name__ == "__main__":
    args = []
    for name, cfg in QKV.items():
        root = tree(name)
        with open(f"{root}/moeserve/ops/linear_triton.py", "a") as f:
            f.write(TAIL.format(override=repr(cfg)))
        print(f"{name}: QKV {cfg}", file=sys.stderr)
        args.append(f"--tree {name}={root} --arm {name}@{name}:allow_jit=true")
    root = tree("tnorm1")
    with open(f"{root}/moeserve/ops/basic.py", "a") as f:
        f.write("\n\nTRITON_ADD_NORM_MAX_TOKENS = 1  # appended for an A/B\n")
    print("tnorm1: Triton add + RMSNorm for one-token steps", file=sys.stderr)
    args.append(f"--tree tnorm1={root} --arm tnorm1@tnorm1:allow_jit=true")
    print(" ".join(args))
