"""Engines stepped by hand, for comparing a fast path with its reference.

``lockstep``: two engines stepped together on one schedule.

Both engines get the same requests; each step both schedule (the schedules must be identical), compute the
logits of the rows that sample, and are fed the same greedy tokens: the reference's (``follow="ref"``,
teacher forcing by the reference) or the fast engine's (``follow="fast"``). Every sampled row is compared.

``run_recording_logits``: one engine driven step by step, keeping every sampled row's logits.

``random_prompts``: the prompts such comparisons feed, drawn from a seeded generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.engine.sampling_params import SamplingParams


def random_prompts(vocab: int, seed: int, lens) -> list[list[int]]:
    """One prompt of each length in ``lens``, its token ids drawn uniformly below ``vocab`` from a generator seeded
    with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@dataclass
class Lockstep:
    cos: torch.Tensor  # per sampled row: cosine similarity of the two engines' logits
    agreement: float  # fraction of sampled rows whose argmax agrees
    graph_steps: int  # decode steps the fast engine ran through a captured CUDA graph
    piecewise_steps: int = 0  # other steps the fast engine ran through its piecewise CUDA graphs

    @property
    def worst(self) -> float:
        return float(self.cos.min())

    @property
    def median(self) -> float:
        return float(self.cos.median())


def lockstep(fast, ref, prompts: list[list[int]], max_tokens: int, follow: str = "ref") -> Lockstep:
    assert follow in ("ref", "fast")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        fast.add_request(p, params)
        ref.add_request(p, params)
    cos, agree, graph_steps = [], [], 0
    pieces = fast.runner.piecewise
    replays = pieces.replays if pieces is not None else 0
    while ref.has_unfinished():
        a, b = fast.scheduler.schedule(), ref.scheduler.schedule()
        assert [(i.seq.request_id, i.start, i.num_tokens) for i in a.items] == \
               [(i.seq.request_id, i.start, i.num_tokens) for i in b.items]
        graphs = fast.runner.graphs
        if graphs is not None and a.is_decode and len(a.items) <= graphs.max_batch_size:
            graph_steps += 1
        la = fast.runner.forward_logits(a.step_input(0))
        lb = ref.runner.forward_logits(b.step_input(0))
        cos += torch.nn.functional.cosine_similarity(la, lb, dim=-1).tolist()
        agree += (la.argmax(-1) == lb.argmax(-1)).tolist()
        it = iter((la if follow == "fast" else lb).argmax(-1).tolist())
        sampled = [next(it) if x.samples else None for x in a.items]
        fast.scheduler.update(a, sampled)
        ref.scheduler.update(b, sampled)
    assert not fast.has_unfinished()
    assert fast.pool.num_free == fast.pool.capacity and ref.pool.num_free == ref.pool.capacity
    piecewise_steps = pieces.replays - replays if pieces is not None else 0
    return Lockstep(torch.tensor(cos), sum(agree) / len(agree), graph_steps, piecewise_steps)


def run_recording_logits(llm, prompt_ids, params):
    """Drive the engine step by step, keeping every sampled row's logits by (request, position)."""
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompt_ids]
    rows = {}
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        logits = engine.runner.forward_logits(out.step_input(0))
        sampling = [it for it in out.items if it.samples]
        for it, row in zip(sampling, logits):
            rows[(it.seq.request_id, it.start + it.num_tokens - 1)] = row.clone()
        tokens = iter(logits.argmax(-1).tolist())
        sampled = [next(tokens) if it.samples else None for it in out.items]
        engine._count(out)
        engine.scheduler.update(out, sampled)
    return seqs, rows
