"""Ranks of a multi-GPU engine: one process per GPU, each running a ``ModelRunner`` on its part of the model.

Rank 0 lives in the engine's process (``ParallelExecutor``, which the engine uses as its runner); every step
it launches is first sent to the other ranks, which run the same step (``run_worker``). Nothing but plain
data crosses: the config, ``StepInput``s and a few commands. Each rank samples the same tokens (the logits are
gathered on every rank), so no tokens travel back; rank 0 reports them.

Two ways to start the ranks:

- one host (the default): the engine spawns ranks ``1..N-1`` (``torch.multiprocessing``, spawn) and sends
  them steps over pipes. A watchdog thread in the engine's process sees a rank exit at once (its process
  sentinel), records why, and unblocks rank 0 (gloo fails on the closed connection; a NCCL group is
  aborted); the engine then raises ``WorkerError`` naming the rank instead of hanging in a collective.
- several hosts: ``torchrun`` starts every rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``); rank 0 runs the command, the others ``run_worker``, and steps are broadcast over a gloo
  group. torchrun's agent stops every rank when one fails; collectives time out after
  ``distributed.timeout_s``.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
from datetime import timedelta

import torch

from moeserve.config import EngineConfig
from moeserve.engine.runner import ModelRunner
from moeserve.ops import parallel as dist_ops
from moeserve.plan import resolve_plan

log = logging.getLogger("moeserve")

IDLE_TIMEOUT = timedelta(days=365)  # a rank waiting for the next step of an idle server waits this long
JOIN_SECONDS = 10.0


class WorkerError(RuntimeError):
    """A rank of a multi-GPU engine died or failed; the engine cannot go on."""


# --- how steps reach the other ranks ----------------------------------------------------------------

class PipeChannel:
    """Rank 0 -> ranks on this host: one pipe per rank, the message pickled once."""

    def __init__(self, conns):
        self.conns = conns

    def send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self.conns:
            c.send_bytes(data)

    def recv(self):
        return pickle.loads(self.conns[0].recv_bytes())

    def close(self) -> None:
        for c in self.conns:
            c.close()


class BroadcastChannel:
    """Rank 0 -> every rank over a gloo group (any host)."""

    def __init__(self, group):
        self.group = group

    def send(self, msg) -> None:
        torch.distributed.broadcast_object_list([msg], src=0, group=self.group)

    def recv(self):
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        pass


# --- the other ranks ---------------------------------------------------------------------------------

def serve_steps(runner: ModelRunner, channel) -> None:
    """Run what rank 0 sends until it says stop (or goes away)."""
    runner.copies_tokens = False
    while True:
        try:
            kind, payload = channel.recv()
        except EOFError:  # rank 0's process is gone
            return
        if kind == "step":
            runner.launch(payload)
        elif kind == "logits":
            runner.forward_logits(payload)
        elif kind == "capture":
            runner.capture_graphs(payload, progress=False)
        elif kind == "warm":
            runner.warm_up()
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")


def _limit_cpu_threads(device: torch.device, local_world: int) -> None:
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def _spawned_rank(config: EngineConfig, rdv: dist_ops.Rendezvous, steps, reports) -> None:
    """Entry point of a rank the engine spawned on this host."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches every process of a terminal: rank 0 stops us
    try:
        plan = resolve_plan(config, rank=rdv.rank, local_rank=rdv.local_rank)
        _limit_cpu_threads(plan.device, rdv.world_size)
        dist_ops.init_distributed(rdv, plan.device, config.distributed.timeout_s)
        runner = ModelRunner(plan)
        serve_steps(runner, PipeChannel([steps]))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process ends
        try:
            reports.send(f"{type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - rank 0 is gone too
            pass
        raise SystemExit(1) from None
    finally:
        dist_ops.shutdown()


def run_worker(config: EngineConfig) -> int:
    """A rank other than 0 under torchrun: build this rank's part of the model and run rank 0's steps."""
    rdv = dist_ops.rendezvous(config.world_size, config.distributed.master_addr, config.distributed.master_port)
    plan = resolve_plan(config, rank=rdv.rank, local_rank=rdv.local_rank)
    dist_ops.init_distributed(rdv, plan.device, config.distributed.timeout_s)
    try:
        channel = BroadcastChannel(dist_ops.cpu_group(IDLE_TIMEOUT.total_seconds()))
        serve_steps(ModelRunner(plan), channel)
    finally:
        dist_ops.shutdown()
    return 0


# --- rank 0 ------------------------------------------------------------------------------------------

def _process_context():
    """Fresh processes, as spawn makes them, but forked from a server that has imported torch and moeserve
    once (forkserver), so a rank starts in a fraction of a second after the first; spawn where there is no
    forkserver. Neither inherits CUDA state."""
    import multiprocessing
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = torch.multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return torch.multiprocessing.get_context("spawn")


class ParallelExecutor:
    """Rank 0's runner plus the other ranks: ``launch``/``wait``/``capture_graphs`` as a ``ModelRunner``, every
    step sent to all ranks first. Other attributes are the local runner's."""

    def __init__(self, plan):
        self._closing = False
        config = self.config = plan.config
        self.world_size = config.world_size
        self.failure: str | None = None
        self._failed = threading.Event()
        self._procs: list = []
        self._reports: dict = {}
        self._errors: dict[int, str] = {}
        self.runner = None
        dc = config.distributed
        rdv = dist_ops.rendezvous(self.world_size, dc.master_addr, dc.master_port)
        if rdv.rank != 0:
            raise RuntimeError(f"this process is rank {rdv.rank} of a torchrun launch; only rank 0 runs the engine "
                               "(the others run moeserve.engine.workers.run_worker)")
        self.torchrun = rdv.from_env
        self.device = plan.device
        try:
            if not self.torchrun:
                self._spawn(rdv)
            dist_ops.init_distributed(rdv, plan.device, dc.timeout_s)
            if self.torchrun:
                self.channel = BroadcastChannel(dist_ops.cpu_group(IDLE_TIMEOUT.total_seconds()))
            self.runner = self._guard(lambda: ModelRunner(plan), "while loading the model")
        except BaseException:
            self.shutdown()
            raise
        log.info("%d ranks ready: tensor_parallel_size %d%s (%s)", self.world_size, self.world_size,
                 ", expert parallel" if plan.parallel.ep_size > 1 else "",
                 "torchrun" if self.torchrun else f"worker pids {[p.pid for p in self._procs]}")

    def __getattr__(self, name):
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    # --- starting and watching the ranks of this host ------------------------------------------------
    def _spawn(self, rdv: dist_ops.Rendezvous) -> None:
        ctx = _process_context()
        conns = []
        for rank in range(1, self.world_size):
            steps_r, steps_w = ctx.Pipe(duplex=False)
            reports_r, reports_w = ctx.Pipe(duplex=False)
            mine = dist_ops.Rendezvous(rank, rdv.world_size, rank, rdv.master_addr, rdv.master_port)
            p = ctx.Process(target=_spawned_rank, args=(self.config, mine, steps_r, reports_w), daemon=True,
                            name=f"moeserve-rank{rank}")
            p.start()
            steps_r.close()
            reports_w.close()
            conns.append(steps_w)
            self._procs.append(p)
            self._reports[reports_r] = rank
        self.channel = PipeChannel(conns)
        threading.Thread(target=self._watch, name="moeserve-rank-watchdog", daemon=True).start()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _watch(self) -> None:
        from multiprocessing.connection import wait
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        reports = dict(self._reports)
        while not self._closing and sentinels:
            for ready in wait([*sentinels, *reports], timeout=1.0):
                if ready in reports:
                    try:
                        self._errors[reports[ready]] = ready.recv()
                    except (EOFError, OSError):
                        del reports[ready]
                    continue
                rank, p = sentinels.pop(ready)
                p.join(1.0)
                if self._closing:
                    return
                for conn in [c for c, r in reports.items() if r == rank and c.poll()]:
                    try:
                        self._errors[rank] = conn.recv()
                    except (EOFError, OSError):
                        pass
                why = self._errors.get(rank)
                self._fail(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}" + (f": {why}" if why else ""))
                return

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
            log.error("multi-GPU engine: %s; stopping", why)
        self._failed.set()
        if self.device.type == "cuda":
            dist_ops.abort()  # NCCL kernels waiting on the dead rank return

    def _guard(self, fn, what: str):
        """Run ``fn``; a failure (or an earlier one) becomes a ``WorkerError`` naming the rank at fault."""
        if self.failure is not None:
            raise WorkerError(f"the engine stopped: {self.failure}")
        try:
            return fn()
        except Exception as e:
            if not self.torchrun:  # a collective that failed because a rank died: let the watchdog name it
                self._failed.wait(timeout=5.0)
            if self.failure is None:
                self._fail(f"rank 0 failed {what}: {type(e).__name__}: {e}")
            self.shutdown()
            raise WorkerError(f"the engine stopped: {self.failure}") from e

    # --- the runner surface ---------------------------------------------------------------------
    def launch(self, step):
        def run():
            self.channel.send(("step", step))
            return self.runner.launch(step)
        return self._guard(run, f"in step {step.step_id}")

    def wait(self, launched):
        out = self._guard(lambda: self.runner.wait(launched), "waiting for a step")
        if self.failure is not None:  # the step's result cannot be trusted if a rank died under it
            raise WorkerError(f"the engine stopped: {self.failure}")
        return out

    def forward_logits(self, step) -> torch.Tensor:
        """The logits of a step (every rank runs it; nothing is sampled): for comparing engines in tests."""
        def run():
            self.channel.send(("logits", step))
            return self.runner.forward_logits(step)
        return self._guard(run, f"computing the logits of step {step.step_id}")

    def capture_graphs(self, sizes: list[int], progress: bool = True) -> None:
        if self.device.type != "cuda" or not sizes:
            return

        def run():
            self.channel.send(("capture", sizes))
            self.runner.capture_graphs(sizes, progress=progress)
        self._guard(run, "capturing CUDA graphs")

    def warm_up(self) -> None:
        if self.device.type != "cuda":
            return

        def run():
            self.channel.send(("warm", None))
            self.runner.warm_up()
        self._guard(run, "warming up the kernels")

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        if self._closing:
            return
        self._closing = True
        channel = self.__dict__.get("channel")
        if channel is not None and self.failure is None:
            try:
                channel.send(("stop", None))
            except Exception:  # noqa: BLE001 - a rank already gone
                pass
        for p in self._procs:
            if self.failure is not None and p.is_alive():
                p.terminate()  # it may be blocked in a collective with the dead rank
            p.join(JOIN_SECONDS)
            if p.is_alive():
                p.terminate()
                p.join(JOIN_SECONDS)
        if channel is not None:
            channel.close()
        dist_ops.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
