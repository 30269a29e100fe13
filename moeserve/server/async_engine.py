"""The background engine loop: one thread owns the ``LLMEngine`` (which is not thread-safe).

HTTP handlers run on the asyncio event loop and never touch the engine. They ``submit`` sub-requests
(one per prompt and per ``n``) and ``abort`` them; both go into a command list the engine thread drains
between steps. After every step the engine thread hands each request's new tokens to that request's
``asyncio.Queue`` with ``loop.call_soon_threadsafe``, one call per step for all requests.

Failures stay local: a request the engine refuses or fails on gets an error on its queue; if a step
raises, the requests running in it are aborted (their pages freed) and failed, the error is logged,
and the loop carries on with the rest.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from moeserve.engine.engine import LLMEngine
from moeserve.engine.requests import RequestError
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.workers import WorkerError
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import APIError

log = logging.getLogger("moeserve.server")


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

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """The outputs of one HTTP request's sub-requests, read on the event loop."""

    def __init__(self, subrequests: list[SubRequest], loop: asyncio.AbstractEventLoop):
        self.subrequests = subrequests
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.unfinished = {s.index for s in subrequests}

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.subrequests]

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
    sent: int = 0


class AsyncEngine:
    """Runs ``engine`` on a dedicated thread and connects it to asyncio handlers."""

    def __init__(self, engine: LLMEngine, max_queue_len: int = 256, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.metrics = metrics or ServerMetrics(engine.source.name)
        self._cond = threading.Condition()
        self._commands: list[tuple[str, object]] = []
        self._queued = 0  # sub-requests submitted but not yet handed to the engine
        self._waiting = 0  # the scheduler's waiting queue, as of the last step
        self._running = 0
        self._stopping = False
        self._owners: dict[str, _Owner] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # set if the loop itself died
        self._publish()

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moeserve-engine", daemon=True)
            self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.shutdown()  # the other ranks of a multi-GPU engine (nothing on one GPU)

    # --- called from the event loop ------------------------------------------------------------
    def submit(self, subrequests: list[SubRequest], loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue the sub-requests of one HTTP request; raises ``QueueFull`` when the wait queue is full."""
        stream = RequestStream(subrequests, loop or asyncio.get_running_loop())
        with self._cond:
            if self._stopping or not self.is_alive:
                raise APIError(503, "the engine is not running", code="engine_unavailable")
            if self._queued + self._waiting + len(subrequests) > self.max_queue_len:
                raise QueueFull(self.max_queue_len)
            self._queued += len(subrequests)
            self._commands.append(("add", stream))
            self._cond.notify()
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (if still running) and free their pages; safe to call more than once."""
        with self._cond:
            self._commands.append(("abort", list(request_ids)))
            self._cond.notify()

    def load(self) -> dict:
        """The latest published counts: running, waiting (incl. not yet handed over), queue limit."""
        with self._cond:
            return {"running": self._running, "waiting": self._waiting + self._queued,
                    "max_queue_len": self.max_queue_len}

    # --- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        device = getattr(self.engine.runner, "device", None)
        if device is not None and device.type == "cuda":
            import torch
            torch.cuda.set_device(device)  # the current device is per thread
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self.engine.has_unfinished()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                    self._apply(commands)
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
        except BaseException as e:  # a bug in the loop itself: report it; /health turns unhealthy
            self.error = e
            log.exception("the engine loop stopped")
        finally:
            self._fail_all(APIError(503, "the server is shutting down", code="engine_unavailable"))

    def _apply(self, commands) -> None:
        """Hand queued requests to the engine and carry out aborts, in arrival order (lock held)."""
        out = []
        for kind, payload in commands:
            if kind == "add":
                self._queued -= len(payload.subrequests)
                for sub in payload.subrequests:
                    err = self._add(payload, sub)
                    if err is not None:
                        out.append((payload, Delta(sub.index, [], error=err)))
            else:
                for rid in payload:
                    owner = self._owners.pop(rid, None)
                    try:
                        aborted = self.engine.abort_request(rid)
                    except Exception:
                        log.exception("aborting %s failed", rid)
                        aborted = False
                    if aborted or owner is not None:
                        self.metrics.request_done("abort")
        self._waiting = len(self.engine.scheduler.waiting)
        self._deliver(out)

    def _add(self, stream: RequestStream, sub: SubRequest) -> APIError | None:
        try:
            self.engine.add_request(sub.prompt_token_ids, sub.params, request_id=sub.request_id)
        except RequestError as e:
            self.metrics.request_rejected(400)
            return APIError.from_message(str(e), "prompt")
        except Exception as e:
            log.exception("the engine failed to add request %s", sub.request_id)
            self.metrics.request_done("error")
            return APIError(500, f"the engine failed to accept the request: {type(e).__name__}: {e}",
                            code="engine_error")
        self._owners[sub.request_id] = _Owner(stream, sub)
        self.metrics["prompt_tokens"].inc(len(sub.prompt_token_ids))
        return None

    def _step(self) -> None:
        engine = self.engine
        try:
            touched = engine.step()
        except WorkerError:
            raise  # a rank of a multi-GPU engine is gone: the engine loop stops and /health turns unhealthy
        except Exception as e:
            log.exception("an engine step failed; failing the requests in it and carrying on")
            victims = [s.request_id for s in list(engine.scheduler.running)]
            if not victims:
                victims = [s.request_id for s in list(engine.scheduler.waiting)]
            err = APIError(500, f"the engine failed while generating: {type(e).__name__}: {e}", code="engine_error")
            self._fail(victims, err)
            return
        out = []
        for seq in touched:
            owner = self._owners.get(seq.request_id)
            if owner is None:
                continue
            try:
                out.append((owner.stream, self._delta(owner, seq)))
            except Exception as e:
                log.exception("emitting output of %s failed", seq.request_id)
                engine.abort_request(seq.request_id)
                self._owners.pop(seq.request_id, None)
                self.metrics.request_done("error")
                out.append((owner.stream, Delta(owner.sub.index, [], error=APIError(500, f"output failed: {e}"))))
        self._deliver(out)

    def _delta(self, owner: _Owner, seq) -> Delta:
        m = self.metrics
        tokens = seq.output_token_ids
        new = tokens[owner.sent:]
        times = seq.timing.token_times
        if new:
            if owner.sent == 0 and times:
                m["ttft"].observe(max(0.0, times[0] - owner.sub.submitted))
            itl = m["itl"]
            for k in range(max(owner.sent, 1), min(len(tokens), len(times))):
                itl.observe(times[k] - times[k - 1])
            m["generation_tokens"].inc(len(new))
        owner.sent = len(tokens)
        finish = seq.finish_reason if seq.is_finished else None
        if finish is not None:
            self._owners.pop(seq.request_id, None)
            m.request_done(finish)
            m["e2e"].observe(time.perf_counter() - owner.sub.submitted)
        return Delta(owner.sub.index, list(new), finish)

    def _fail(self, request_ids: list[str], err: APIError) -> None:
        out = []
        for rid in request_ids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("aborting %s after a failure also failed", rid)
            owner = self._owners.pop(rid, None)
            if owner is not None:
                self.metrics.request_done("error")
                out.append((owner.stream, Delta(owner.sub.index, [], error=err)))
        self._deliver(out)

    def _fail_all(self, err: APIError) -> None:
        with self._cond:
            commands, self._commands = self._commands, []
            self._queued = 0
        out = [(stream, Delta(sub.index, [], error=err)) for kind, stream in commands if kind == "add"
               for sub in stream.subrequests]
        self._deliver(out)
        self._fail(list(self._owners), err)

    def _deliver(self, items: list[tuple[RequestStream, Delta]]) -> None:
        by_loop = defaultdict(list)
        for stream, delta in items:
            by_loop[stream.loop].append((stream.queue, delta))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _publish(self) -> None:
        engine = self.engine
        sched = engine.scheduler
        running, waiting = len(sched.running), len(sched.waiting)
        with self._cond:
            self._running, self._waiting = running, waiting
            queued = self._queued
        self.metrics.set_load(running, waiting + queued, engine.pool.num_used, engine.pool.capacity,
                              sched.num_preemptions)


def _put_all(batch) -> None:
    for queue, delta in batch:
        queue.put_nowait(delta)
