"""Log-probabilities of tokens, as vLLM reports them by default ("raw" logprobs): the float32 log-softmax of
the model's logits before temperature, top-k, top-p or min-p touch them.

For each scored position: the log-probability of one token (the sampled one, or the next prompt token),
its rank among all tokens (1 = the most likely; ties count, as vLLM counts them) and the N most likely
tokens. ``score`` queues the work on the device; ``LogprobsOnHost.rows`` turns the copied results into
``TokenLogprobs`` (plain data) once they are on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.engine.step import TokenLogprobs

PROMPT_ROWS_PER_PASS = 256  # prompt positions scored at once (bounds the [rows, vocab] float32 temporaries)


@dataclass
class LogprobTensors:
    token_logprob: torch.Tensor  # [R] float32
    rank: torch.Tensor  # [R] int64
    top_logprob: torch.Tensor  # [R, K] float32
    top_ids: torch.Tensor  # [R, K] int64

    def to_host(self, pin: bool) -> "LogprobTensors":
        """Start copying to the host (asynchronous from pinned memory on a GPU)."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            if not pin:
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host
        return LogprobTensors(copy(self.token_logprob), copy(self.rank), copy(self.top_logprob), copy(self.top_ids))

    def rows(self, targets: list[int], num_top: list[int]) -> list[TokenLogprobs]:
        """One ``TokenLogprobs`` per row (the row's scored token id and ``num_top[i]`` alternatives); read
        once the copy has finished."""
        lp, rank = self.token_logprob.tolist(), self.rank.tolist()
        top_lp, top_ids = self.top_logprob.tolist(), self.top_ids.tolist()
        return [TokenLogprobs(targets[i], lp[i], rank[i], list(zip(top_ids[i][:k], top_lp[i][:k])))
                for i, k in enumerate(num_top)]


def score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> LogprobTensors:
    """Log-probabilities of ``targets`` under ``logits`` ``[R, V]`` and the top ``k`` of each row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    target_lp = logp.gather(1, targets.view(-1, 1).long()).view(-1)
    rank = (logp >= target_lp[:, None]).sum(dim=-1)
    if k > 0:
        top_lp, top_ids = logp.topk(k, dim=-1)
    else:
        top_lp = logp.new_empty((logp.shape[0], 0))
        top_ids = torch.empty((logp.shape[0], 0), dtype=torch.int64, device=logp.device)
    return LogprobTensors(target_lp, rank, top_lp, top_ids)


def cat(parts: list[LogprobTensors]) -> LogprobTensors:
    if len(parts) == 1:
        return parts[0]
    k = max(p.top_ids.shape[1] for p in parts)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return t if t.shape[1] == k else torch.nn.functional.pad(t, (0, k - t.shape[1]), value=value)
    return LogprobTensors(torch.cat([p.token_logprob for p in parts]), torch.cat([p.rank for p in parts]),
                          torch.cat([pad(p.top_logprob, float("-inf")) for p in parts]),
                          torch.cat([pad(p.top_ids, 0) for p in parts]))


@dataclass
class SampledLogprobs:
    """Scores of a step's sampled tokens, for the sampling requests that asked."""

    tensors: LogprobTensors
    rows: list[tuple[str, int, int]]  # (request id, row of the step's sampled tokens, top-N), in tensor order

    def resolve(self, sampled_tokens: list[int]) -> dict[str, TokenLogprobs]:
        out = self.tensors.rows([sampled_tokens[row] for _, row, _ in self.rows], [k for _, _, k in self.rows])
        return {rid: lp for (rid, _, _), lp in zip(self.rows, out)}


@dataclass
class PromptLogprobs:
    """Scores of the prompt tokens of a step's prefill chunks, for the requests that asked."""

    tensors: LogprobTensors
    targets: list[int]  # the scored prompt token of each row
    spans: list[tuple[str, int, int, int]]  # (request id, first row, number of rows, top-N)

    def resolve(self) -> dict[str, list[TokenLogprobs]]:
        num_top = [0] * len(self.targets)
        for _, first, n, k in self.spans:
            num_top[first:first + n] = [k] * n
        out = self.tensors.rows(self.targets, num_top)
        return {rid: out[first:first + n] for rid, first, n, _ in self.spans}
