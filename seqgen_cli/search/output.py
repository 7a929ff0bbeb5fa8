"""What a search call returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SearchOutput:
    """Per input, ``num_return_sequences`` generated token lists, best first.

    Tokens are the generated ones only (no decoder start token, no prompt, no padding); a sequence ends with
    EOS when EOS was generated. ``scores``: beam search's ``sequences_scores`` (length-penalised sum of
    processed log-probs, as transformers reports them); ``None`` for greedy and sampling.
    """

    sequences: list[list[list[int]]]
    scores: list[list[float]] | None = None
