"""``moeserve env``: the machine, the library versions, and which operator backends can run here."""
from __future__ import annotations

import json

import torch
from rich.console import Console
from rich.table import Table

from moeserve.backends import availability_matrix
from moeserve.config import resolve_dtype
from moeserve.hardware import MIN_CAPABILITY, gpu_topology, probe, resolve_device
from moeserve.models.parallel import collectives


def env_report(cfg=None) -> dict:
    hw = probe()
    device = resolve_device(cfg.device if cfg else "auto")
    dtype = resolve_dtype(cfg.dtype if cfg else "auto", None, device)
    quant = cfg.quantization if cfg else "none"
    report = {
        "hardware": hw.to_dict(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "kernels": availability_matrix(hw, device, dtype, quant),
        "gpu_topology": gpu_topology() if len(hw.gpus) > 1 else None,
        "parallel": parallel_report(cfg, device),
    }
    try:
        from moeserve.kernel_cache import artifact_report
        report["flashinfer_artifacts"] = artifact_report(hw)
    except ImportError:
        pass
    return report


def parallel_report(cfg, device) -> dict:
    import os
    tp = cfg.tensor_parallel_size if cfg else 1
    ep = bool(cfg and cfg.enable_expert_parallel)
    dispatch = cfg.expert_parallel_dispatch if cfg else "auto"
    out = collectives(tp, ep, "allreduce" if dispatch == "auto" else dispatch, device.type)
    out["tensor_parallel_size"], out["enable_expert_parallel"] = tp, ep
    if tp > 1 and device.type == "cuda":
        out["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE", "unset (NCCL decides)")
    return out


def print_env(args) -> int:
    from moeserve.args import config_from_args
    cfg = config_from_args(args)
    report = env_report(cfg)
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, default=str))
        return 0
    con = Console()
    hw = report["hardware"]
    if not hw["gpus"]:
        con.print("[bold]No CUDA GPU on this machine[/bold]: moeserve runs its torch reference backends on the CPU "
                  f"({hw['cpu']}, {hw['cpu_count']} cores).")
    else:
        t = Table(title="GPUs")
        for col in ("index", "name", "compute capability", "arch", "memory", "SMs"):
            t.add_column(col)
        for g in hw["gpus"]:
            cc = tuple(g["capability"])
            note = "" if cc >= MIN_CAPABILITY else " (below sm75: no GPU kernels)"
            t.add_row(str(g["index"]), g["name"], f"{cc[0]}.{cc[1]}{note}", g["arch"],
                      f"{g['total_memory_bytes'] / 2**30:.1f} GiB", str(g["multiprocessors"]))
        con.print(t)
    v = Table(title="Versions")
    v.add_column("component")
    v.add_column("version")
    v.add_row("driver", str(hw.get("driver_version") or "-"))
    v.add_row("CUDA (torch build)", str(hw.get("cuda_runtime") or "-"))
    for name, ver in hw["versions"].items():
        v.add_row(name, ver or "not installed")
    con.print(v)
    k = Table(title=f"Kernel availability on {report['device']} ({report['dtype']})")
    for col in ("operator", "backend", "status", "auto"):
        k.add_column(col)
    for row in report["kernels"]:
        status = "[green]available[/green]" if row["available"] else f"[yellow]{row['status']}[/yellow]"
        k.add_row(row["operator"], row["backend"], status, "<- auto" if row["auto"] else "")
    con.print(k)
    topo = report.get("gpu_topology")
    if topo:
        t = Table(title="GPU links (nvidia-smi topo -m)")
        t.add_column("GPUs")
        t.add_column("link")
        for pair, link in topo.items():
            t.add_row(pair, link)
        con.print(t)
    par = report["parallel"]
    if par["ranks"] > 1:
        t = Table(title=f"Collectives per step: tensor_parallel_size {par['ranks']} over {par['backend']}"
                  + (", expert parallel" if par["enable_expert_parallel"] else ""))
        t.add_column("what")
        for c in par["collectives"]:
            t.add_row(c)
        if "NCCL_NVLS_ENABLE" in par:
            t.add_row(f"NCCL_NVLS_ENABLE={par['NCCL_NVLS_ENABLE']}")
        con.print(t)
    arts = report.get("flashinfer_artifacts")
    if arts:
        a = Table(title="FlashInfer artifacts")
        a.add_column("item")
        a.add_column("value")
        for key, val in arts.items():
            a.add_row(key, str(val))
        con.print(a)
    if torch.cuda.is_available() is False and hw["gpus"]:
        con.print("[red]torch sees no CUDA device[/red]")
    return 0
