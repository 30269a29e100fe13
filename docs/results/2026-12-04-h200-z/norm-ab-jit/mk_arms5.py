"""Trees for the A/B of the Triton add + RMSNorm (branch norm-early-launch): copies of this tree whose basic.py ends
with TRITON_ADD_NORM_MAX_TOKENS set. Prints the --tree/--arm arguments."""
import os, shutil, sys
here = os.getcwd()
ARMS = {"tnorm1": 1, "tnorm64": 64}
if __name__ == "__main__":
    args = []
    for name, bound in ARMS.items():
        root = f"/tmp/tree-{name}"
        shutil.rmtree(root, ignore_errors=True)
        for d in ("moeserve", "scripts"):
            shutil.copytree(f"{here}/{d}", f"{root}/{d}", ignore=shutil.ignore_patterns("__pycache__"))
        with open(f"{root}/moeserve/ops/basic.py", "a") as f:
            f.write(f"\n\nTRITON_ADD_NORM_MAX_TOKENS = {bound}  # appended for an A/B\n")
        print(f"{name}: steps of up to {bound} tokens", file=sys.stderr)
        args.append(f"--tree {name}={root} --arm {name}@{name}:allow_jit=true")
    print(" ".join(args))
