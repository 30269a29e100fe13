"""The engine: requests in, one scheduled step at a time, tokens out.

``add_request`` validates a request completely before it touches any state, so a bad request is refused
with a message naming the problem and every other request carries on.

With ``async_scheduling`` (the default) a call to ``step`` schedules and launches step k+1, then waits
for the tokens of step k and hands them out: the host's work for a step overlaps the GPU's work for the
one before, and the GPU does not idle between steps. The tokens a request receives are the same as
without it; only the wall time differs.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from moeserve.config import EngineConfig
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, logprobs_dicts
from moeserve.engine.requests import RequestError, RequestLimits, validate_request
from moeserve.engine.runner import ModelRunner
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.plan import resolve_plan

log = logging.getLogger("moeserve")


def describe_phases(phases: dict[str, float], weights_bytes: int) -> str:
    """One line of the start's parts, the weights with their read rate."""
    parts = []
    for name, sec in phases.items():
        text = f"{name.replace('_', ' ')} {sec:.2f} s"
        if name == "weights" and sec > 0:
            text += f" ({weights_bytes / 1e9:.1f} GB, {weights_bytes / 1e9 / sec:.1f} GB/s)"
        parts.append(text)
    return ", ".join(parts)


class LLMEngine:
    def __init__(self, config: EngineConfig, capture_graphs: bool = True):
        t0 = time.perf_counter()
        self.config = config
        self.plan = resolve_plan(config)
        self.source, self.hardware = self.plan.source, self.plan.hardware
        t_plan = time.perf_counter() - t0
        if config.world_size > 1:  # one process per GPU; rank 0 here
            from moeserve.engine.workers import ParallelExecutor
            self.runner = ParallelExecutor(self.plan)
        else:
            self.runner = ModelRunner(self.plan)
        self.arch = self.plan.arch
        self.max_model_len = self.plan.max_model_len
        self.pool = KVCacheManager(self.runner.kv.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens)
        t_tok = time.perf_counter()
        self.tokenizer = load_tokenizer(self.source.config_dir)
        t_tok = time.perf_counter() - t_tok
        eos = set(self.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.limits = RequestLimits(self.arch.vocab_size, self.max_model_len, self.tokenizer is not None)
        self.sequences: dict[str, Sequence] = {}
        self.async_scheduling = config.async_scheduling
        self._inflight = None  # the launched step whose tokens have not been received
        self._ids = itertools.count()
        self._step_ids = itertools.count()
        self._finished_ids: list[str] = []  # requests gone since the last step, for the runner to forget
        self.stats = {"steps": 0, "mixed_steps": 0, "prefill_chunks": 0, "decode_tokens": 0, "prefill_tokens": 0}
        self.last_step_seconds = (0.0, 0.0)  # the last step's host time: (schedule and launch, wait and hand out)
        if capture_graphs:
            self.runner.capture_graphs(config.graph_batch_sizes())
        self.runner.warm_up()
        self.ready_seconds = time.perf_counter() - t0
        self.startup_phases = {"plan": round(t_plan, 3), **self.runner.startup_phases, "tokenizer": round(t_tok, 3)}
        pdl = self.plan.pdl_max_tokens
        r = self.runner
        log.info("engine ready in %.1f s: %s on %s, %s, backends %s, fused kernels %s, %s, %d KV pages of %d tokens",
                 self.ready_seconds, self.source.name, r.device, str(r.dtype).removeprefix("torch."), r.backend_names,
                 r.fusions or "none", f"PDL for steps of up to {pdl} tokens" if pdl else "no PDL", self.pool.capacity,
                 self.pool.page_size)
        log.info("start-up: %s", describe_phases(self.startup_phases, self.runner.weights_bytes))
        if self.runner.device.type == "cuda":
            from moeserve.engine.kernels import kernels_summary
            log.info("%s", kernels_summary())

    # --- requests ------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("prompt: this model has no tokenizer; send token ids (prompt_token_ids) instead of text")
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_token_ids, params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.limits)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> Sequence:
        params = params or SamplingParams()
        self.validate(prompt_token_ids, params)
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.sequences:
            raise RequestError(f"request_id: {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError(f"cache_salt: must be a string, got {type(cache_salt).__name__}")
        seq = Sequence(request_id, list(prompt_token_ids), params, self.eos_token_ids, self.max_model_len, cache_salt)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        seq = self.sequences.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.abort(seq)
        self._finished_ids.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # --- steps ---------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Launch the next step and hand out the tokens of the one before it (of this one, without
        ``async_scheduling``); returns the sequences that got a token or finished."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        prev = self._inflight
        if out.items:
            step = out.step_input(next(self._step_ids), self._finished_ids)
            self._finished_ids = []
            launched = self.runner.launch(step)
            self.scheduler.advance(out)
            self._count(out)
            self._inflight = (out, launched)
        else:
            self._inflight = None
        if not self.async_scheduling:  # nothing was in flight: receive this step's tokens now
            prev, self._inflight = self._inflight, None
        t1 = time.perf_counter()
        touched = self._receive(*prev) if prev is not None else []
        self.last_step_seconds = (t1 - t0, time.perf_counter() - t1)
        return touched

    def _receive(self, out, launched) -> list[Sequence]:
        result = self.runner.wait(launched)
        if result.prompt_logprobs:
            for item in out.items:
                scored = result.prompt_logprobs.get(item.seq.request_id)
                if scored is not None:
                    item.seq.add_prompt_logprobs(item.start, scored)
        touched = self.scheduler.receive(out, result.sampled)
        if result.logprobs:
            for seq in touched:
                if seq.logprobs is not None and seq.request_id in result.logprobs:
                    seq.logprobs.append(result.logprobs[seq.request_id])
        for seq in touched:
            if seq.params.stop and not seq.is_finished:
                self._check_stop_strings(seq)
        for seq in touched:
            if seq.is_finished:
                self.sequences.pop(seq.request_id, None)
                self._finished_ids.append(seq.request_id)
        return touched

    def _count(self, out) -> None:
        st = self.stats
        st["steps"] += 1
        decodes = [it for it in out.items if it.is_decode]
        st["decode_tokens"] += len(decodes)
        st["prefill_tokens"] += out.num_tokens - len(decodes)
        st["prefill_chunks"] += sum(1 for it in out.items if not it.samples)
        if decodes and len(decodes) < len(out.items):
            st["mixed_steps"] += 1

    def _check_stop_strings(self, seq: Sequence) -> None:
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if any(s in text for s in seq.params.stop):
            seq.finish_reason = "stop"
            self.scheduler.finish(seq)

    def decode_text(self, seq: Sequence) -> str:
        if self.tokenizer is None or not seq.params.detokenize:
            return ""
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        for s in seq.params.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text

    def output(self, seq: Sequence, prompt: str | None = None, index: int = 0) -> RequestOutput:
        t = seq.timing
        return RequestOutput(
            request_id=seq.request_id, prompt=prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(index, list(seq.output_token_ids), self.decode_text(seq), seq.finish_reason,
                                      logprobs_dicts(seq.logprobs, self.tokenizer))],
            finished=seq.is_finished,
            prompt_logprobs=logprobs_dicts(seq.prompt_logprobs, self.tokenizer),
            metrics=RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.finished, list(t.token_times),
                                   seq.num_preemptions),
            num_cached_tokens=seq.num_cached_tokens,
        )

    def shutdown(self) -> None:
        """Stop the other ranks of a multi-GPU engine (nothing to do on one GPU)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # --- introspection -------------------------------------------------------------------------
    def memory_report(self) -> dict:
        r = self.runner
        d = {"weights_bytes": r.weights_bytes, "kv_cache_bytes": r.kv.nbytes,
             "activation_peak_bytes": r.activation_peak_bytes, "graph_bytes": r.graph_memory_bytes}
        if r.device.type == "cuda":
            d["max_allocated_bytes"] = torch.cuda.max_memory_allocated(r.device)
            d["max_reserved_bytes"] = torch.cuda.max_memory_reserved(r.device)
        return d

    def describe(self) -> dict:
        r = self.runner
        return {
            "model": self.source.name, "model_type": self.arch.model_type, "device": str(r.device),
            "dtype": str(r.dtype).removeprefix("torch."), "load_format": r.load_format,
            "backends": dict(r.backend_names), "fusions": r.fusions, "kv_pages": self.pool.capacity,
            "page_size": self.pool.page_size,
            "max_model_len": self.max_model_len, "cuda_graph_batch_sizes": r.graphs.sizes if r.graphs else [],
            "prefill_graph_token_sizes": r.piecewise.sizes if r.piecewise else [],
            "init_seconds": r.init_seconds, "load_seconds": r.load_seconds,
            "graph_capture_seconds": r.graph_capture_seconds, "ready_seconds": self.ready_seconds,
            "startup_phases": dict(self.startup_phases), "weights_bytes": r.weights_bytes,
            "enable_prefix_caching": self.pool.enable_caching,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "enable_expert_parallel": self.config.enable_expert_parallel,
            "pdl_max_tokens": self.plan.pdl_max_tokens,
        }

    def prefix_cache_stats(self) -> dict:
        """Prompt tokens looked up in the prefix cache, and found, since the engine started."""
        p = self.pool
        return {"queries": p.queries, "hits": p.hits, "hit_rate": p.hits / p.queries if p.queries else 0.0}
