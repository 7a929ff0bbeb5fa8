"""Sampling warpers (temperature, top-k, top-p), same arithmetic as transformers' ``*LogitsWarper``."""

from __future__ import annotations

import torch

from seqgen_cli.search.settings import SearchSettings

NEG_INF = float("-inf")


def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` best entries per row (ties with the k-th kept too). ``scores``: [N, V]."""
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1:]  # [N, 1]
    return scores.masked_fill(scores < kth, NEG_INF)


def top_p_filter(scores: torch.Tensor, p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Keep the smallest set of best tokens whose probability mass reaches ``p``. ``scores``: [N, V]."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[..., -min_tokens_to_keep:] = False
    remove = remove.scatter(1, sorted_indices, remove)
    return scores.masked_fill(remove, NEG_INF)


class Warpers:
    """Temperature, then top-k, then top-p (transformers' order)."""

    def __init__(self, settings: SearchSettings) -> None:
        self.temperature = settings.temperature
        self.top_k = settings.top_k
        self.top_p = settings.top_p

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k:
            scores = top_k_filter(scores, self.top_k)
        if self.top_p < 1.0:
            scores = top_p_filter(scores, self.top_p)
        return scores
