"""What crosses between the HTTP front end and the engine-core process: plain dataclasses, pickled, one
ZMQ message each. Nothing here imports torch, so the front end stays light.

Front end -> core (``Command``): ``add`` (a list of ``CoreRequest``), ``abort`` (request ids), ``call``
(a query answered in ``CoreOutputs.replies``: ``memory``, ``describe``), ``shutdown``.

Core -> front end: first one ``Ready`` (or ``StartFailed``), then one ``CoreOutputs`` per engine step that
produced something (every request's new tokens of that step together), and ``CoreOutputs`` with replies or a
changed load between steps.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.step import TokenLogprobs


@dataclass
class CoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # stop strings stay in the front end: ``stop`` is empty here


@dataclass
class Command:
    kind: str  # add | abort | call | shutdown
    payload: object = None


@dataclass
class CoreError:
    status: int  # the HTTP status the front end answers with
    message: str
    code: str


@dataclass
class CoreDelta:
    """A request's new output since its last delta."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first delta, when asked
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (with the first delta)
    error: CoreError | None = None
    # with the first delta: seconds from the engine taking the request to its first step, and from there to its
    # first token (the core's share of the time to first token; the front end has the rest)
    queue_s: float | None = None
    prefill_s: float | None = None


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_total: int = 0
    preemptions: int = 0
    sequences: int = 0  # requests the engine holds (running, waiting or finishing)
    received: int = 0  # requests received from the front end since start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int = 0  # of them, found


@dataclass
class CoreOutputs:
    deltas: list[CoreDelta] = field(default_factory=list)
    load: EngineLoad | None = None
    replies: dict[int, object] = field(default_factory=dict)  # call id -> result


@dataclass
class Ready:
    """The core's description, sent once the engine is built: what the front end needs to validate,
    tokenize and describe (``describe`` is ``LLMEngine.describe()`` plus the core's pid)."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    config_dir: str | None
    describe: dict
    hardware: dict
    load: EngineLoad


@dataclass
class StartFailed:
    message: str
    user_error: bool  # a configuration problem (one line for the user) rather than a crash


@dataclass
class CoreDied:
    message: str


def encode(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)
