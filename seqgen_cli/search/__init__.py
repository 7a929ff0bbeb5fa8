"""seqgen's decoding engine: greedy, beam search and sampling over any :class:`ModelBackend`.

``generate(backend, batch, config)`` takes a ``GenerationConfig`` already merged with the model's own
``generation_config`` (:func:`seqgen_cli.config.resolve_generation_config`); fields left ``None`` take transformers' global
defaults. Special tokens, lengths and the mode are resolved here (:func:`resolve_settings`), because
lengths depend on the batch's prompt width. Unsupported options raise ``SeqgenError``: fall back to
``model.generate()``.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from seqgen_cli.errors import SeqgenError
from seqgen_cli.search.beam import beam_search
from seqgen_cli.search.greedy import greedy_search
from seqgen_cli.search.protocol import Batch, ModelBackend, SearchOutput
from seqgen_cli.search.sampling import sample_search
from seqgen_cli.search.settings import SearchSettings, resolve_mode, resolve_settings, settings_for

__all__ = [
    "Batch",
    "ModelBackend",
    "SearchOutput",
    "SearchSettings",
    "generate",
    "resolve_settings",
    "settings_for",
    "unsupported_reason",
]


def unsupported_reason(config: GenerationConfig) -> str | None:
    """Why the engine cannot run ``config`` (then use ``model.generate()``), or ``None`` when it can."""
    try:
        resolve_mode(config)
    except SeqgenError as err:
        return str(err)
    return None


@torch.inference_mode()
def generate(
    backend: ModelBackend,
    batch: Batch,
    config: GenerationConfig,
    *,
    seed: int | None = None,
    sync_every: int | None = None,
) -> SearchOutput:
    """Generate for every input of ``batch``; token-identical to ``model.generate()`` for greedy and beam search.

    ``seed`` seeds sampling (ignored otherwise). ``sync_every``: steps between host checks for finished
    inputs (default: every step on CPU, every 4 on GPU); it never changes results.
    """
    settings = settings_for(backend, batch, config)
    if settings.mode == "beam":
        return beam_search(backend, batch, settings, sync_every)
    if settings.mode == "sample":
        return sample_search(backend, batch, settings, seed, sync_every)
    return greedy_search(backend, batch, settings, sync_every)
