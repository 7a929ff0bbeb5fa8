"""Multinomial sampling (``do_sample=True``, ``num_beams=1``), ``num_return_sequences`` rows per input.

Randomness comes from a ``torch.Generator`` seeded with ``seed``: the same seed, batch and settings give the
same output. (transformers draws from the global RNG, so outputs are not comparable token for token; the
processed distribution is the same.) Without a seed the global RNG is used.
"""

from __future__ import annotations

import torch

from seqgen_cli.search.greedy import token_search
from seqgen_cli.search.output import SearchOutput
from seqgen_cli.search.protocol import Batch, ModelBackend
from seqgen_cli.search.settings import SearchSettings


def sample_search(
    backend: ModelBackend,
    batch: Batch,
    settings: SearchSettings,
    seed: int | None = None,
    sync_every: int | None = None,
) -> SearchOutput:
    device = batch.input_ids.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)

    def pick(scores: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N]
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)

    return token_search(backend, batch, settings, pick, settings.num_return_sequences, sync_every)
