"""Trees for the A/B of the one-row GEMV's QKV tiles: copies of this tree whose linear_triton.py ends with an
override of gemv_row_config for the 6144 x 2048 QKV weight (None: the tl.dot GEMV with its tiles). Prints the
--tree/--arm arguments."""
import json, os, shutil, sys
here = os.getcwd()
ARMS = {"row8": {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1},
        "row16w4": {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1},
        "row32": {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3},
        "oonly": None}
TAIL = '''

_OVERRIDE = {override}  # appended for an A/B


def gemv_row_config(n, k, _base=gemv_row_config):  # noqa: F811
    return _OVERRIDE if (n, k) == (6144, 2048) else _base(n, k)
'''
args = []
for name, cfg in ARMS.items():
    root = f"/tmp/tree-{name}"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("moeserve", "scripts"):
        shutil.copytree(f"{here}/{d}", f"{root}/{d}", ignore=shutil.ignore_patterns("__pycache__"))
    with open(f"{root}/moeserve/ops/linear_triton.py", "a") as f:
        f.write(TAIL.format(override=repr(cfg)))
    print(f"{name}: QKV {cfg}", file=sys.stderr)
    args.append(f"--tree {name}={root} --arm {name}@{name}:allow_jit=true")
print(" ".join(args))
