"""Log-probabilities reported to the client, always under the model's raw distribution.

"Raw" means log_softmax of the unmodified logits (fp32): temperature, top-k and top-p shape the
draw but not the reported numbers, as in the OpenAI API. A chosen token that top-k / top-p could
never have produced therefore cannot appear, but a reported value is not the probability the
sampler actually used.
"""

from __future__ import annotations

import torch


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] logits of any float dtype -> [B, V] fp32 log-probabilities."""
    return torch.log_softmax(logits.float(), dim=-1)


def chosen_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[float]:
    """Log-prob of token_ids[i] in row i."""
    return logprobs.gather(1, token_ids.view(-1, 1)).view(-1).tolist()


def top_logprobs(row: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The n most likely (token_id, logprob) of one [V] row, most likely first, ties to the lowest id.

    topk does not promise which of several equal values it returns, so every token tying with the
    n-th value is a candidate; candidates come out of nonzero() in id order and a stable sort keeps it.
    """
    if n <= 0:
        return []
    n = min(n, row.numel())
    threshold = row.topk(n).values[-1]
    candidates = (row >= threshold).nonzero().view(-1)
    order = torch.sort(row[candidates], descending=True, stable=True).indices[:n]
    ids = candidates[order]
    return list(zip(ids.tolist(), row[ids].tolist()))
