"""The PTX of every Triton kernel a configuration launches, compiled here for a target GPU without line info: two
trees' outputs compared tell whether a change to the kernels' source changes the code they compile to.

    python scripts/kernel_ptx.py --config moeserve/presets/bench-gpu.yaml --arch 9.0a --out DIR [--set K=V ...]
    python scripts/kernel_ptx.py --compare DIR_A DIR_B

Each kernel is written as ``DIR/NAME-LAUNCH_HASH.ptx`` (the hash of its signature, constexprs, specialization,
warps and stages: the same file name in two trees is the same launch); ``--compare`` lists the files that differ
or are only in one, and exits 1 if any do. It compiles the kernels of the ``moeserve`` it imports (another
tree's: ``PYTHONPATH=TREE python scripts/kernel_ptx.py ...``), in a scratch cache, as
``moeserve precompile`` does without its FlashInfer modules.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path


def dump(args) -> int:
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    from triton.runtime.cache import _base32, triton_key

    from moeserve.args import config_from_args
    from moeserve.kernel_cache.layout import parse_arch
    from moeserve.tools import triton_aot
    from moeserve.tools.modules import plan_for_arch

    cfg = config_from_args(args)
    arch = parse_arch(args.arch)
    plan = plan_for_arch(cfg, arch)
    device_name = triton_aot.DEFAULT_DEVICE_NAMES[arch.capability]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    with tempfile.TemporaryDirectory() as scratch, triton_aot.tuned_tables_for(device_name), \
            triton_aot.compile_session(Path(scratch), arch.capability, triton_key(), binary_only=False) as events:
        triton_aot.launch_every_kernel(plan)
        for e in {e["hash"]: e for e in events}.values():
            d = Path(scratch) / _base32(e["hash"])
            ptx = next(d.glob("*.ptx"))
            meta = json.loads((d / (ptx.stem + ".json")).read_text())
            launch = json.dumps([e["name"], e["signature"], e["constants"], e["attrs"],
                                 {k: meta.get(k) for k in ("num_warps", "num_stages", "launch_pdl")}], sort_keys=True)
            name = f"{ptx.stem[:80]}-{hashlib.sha256(launch.encode()).hexdigest()[:16]}.ptx"
            (out / name).write_text(ptx.read_text())
            n += 1
    print(f"{n} kernels' PTX -> {out}")
    return 0


def compare(a: Path, b: Path) -> int:
    fa, fb = {p.name for p in a.glob("*.ptx")}, {p.name for p in b.glob("*.ptx")}
    differ = sorted(n for n in fa & fb if (a / n).read_text() != (b / n).read_text())
    for n in differ:
        print(f"differs: {n}")
    for n in sorted(fa - fb):
        print(f"only in {a}: {n}")
    for n in sorted(fb - fa):
        print(f"only in {b}: {n}")
    print(f"{len(fa & fb) - len(differ)} equal, {len(differ)} differ, {len(fa ^ fb)} in one only")
    return 1 if differ or fa ^ fb else 0


def main(argv: list[str]) -> int:
    from moeserve.args import add_config_args
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", nargs=2, metavar="DIR", help="compare two dumps")
    p.add_argument("--arch", default="9.0a")
    p.add_argument("--out")
    add_config_args(p)
    args = p.parse_args(argv)
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    if not args.out:
        p.error("--out DIR is needed (or --compare DIR_A DIR_B)")
    return dump(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
