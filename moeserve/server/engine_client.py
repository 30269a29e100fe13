"""The front end's side of the engine core: starts the core process, sends it requests and aborts, and
hands each request's deltas to its ``RequestStream``, all on the asyncio event loop without blocking it.

``start`` (blocking, before serving) binds two ipc sockets, spawns ``moeserve.engine.core`` and waits for
its ``Ready``. ``attach(loop)`` then registers two file descriptors with the loop: the outputs socket (each
message is one engine step's deltas, dispatched in the callback straight into the requests' queues) and
the process's sentinel (readable when the core exits: every open request then ends with an error at once,
and ``is_alive`` turns false, so /health answers 503).

Requests are checked against ``server.max_queue_len`` here: running requests do not count; those waiting
in the engine's queue (as of its last report) and those sent but not yet received by the core do.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import zmq

from moeserve.engine.core_protocol import (
    Command, CoreDied, CoreOutputs, CoreRequest, EngineLoad, Ready, StartFailed, decode, encode,
)
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.step import TokenLogprobs
from moeserve.server.core_process import CoreProcess
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import APIError

log = logging.getLogger("moeserve.server")


class EngineStartError(RuntimeError):
    """The engine core could not start; ``user_error``: a configuration problem told in one line."""

    def __init__(self, message: str, user_error: bool = False):
        super().__init__(message)
        self.user_error = user_error


@dataclass
class SubRequest:
    """One engine request: a prompt and its sampling parameters; ``index`` is its choice index."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class Delta:
    """New output of one sub-request: tokens since the last delta, and how it ended (if it did)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    error: APIError | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """The outputs of one HTTP request's sub-requests, read on the event loop."""

    def __init__(self, subrequests: list[SubRequest]):
        self.subrequests = subrequests
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.unfinished = {s.index for s in subrequests}

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.subrequests]

    def request_id(self, index: int) -> str:
        return next(s.request_id for s in self.subrequests if s.index == index)

    async def next_batch(self) -> list[Delta]:
        """Wait for at least one delta, then take every delta already queued."""
        batch = [await self.queue.get()]
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        for d in batch:
            if d.done:
                self.unfinished.discard(d.index)
        return batch

    @property
    def finished(self) -> bool:
        return not self.unfinished


class QueueFull(APIError):
    def __init__(self, limit: int):
        super().__init__(503, f"the server is at capacity: {limit} requests are already waiting "
                         "(server.max_queue_len); retry later", code="queue_full",
                         headers={"Retry-After": "1"})


@dataclass
class _Owner:
    stream: RequestStream
    sub: SubRequest
    last: float = 0.0  # when its last token arrived
    got_tokens: bool = False


class EngineClient:
    """Runs the engine core in a child process and connects it to asyncio handlers."""

    def __init__(self, config, max_queue_len: int = 256, metrics: ServerMetrics | None = None,
                 engine_factory: str | None = None):
        self.config = config
        self.max_queue_len = max_queue_len
        self.metrics = metrics or ServerMetrics(config.model)
        self.engine_factory = engine_factory
        self.ready: Ready | None = None
        self.process: CoreProcess | None = None
        self.error: str | None = None  # why the core is gone, once it is
        self._ctx: zmq.Context | None = None
        self._inbox = self._outbox = None  # our ends: commands out (PUSH), outputs in (PULL)
        self._dir: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owners: dict[str, _Owner] = {}
        self._sent_adds = 0
        self._load = EngineLoad()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._closing = False

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> Ready:
        """Spawn the core and wait until it is ready (blocking); raises ``EngineStartError``."""
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        """Bind the sockets and start the core process (it loads the model while the caller goes on)."""
        self._dir = tempfile.mkdtemp(prefix="moeserve-ipc-")
        inbox_addr, outbox_addr = f"ipc://{self._dir}/commands", f"ipc://{self._dir}/outputs"
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PUSH)
        self._inbox.setsockopt(zmq.SNDHWM, 0)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(inbox_addr)
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.setsockopt(zmq.RCVHWM, 0)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.bind(outbox_addr)
        self.process = CoreProcess(dict(config=self.config, inbox_addr=inbox_addr, outbox_addr=outbox_addr,
                                        parent_pid=os.getpid(), engine_factory=self.engine_factory,
                                        log_level=logging.getLogger().getEffectiveLevel()))

    def wait_ready(self, timeout: float | None = None) -> Ready:
        """Block until the core reports ``Ready``; raises ``EngineStartError`` if it fails or dies."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._outbox.poll(100, zmq.POLLIN):
                msg = decode(self._outbox.recv())
                if isinstance(msg, Ready):
                    break
                if isinstance(msg, StartFailed):
                    self._stop_process(5.0)
                    raise EngineStartError(msg.message, msg.user_error)
                continue
            if not self.process.is_alive():
                raise EngineStartError(f"the engine process exited during start-up (exit code {self.process.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                self._stop_process(5.0)
                raise EngineStartError(f"the engine did not start within {timeout:.0f} s")
        # the core connected its command socket before loading; make sure the connection is attached
        if not self._inbox.poll(10_000, zmq.POLLOUT):
            self._stop_process(5.0)
            raise EngineStartError("the engine process did not connect to the front end")
        self.ready = msg
        self._load = ld = msg.load
        self.metrics.set_load(ld.running, ld.waiting, ld.pages_used, ld.pages_total, ld.preemptions,
                              ld.prefix_cache_queries, ld.prefix_cache_hits)
        return msg

    def attach(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start delivering outputs on ``loop`` (the serving loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self._loop.add_reader(self._outbox.getsockopt(zmq.FD), self._on_outputs)
        self.process.watch(self._loop, self._on_core_exit)
        self._on_outputs()  # ZMQ's descriptor is edge-triggered: take what arrived before

    @property
    def started(self) -> bool:
        return self.ready is not None

    @property
    def is_alive(self) -> bool:
        return self.ready is not None and self.error is None and not self._closing and self.process.is_alive()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def aclose(self, timeout: float = 10.0) -> None:
        """Fail what is still open, ask the core to stop, and wait for it (then terminate it)."""
        self._closing = True
        self._detach()
        self._fail_all(APIError(503, "the server is shutting down", code="engine_unavailable"))
        await asyncio.to_thread(self.close, timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self.process is not None and self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._inbox.send(encode(Command("shutdown")), zmq.NOBLOCK)
        self._stop_process(timeout)
        for sock in (self._inbox, self._outbox):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _stop_process(self, timeout: float) -> None:
        p = self.process
        if p is None or p.exitcode is not None:
            return
        p.join(timeout)
        if p.is_alive():
            log.warning("the engine process did not stop within %.0f s; terminating it", timeout)
            p.terminate()
            p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()

    def _detach(self) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._outbox.getsockopt(zmq.FD))
        self.process.unwatch()

    # --- called on the event loop --------------------------------------------------------------
    def submit(self, subrequests: list[SubRequest]) -> RequestStream:
        """Send the sub-requests of one HTTP request; raises ``QueueFull`` when the wait queue is full."""
        if not self.is_alive:
            raise APIError(503, "the engine is not running" + (f": {self.error}" if self.error else ""),
                           code="engine_unavailable")
        if self.num_waiting + len(subrequests) > self.max_queue_len:
            raise QueueFull(self.max_queue_len)
        stream = RequestStream(subrequests)
        reqs = [CoreRequest(s.request_id, s.prompt_token_ids, s.params) for s in subrequests]
        self._send(Command("add", reqs))
        self._sent_adds += len(reqs)
        for s in subrequests:
            self._owners[s.request_id] = _Owner(stream, s)
        return stream

    def abort(self, request_ids: list[str], outcome: str = "abort") -> None:
        """Stop these requests (if still running) and free their pages; safe to call more than once.
        ``outcome`` is what the metrics count them as (``stop`` for a stop string the front end found)."""
        now = time.perf_counter()
        live = []
        for rid in request_ids:
            owner = self._owners.pop(rid, None)
            if owner is not None:
                live.append(rid)
                self.metrics.request_done(outcome)
                if outcome != "abort":
                    self.metrics["e2e"].observe(now - owner.sub.submitted)
        if live and self.is_alive:
            with contextlib.suppress(APIError):
                self._send(Command("abort", live))

    async def call(self, name: str, timeout: float = 30.0):
        """Ask the core for ``memory`` or ``describe``."""
        if not self.is_alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(Command("call", (call_id, name)))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    @property
    def num_waiting(self) -> int:
        return self._load.waiting + max(0, self._sent_adds - self._load.received)

    def load(self) -> dict:
        """The latest counts: running, waiting (incl. not yet received by the core), queue limit, and the
        engine's KV pages in use and requests held."""
        ld = self._load
        return {"running": ld.running, "waiting": self.num_waiting, "max_queue_len": self.max_queue_len,
                "kv_pages_used": ld.pages_used, "kv_pages_total": ld.pages_total, "sequences": ld.sequences}

    def _send(self, cmd: Command) -> None:
        try:
            self._inbox.send(encode(cmd), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            raise APIError(503, f"the engine is not reachable: {e}", code="engine_unavailable") from None

    def _on_outputs(self) -> None:
        sock = self._outbox
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                # ZMQ's descriptor is edge-triggered: it signals again only once EVENTS shows no input
                if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    continue
                return
            except zmq.ZMQError:
                return
            msg = decode(data)
            if isinstance(msg, CoreOutputs):
                self._dispatch(msg)
            elif isinstance(msg, CoreDied):
                self.error = f"the engine core failed: {msg.message}"

    def _dispatch(self, out: CoreOutputs) -> None:
        now = time.perf_counter()
        m = self.metrics
        for d in out.deltas:
            owner = self._owners.get(d.request_id)
            if owner is None:
                continue
            sub = owner.sub
            if d.error is not None:
                del self._owners[d.request_id]
                err = d.error
                if err.status == 400:  # counted as rejected where it is answered
                    api = APIError.from_message(err.message, "prompt")
                else:
                    m.request_done("error")
                    api = APIError(err.status, err.message, code=err.code)
                owner.stream.queue.put_nowait(Delta(sub.index, [], error=api))
                continue
            if d.token_ids:
                if not owner.got_tokens:
                    owner.got_tokens = True
                    m["ttft"].observe(now - sub.submitted)
                    if d.queue_s is not None and d.prefill_s is not None:
                        m["queue"].observe(d.queue_s)
                        m["prefill"].observe(d.prefill_s)
                        m["handoff"].observe(max(0.0, now - sub.submitted - d.queue_s - d.prefill_s))
                    m["prompt_tokens"].inc(len(sub.prompt_token_ids))
                else:
                    m["itl"].observe(now - owner.last)
                owner.last = now
                m["generation_tokens"].inc(len(d.token_ids))
            if d.finish_reason is not None:
                del self._owners[d.request_id]
                m.request_done(d.finish_reason)
                m["e2e"].observe(now - sub.submitted)
            owner.stream.queue.put_nowait(Delta(sub.index, d.token_ids, d.finish_reason, None, d.logprobs,
                                                d.prompt_logprobs, d.num_cached_tokens))
        if out.load is not None:
            self._load = ld = out.load
            m.set_load(ld.running, self.num_waiting, ld.pages_used, ld.pages_total, ld.preemptions,
                       ld.prefix_cache_queries, ld.prefix_cache_hits)
        for call_id, value in out.replies.items():
            fut = self._calls.get(call_id)
            if fut is not None and not fut.done():
                fut.set_result(value)

    def _on_core_exit(self) -> None:
        self._detach()
        self._on_outputs()  # what the core sent before it went
        if self._closing:
            return
        self.process.join(0.5)
        code = self.process.exitcode
        self.error = self.error or f"the engine process exited unexpectedly (exit code {code})"
        log.error("%s; failing %d open requests; /health now answers 503", self.error, len(self._owners))
        self._fail_all(APIError(500, f"{self.error}; the request cannot complete", code="engine_dead"))

    def _fail_all(self, err: APIError) -> None:
        owners, self._owners = self._owners, {}
        for owner in owners.values():
            self.metrics.request_done("error")
            owner.stream.queue.put_nowait(Delta(owner.sub.index, [], error=err))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)

