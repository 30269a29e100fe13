"""Make the A/B's trees from read_floor's sweep: row (each linear's fastest one-row tile where it beats the GEMV
by 0.15 us or more), row2 (the second fastest); with no such linear, two tl.dot tiles for the QKV projection.
Prints the --tree/--arm arguments."""
import json, os, shutil, sys
d = json.load(open(sys.argv[1]))
here = os.getcwd()
def tree(name, tiles):
    root = f"/tmp/tree-{name}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(f"{here}/moeserve", f"{root}/moeserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(f"{here}/scripts", f"{root}/scripts", ignore=shutil.ignore_patterns("__pycache__"))
    json.dump(tiles, open(f"{root}/moeserve/ops/gemv-tiles.json", "w"), indent=1)
    print(f"{name}: {json.dumps(tiles)}", file=sys.stderr)
    return f"--tree {name}={root} --arm {name}@{name}:allow_jit=true"
row, row2 = {}, {}
for r in d["linears"]:
    key = f"{r['N']},{r['K']}"
    ranked = r["row_all"]
    if ranked[0][0] <= r["gemv_us"] - 0.15:
        row[key] = ranked[0][1]
        row2[key] = ranked[1][1]
    print(f"{r['linear']}: gemv {r['gemv_us']} row {ranked[0][0]} {ranked[0][1]}, {ranked[1][0]} {ranked[1][1]}", file=sys.stderr)
if row:
    args = [tree("row", row), tree("row2", row2)]
else:
    args = [tree("qkv16", {"6144,2048": {"row": 0, "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}}),
            tree("qkv32s3", {"6144,2048": {"row": 0, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}})]
print(" ".join(args))
