"""The engine core: a process that owns the ``LLMEngine`` and talks to the HTTP front end over ZMQ.

``run_engine_core`` is the process's entry point (``python -m moeserve.engine.core``, its arguments pickled
on stdin). It connects to the front end's two ipc sockets (commands
in, outputs out), builds the engine, answers ``Ready`` (or ``StartFailed``) and runs ``EngineCore.run``:

- With requests to run, the loop never waits on the socket: it takes whatever commands have arrived
  (without blocking), runs one engine step and sends every request's new tokens of that step in one
  message. Idle, it blocks on the socket (waking at once when a request arrives).
- Failures stay local: a request the engine refuses gets an error delta; when a step raises, the
  requests in it are aborted (pages freed) and failed, and the loop carries on.
- The core sits in its own process group and ignores SIGINT, so Ctrl+C in a terminal reaches only the
  front end, which drains and then sends ``shutdown``. If the front end dies, the core notices (its parent
  changes) and exits.
- Once the engine is built, everything alive is moved out of the garbage collector's reach (``gc.freeze``, as
  vLLM does after its warm-up): a full collection then walks only what serving allocated since, where it
  walked the whole startup heap (torch, Triton, the model), a pause of a quarter second on a slow CPU in the
  middle of a step.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time

import zmq

from moeserve.engine.core_protocol import (
    Command, CoreDelta, CoreDied, CoreError, CoreOutputs, EngineLoad, Ready, StartFailed, decode, encode,
)
from moeserve.engine.workers import WorkerError

log = logging.getLogger("moeserve.core")

IDLE_POLL_MS = 500  # how often an idle core checks that the front end is still there


class EngineCore:
    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int | None = None):
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.sent: dict[str, int] = {}  # request id -> output tokens already sent
        self.received = 0
        self.stopping = False
        self._deltas: list[CoreDelta] = []
        self._replies: dict[int, object] = {}
        self._last_load: EngineLoad | None = None

    # --- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            if engine.has_unfinished():
                self._take_commands(0)
            elif not self._take_commands(IDLE_POLL_MS):
                if self._orphaned():
                    log.warning("the front end is gone; the engine core exits")
                    return
                continue
            if self.stopping:
                break
            if engine.has_unfinished():
                self._step()
            self._flush()

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _take_commands(self, timeout_ms: int) -> bool:
        """Handle every command that has arrived, waiting up to ``timeout_ms`` for the first."""
        if timeout_ms and not self.inbox.poll(timeout_ms, zmq.POLLIN):
            return False
        got = False
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return got
            got = True
            self._handle(decode(data))

    def _handle(self, cmd: Command) -> None:
        if cmd.kind == "add":
            for req in cmd.payload:
                self._add(req)
        elif cmd.kind == "abort":
            for rid in cmd.payload:
                self.sent.pop(rid, None)
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    log.exception("aborting %s failed", rid)
        elif cmd.kind == "call":
            call_id, name = cmd.payload
            try:
                self._replies[call_id] = self._call(name)
            except Exception as e:
                self._replies[call_id] = CoreError(500, f"{type(e).__name__}: {e}", "engine_error")
        elif cmd.kind == "shutdown":
            self.stopping = True
        else:
            log.error("unknown command %r", cmd.kind)

    def _call(self, name: str):
        if name == "memory":
            return self.engine.memory_report()
        if name == "describe":
            return describe(self.engine)
        raise ValueError(f"unknown call {name!r}")

    def _add(self, req) -> None:
        from moeserve.engine.requests import RequestError
        self.received += 1
        try:
            self.engine.add_request(req.prompt_token_ids, req.params, request_id=req.request_id)
        except RequestError as e:
            self._deltas.append(CoreDelta(req.request_id, [], error=CoreError(400, str(e), "invalid_value")))
            return
        except Exception as e:
            log.exception("the engine failed to add request %s", req.request_id)
            self._deltas.append(CoreDelta(req.request_id, [], error=CoreError(
                500, f"the engine failed to accept the request: {type(e).__name__}: {e}", "engine_error")))
            return
        self.sent[req.request_id] = 0

    def _step(self) -> None:
        engine = self.engine
        try:
            touched = engine.step()
        except WorkerError:
            raise  # a rank of a multi-GPU engine is gone: the core stops, and the front end says so
        except Exception as e:
            log.exception("an engine step failed; failing the requests in it and carrying on")
            victims = [s.request_id for s in list(engine.scheduler.running)]
            if not victims:
                victims = [s.request_id for s in list(engine.scheduler.waiting)]
            err = CoreError(500, f"the engine failed while generating: {type(e).__name__}: {e}", "engine_error")
            for rid in victims:
                try:
                    engine.abort_request(rid)
                except Exception:
                    log.exception("aborting %s after a failure also failed", rid)
                if self.sent.pop(rid, None) is not None:
                    self._deltas.append(CoreDelta(rid, [], error=err))
            return
        for seq in touched:
            sent = self.sent.get(seq.request_id)
            if sent is None:  # aborted by the front end while its step ran
                continue
            tokens = seq.output_token_ids
            delta = CoreDelta(seq.request_id, tokens[sent:])
            if seq.logprobs is not None:
                delta.logprobs = seq.logprobs[sent:len(tokens)]
            if sent == 0:
                delta.prompt_logprobs = seq.prompt_logprobs
                delta.num_cached_tokens = seq.num_cached_tokens
                t = seq.timing
                if t.first_scheduled is not None and t.first_token is not None:
                    delta.queue_s, delta.prefill_s = t.first_scheduled - t.arrival, t.first_token - t.first_scheduled
            if seq.is_finished:
                delta.finish_reason = seq.finish_reason
                del self.sent[seq.request_id]
            else:
                self.sent[seq.request_id] = len(tokens)
            self._deltas.append(delta)

    def load(self) -> EngineLoad:
        e = self.engine
        s = e.scheduler
        return EngineLoad(len(s.running), len(s.waiting), e.pool.num_used, e.pool.capacity, s.num_preemptions,
                          len(e.sequences), self.received, e.pool.queries, e.pool.hits)

    def _flush(self) -> None:
        """Send this iteration's deltas and replies in one message (and the load when it changed)."""
        load = self.load()
        if not (self._deltas or self._replies or load != self._last_load):
            return
        out = CoreOutputs(self._deltas, load, self._replies)
        self._deltas, self._replies, self._last_load = [], {}, load
        self.outbox.send(encode(out), copy=False)


def describe(engine) -> dict:
    return engine.describe() | {"pid": os.getpid(), "gc_frozen_objects": gc.get_freeze_count()}


def freeze_startup_heap() -> None:
    """Collect once, then keep everything alive now out of later collections (the engine lives as long as the
    process)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("engine core %d: %d startup objects frozen out of garbage collection (%.0f ms)", os.getpid(),
             gc.get_freeze_count(), (time.perf_counter() - t0) * 1e3)


def _import(path: str):
    import importlib
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def run_engine_core(config, inbox_addr: str, outbox_addr: str, parent_pid: int,
                    engine_factory: str | None = None, log_level: int = logging.INFO) -> None:
    """The engine-core process: build the engine from ``config`` (``engine_factory``, ``"module:function"``,
    builds it instead of ``LLMEngine`` when given), report ready, serve commands until ``shutdown``."""
    try:
        os.setpgid(0, 0)  # terminal signals (Ctrl+C) go to the front end, which shuts the core down in order
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(outbox_addr)
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(inbox_addr)
    code = 0
    try:
        try:
            engine = _build(config, engine_factory)
        except BaseException as e:
            user = _is_user_error(e)
            if not user:
                log.exception("the engine failed to start")
            outbox.send(encode(StartFailed(str(e) if user else f"{type(e).__name__}: {e}", user)))
            code = 1
            return
        freeze_startup_heap()
        outbox.send(encode(Ready(engine.arch.vocab_size, engine.max_model_len, engine.eos_token_ids,
                                 engine.source.config_dir, describe(engine), engine.hardware.to_dict(),
                                 EngineLoad(pages_total=engine.pool.capacity))))
        core = EngineCore(engine, inbox, outbox, parent_pid)
        try:
            core.run()
        except BaseException as e:
            log.exception("the engine core loop stopped")
            outbox.send(encode(CoreDied(f"{type(e).__name__}: {e}")))
            code = 1
        finally:
            engine.shutdown()  # the other ranks of a multi-GPU engine (nothing on one GPU)
    finally:
        inbox.close(linger=0)
        outbox.close()
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            os._exit(code)


def main() -> None:
    """``python -m moeserve.engine.core``: the arguments of ``run_engine_core``, pickled, on stdin."""
    import pickle
    kwargs = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    run_engine_core(**kwargs)


def _build(config, engine_factory: str | None):
    if engine_factory is not None:
        return _import(engine_factory)(config)
    from moeserve.engine.engine import LLMEngine
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    log.info("engine core %d ready in %.1f s", os.getpid(), time.perf_counter() - t0)
    return engine


def _is_user_error(e: BaseException) -> bool:
    """A problem with the configuration or the machine, told in one line (as the CLI tells them)."""
    from moeserve.backends import BackendUnavailable
    from moeserve.config import ConfigError
    from moeserve.engine.requests import RequestError
    from moeserve.kernel_cache import KernelCacheError
    return isinstance(e, (ConfigError, BackendUnavailable, RequestError, KernelCacheError, NotImplementedError)) \
        or type(e) is ValueError


if __name__ == "__main__":
    main()
