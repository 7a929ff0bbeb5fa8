"""Multinomial sampling (``do_sample=True``, ``num_beams=1``), ``num_return_sequences`` rows per input.

Randomness comes from a ``torch.Generator`` seeded with ``seed``: the same seed, batch and settings give the
same output. (transformers draws from the global RNG, so outputs are not comparable token for token; the
processed distribution is the same.) Without a seed the global RNG is used.

Draws are :func:`draw`'s exponential race (the same draws as ``torch.multinomial``), not ``torch.multinomial``
itself, which synchronises with the host on CUDA inside ATen: the decode loop must not
(``tests/test_host_sync.py`` forbids the op).
"""

from __future__ import annotations

import torch

from seqgen_cli.search.greedy import token_search
from seqgen_cli.search.protocol import Batch, ModelBackend, SearchOutput
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
        return draw(torch.nn.functional.softmax(scores, dim=-1), generator)

    return token_search(backend, batch, settings, pick, settings.num_return_sequences, sync_every)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [N, V] (rows sum to 1) -> [N] int64, distributed as ``torch.multinomial``
    draws it, without a host sync: ``argmax(probs / E)`` with ``E`` i.i.d. Exp(1) (token ``i`` wins the race of
    exponential clocks ``E_i / p_i`` with probability ``p_i``). This is ATen's own single-sample path, less its
    validity check (the ``.item()`` that syncs), so the draws equal ``torch.multinomial(probs, 1, generator=g)``
    for the same generator state. ``E`` is kept above 0 so that a token of probability 0 is never drawn
    (``0 / 0`` would be NaN, which argmax picks)."""
    clocks = torch.empty_like(probs).exponential_(generator=generator)  # [N, V]
    return (probs / clocks.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)
