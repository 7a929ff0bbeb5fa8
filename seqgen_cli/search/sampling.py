"""Multinomial sampling (``do_sample=True``, ``num_beams=1``), ``num_return_sequences`` rows per input.

Randomness comes from one ``torch.Generator`` per input (:class:`Streams`), seeded by ``--seed`` and the input's
index in the run: the same seed and settings give the same output for an input, whatever its batch, its
neighbours or how the run was cut (refill, shards, resume, an out-of-memory split). (transformers draws from the
global RNG, so outputs are not comparable token for token; the processed distribution is the same.) Without a
seed torch's global RNG is used.

Draws are :func:`draw`'s exponential race (the same draws as ``torch.multinomial``), not ``torch.multinomial``
itself, which synchronises with the host on CUDA inside ATen: the decode loop must not
(``tests/search/test_host_sync.py`` forbids the op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from seqgen_cli.search.rows import Rows


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [N, V] (rows sum to 1) -> [N] int64, distributed as ``torch.multinomial``
    draws it, without a host sync: ``argmax(probs / E)`` with ``E`` i.i.d. Exp(1) (token ``i`` wins the race of
    exponential clocks ``E_i / p_i`` with probability ``p_i``). This is ATen's own single-sample path, less its
    validity check (the ``.item()`` that syncs), so the draws equal ``torch.multinomial(probs, 1, generator=g)``
    for the same generator state. ``E`` is kept above 0 so that a token of probability 0 is never drawn
    (``0 / 0`` would be NaN, which argmax picks)."""
    clocks = torch.empty_like(probs).exponential_(generator=generator)  # [N, V]
    return (probs / clocks.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def input_seed(seed: int, index: int) -> int:
    """The seed of input ``index``'s random stream: a function of ``--seed`` and the index only."""
    return (seed * 1_000_003 + index) % (2**63)


class Streams:
    """Sampling's random streams: with a ``seed``, one generator per input, made on first use from the seed and
    the input's index in the run (``indices[b]`` for batch position ``b``; default ``b``); without, torch's global
    generator for every row."""

    def __init__(self, seed: int | None, device: torch.device, indices: Sequence[int] | None = None) -> None:
        self.seed, self.device, self.indices = seed, device, indices
        self._generators: dict[int, torch.Generator] = {}

    def generator(self, b: int) -> torch.Generator | None:
        """Batch position ``b``'s generator (None: the global one)."""
        if self.seed is None:
            return None
        if b not in self._generators:
            index = b if self.indices is None else self.indices[b]
            self._generators[b] = torch.Generator(device=self.device).manual_seed(
                input_seed(self.seed, index)
            )
        return self._generators[b]

    def picker(self, rows: Rows) -> Callable[[torch.Tensor], torch.Tensor]:
        """Processed scores [N, V] -> one draw per row [N], each input's ``R`` rows from its own stream."""
        r = rows.rows_per_input

        def pick(scores: torch.Tensor) -> torch.Tensor:
            probs = torch.nn.functional.softmax(scores, dim=-1)  # [N, V]
            if self.seed is None:
                return draw(probs)
            return torch.cat(
                [draw(probs[j * r : (j + 1) * r], self.generator(b)) for j, b in enumerate(rows.inputs)]
            )

        return pick
