"""Trees for the A/B of one token's down projection in _down_row_kernel: copies of this tree whose
triton_kernels.py ends with DOWN_ROW_TILES set. Prints the --tree/--arm arguments."""
import os, shutil, sys
here = os.getcwd()
ARMS = {"downA": {"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 3},
        "downB": {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1},
        "downC": {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 3}}
if __name__ == "__main__":
    args = []
    for name, tiles in ARMS.items():
        root = f"/tmp/tree-{name}"
        shutil.rmtree(root, ignore_errors=True)
        for d in ("moeserve", "scripts"):
            shutil.copytree(f"{here}/{d}", f"{root}/{d}", ignore=shutil.ignore_patterns("__pycache__"))
        with open(f"{root}/moeserve/ops/moe/triton_kernels.py", "a") as f:
            f.write(f"\n\nDOWN_ROW_TILES = {tiles!r}  # appended for an A/B\n")
        print(f"{name}: {tiles}", file=sys.stderr)
        args.append(f"--tree {name}={root} --arm {name}@{name}:allow_jit=true")
    print(" ".join(args))
