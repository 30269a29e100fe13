"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Both samplers take float32 logits ``[B, V]`` and a ``SamplingBatch`` with one row of parameters per
request. Filters apply in vLLM's order: temperature, then top-k, then top-p, then min-p.

Seeds: a request with a seed draws from its own random stream, so its tokens do not depend on which
other requests share the batch. The sampler owns that state: the torch sampler keeps one generator per
seeded request (by the request's key, until ``release``). FlashInfer's kernels take one Philox seed per launch and derive each
row's stream from the row index, so the FlashInfer sampler launches seeded rows one at a time (with the
request's seed and its token count as the Philox offset) and all unseeded rows together.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.kernel_cache import flashinfer_env  # noqa: F401
from moeserve.kernel_cache.modules import KernelModule, Target
from moeserve.ops.interfaces import SamplingBackend


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the GPU: through pinned memory, asynchronously
    (a plain ``torch.tensor(..., device=cuda)`` synchronises the stream, which stalls an overlapped engine)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_k: torch.Tensor  # [B] int32, 0 = no limit
    top_p: torch.Tensor  # [B] float32, 1 = no limit
    min_p: torch.Tensor  # [B] float32, 0 = no limit
    greedy: list[bool]
    seeds: list[int | None]
    steps: list[int]  # tokens generated so far by each request: the offset of its seeded stream
    keys: list[str]  # each row's request: the key of its seeded random stream

    # per row, known on the host: (uses top-k, uses top-p, uses min-p); None: read them from the tensors,
    # which waits for the GPU
    filters: list[tuple[bool, bool, bool]] | None = None

    def uses(self, rows: list[int]) -> tuple[bool, bool, bool]:
        """Which filters any of ``rows`` uses (a row that does not use one has its no-op value in the tensors)."""
        if self.filters is None:
            i = torch.as_tensor(rows, device=self.top_k.device)
            return (bool((self.top_k[i] > 0).any()), bool((self.top_p[i] < 1).any()),
                    bool((self.min_p[i] > 0).any()))
        picked = [self.filters[r] for r in rows]
        return tuple(any(f[j] for f in picked) for j in range(3))

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)


def _filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p exclude; rows are independent."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab).to(torch.int64)
    remove = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # top-p keeps the smallest prefix whose mass reaches p (always at least one token)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = remove | (mass_before >= top_p[:, None])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    # min-p against the renormalised distribution that survives top-k/top-p
    probs = sorted_logits.softmax(dim=-1)
    remove = remove | (probs < min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class TorchSampler(SamplingBackend):
    """Reference sampler: sort-based filters and ``torch.multinomial``; a seeded request draws from its own
    generator, made from its seed on its first sampled token."""

    name = "torch"

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}

    def _generator(self, key: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.generator
        g = self._seeded.get(key)
        if g is None:
            g = self._seeded[key] = torch.Generator(device=self.device)
            g.manual_seed(seed)
        return g

    def release(self, keys) -> None:
        for k in keys:
            self._seeded.pop(k, None)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
        filtered = _filter_logits(logits / temp[:, None], batch.top_k, batch.top_p, batch.min_p)
        probs = filtered.softmax(dim=-1)
        out = greedy_tokens.clone()
        for i, is_greedy in enumerate(batch.greedy):
            if is_greedy:
                continue
            g = self._generator(batch.keys[i], batch.seeds[i])
            out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        return out


class FlashInferSampler(SamplingBackend):
    """FlashInfer's sorting-free rejection samplers, with per-row top-k/top-p/min-p tensors. A seeded row's
    stream is Philox at (seed, offset 4 x tokens generated), so it keeps no state per request."""

    name = "flashinfer"

    def __init__(self, device: torch.device, seed: int = 0):
        import flashinfer.sampling as fs
        self.fs = fs
        self.device = device
        self._rng = torch.Generator(device="cpu")
        self._rng.manual_seed(seed)

    def _sample_rows(self, probs, top_k, top_p, min_p, seed: int, offset: int, uses) -> torch.Tensor:
        fs = self.fs
        seed_t = to_device([seed], torch.int64, self.device)
        off_t = to_device([offset], torch.int64, self.device)
        use_k, use_p, use_min = uses
        vocab = probs.shape[-1]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).to(torch.int32)
        if use_min:
            if use_k:
                probs = fs.top_k_renorm_probs(probs, k)
            if use_p:
                probs = fs.top_p_renorm_probs(probs, top_p)
            return fs.min_p_sampling_from_probs(probs, min_p, seed=seed_t, offset=off_t)
        if use_k or use_p:
            return fs.top_k_top_p_sampling_from_probs(probs, k, top_p, seed=seed_t, offset=off_t)
        return fs.sampling_from_probs(probs, seed=seed_t, offset=off_t)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
        probs = self.fs.softmax(logits, temperature=temp)
        out = greedy_tokens.clone()
        sampled = [i for i, g in enumerate(batch.greedy) if not g]
        unseeded = [i for i in sampled if batch.seeds[i] is None]
        if unseeded:
            idx = to_device(unseeded, torch.int64, self.device)
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
            out[idx] = self._sample_rows(probs[idx], batch.top_k[idx], batch.top_p[idx], batch.min_p[idx],
                                         seed, 0, batch.uses(unseeded)).to(out.dtype)
        for i in sampled:
            if batch.seeds[i] is not None:
                sl = slice(i, i + 1)
                out[sl] = self._sample_rows(probs[sl], batch.top_k[sl], batch.top_p[sl], batch.min_p[sl],
                                            batch.seeds[i], 4 * batch.steps[i], batch.uses([i])).to(out.dtype)
        return out


def flashinfer_modules(t: Target) -> list[KernelModule]:
    """The FlashInfer module the ``flashinfer`` sampler loads (for ahead-of-time builds)."""
    return [KernelModule("sampling", "sampling", "flashinfer", "sampling (top-k/top-p/min-p)",
                         "flashinfer.jit.sampling:gen_sampling_module", weight=50)]
