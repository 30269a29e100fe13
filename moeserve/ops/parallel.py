"""The collectives of a multi-GPU engine: who this rank is, and all-reduce / all-gather / reduce-scatter over its
tensor-parallel group (NCCL on GPUs, gloo on the CPU), through ``torch.distributed``.

``Parallel()`` (one rank) is what a single-GPU engine holds; the layers check ``tp_size > 1`` when they are
built and never call a collective otherwise, so one GPU runs exactly as before: no collective, no copy, no
per-step host work.

``init_distributed`` joins the process group; it takes the rank and world from its arguments or from the
torchrun variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), so the same
code runs under the engine's own workers (one host) and under torchrun (several hosts).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# torch >= 2.12 names them *_single (the *_tensor names warn)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Parallel:
    """This rank's place in the tensor- and expert-parallel layout, and the collectives over its group.

    With expert parallelism (``ep_size > 1``, the same ranks as tensor parallelism) each rank holds the routed
    experts ``[ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size)`` whole; without it every rank holds a
    ``1 / tp_size`` slice of every expert."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    # allreduce | allgather_reducescatter: how an expert-parallel MoE layer reaches other ranks' experts
    expert_dispatch: str = "allreduce"
    group: dist.ProcessGroup | None = None  # None: the default group

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def is_first(self) -> bool:
        return self.tp_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` (rank order)."""
        dim = dim % x.dim()
        x = x.contiguous()
        out = torch.empty((self.tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather(out, x, group=self.group)
        if dim == 0:
            return out
        out = out.view(self.tp_size, *x.shape)  # [ranks, ..., d, ...] -> [..., ranks * d, ...]
        return out.movedim(0, dim).reshape(*x.shape[:dim], self.tp_size * x.shape[dim], *x.shape[dim + 1:])

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[rank * n, (rank + 1) * n)`` of the sum of ``x`` ``[ranks * n, ...]`` over the ranks."""
        x = x.contiguous()
        out = torch.empty((x.shape[0] // self.tp_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        _reduce_scatter(out, x, group=self.group)
        return out


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a process joins the group."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    from_env: bool = False  # started by torchrun: join through its variables (and its agent's store)

    @property
    def init_method(self) -> str:
        if self.from_env:
            return "env://"
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def torchrun_env(env=None) -> dict | None:
    """``{rank, world_size, local_rank, master_addr, master_port}`` from torchrun's variables, or None when this
    process was not started by torchrun (``RANK`` and ``WORLD_SIZE`` unset)."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
    except ValueError as e:
        raise ValueError(f"torchrun variables: RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers ({e})") from None
    return {"rank": rank, "world_size": world, "local_rank": local, "master_addr": env.get("MASTER_ADDR"),
            "master_port": port}


def rendezvous(world_size: int, master_addr: str | None = None, master_port: int | None = None,
               env=None) -> Rendezvous:
    """Rank 0's rendezvous for ``world_size`` ranks: the config's address and port, else torchrun's variables,
    else this host and a free port. Under torchrun, this process's rank comes from ``RANK``."""
    env = os.environ if env is None else env
    tr = torchrun_env(env)
    if tr is not None and tr["world_size"] != world_size:
        raise ValueError(f"tensor_parallel_size is {world_size} but torchrun started WORLD_SIZE={tr['world_size']} "
                         "processes; they must match")
    addr = master_addr or env.get("MASTER_ADDR") or "127.0.0.1"
    port = master_port or (int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None) or free_port()
    if tr is None:
        return Rendezvous(0, world_size, 0, addr, port)
    return Rendezvous(tr["rank"], world_size, tr["local_rank"], addr, port, from_env=True)


def init_distributed(rdv: Rendezvous, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the default process group: NCCL when ``device`` is a GPU (bound to it), else gloo."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; one engine per process "
                           "when tensor_parallel_size > 1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=rdv.init_method, rank=rdv.rank, world_size=rdv.world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)


def cpu_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over every rank for host objects (step descriptions across hosts)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest of the ranks' ``value`` (the KV-cache size every rank can hold)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def abort() -> None:
    """Tear the process group down so a collective blocked on a dead rank returns (best effort)."""
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - already gone, or this torch cannot abort
        pass


def shutdown() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group left broken by a dead rank
            pass
