"""Batching: inputs grouped by length under an input count and a padded-token budget.

A batch holds at most ``batch_size`` inputs and at most ``batch_tokens`` padded source tokens, counted
once per row the model runs (``rows`` = beams, or returned sequences when more). An input longer than
the budget on its own still forms a batch of one.
"""

from __future__ import annotations


def plan_batches(
    lengths: list[int], batch_size: int, batch_tokens: int | None, rows: int = 1, sort: bool = True
) -> list[list[int]]:
    """Positions grouped into batches: shortest first when ``sort``, else in the given order."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__) if sort else range(len(lengths))
    batches: list[list[int]] = []
    batch: list[int] = []
    width = 0
    for i in order:
        wider = max(width, lengths[i])
        over = batch_tokens is not None and wider * (len(batch) + 1) * rows > batch_tokens
        if batch and (len(batch) >= batch_size or over):
            batches.append(batch)
            batch, wider = [], lengths[i]
        batch.append(i)
        width = wider
    if batch:
        batches.append(batch)
    return batches
