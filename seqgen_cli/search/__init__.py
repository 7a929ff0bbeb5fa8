"""seqgen's decoding engine: greedy, beam search and sampling over any :class:`ModelBackend`.

``generate(backend, batch, config)`` takes a ``GenerationConfig`` already merged with the model's own
``generation_config`` (:func:`seqgen_cli.config.resolve_generation_config`); fields left ``None`` take transformers' global
defaults. Special tokens, lengths and the mode are resolved here (:func:`resolve_settings`), because
lengths depend on the batch's prompt width. Unsupported options raise ``SeqgenError``: fall back to
``model.generate()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from seqgen_cli.errors import SeqgenError
from seqgen_cli.search.beam import BeamConstants, pick_topk
from seqgen_cli.search.cohort import Cohort, Results, make_search
from seqgen_cli.search.engine import run_batch
from seqgen_cli.search.grammar import BatchGrammar
from seqgen_cli.search.greedy import StopCheck
from seqgen_cli.search.protocol import Batch, ModelBackend, SearchOutput
from seqgen_cli.search.rows import default_sync_every, start_rows
from seqgen_cli.search.sampling import Streams
from seqgen_cli.search.settings import (
    SearchSettings,
    need_stop,
    resolve_mode,
    resolve_settings,
    rows_per_input,
    settings_for,
)

__all__ = [
    "Batch",
    "ModelBackend",
    "SearchOutput",
    "SearchSettings",
    "choose_backend",
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


def choose_backend(
    requested: str, config: GenerationConfig, refused: str | None = None
) -> tuple[str, str | None]:
    """``--backend``: ``fast`` (this engine) where it runs ``config`` and the model (``refused``: why no backend of
    seqgen's runs it, ``models.backend_refusal``), else ``hf`` (``generate()``); and, when ``auto`` falls back to
    ``hf``, why (``None`` otherwise)."""
    if requested == "hf":
        return "hf", None
    if refused is not None and requested == "fast":
        raise SeqgenError(f"--backend fast cannot run this model: {refused} (use --backend hf)")
    reason = refused or unsupported_reason(config)
    if reason is None:
        return "fast", None
    if requested == "fast":
        raise SeqgenError(f"--backend fast cannot run these settings: {reason} (use --backend hf)")
    return "hf", reason


@torch.inference_mode()
def generate(
    backend: ModelBackend,
    batch: Batch,
    config: GenerationConfig,
    *,
    seed: int | None = None,
    indices: Sequence[int] | None = None,
    sync_every: int | None = None,
    stop: StopCheck | None = None,
    grammar: BatchGrammar | None = None,
) -> SearchOutput:
    """Generate for every input of ``batch``; token-identical to ``model.generate()`` for greedy and beam search.

    Sampling draws input ``b`` from a stream seeded by ``seed`` and ``indices[b]`` (its index in the run; default
    ``b``: :class:`~seqgen_cli.search.sampling.Streams`). ``sync_every``: steps between host checks for finished
    inputs (default: every step on CPU, every 4 on GPU); it never changes results. ``stop``: ``config``'s
    ``stop_strings`` as a check over the token history (:func:`~seqgen_cli.prompts.stop_check`: it needs the
    tokenizer), required where the config has them. ``grammar``: every output a match of it, or of its input's
    (structured outputs, ``search/grammar.py``).
    """
    need_stop(config, stop)
    s = settings_for(backend, batch, config)
    device = batch.input_ids.device
    streams = Streams(seed, device, indices)
    consts = BeamConstants.build(s, device)  # before the first step is queued
    rows, logits = start_rows(backend, batch, s, rows_per_input(config), grammar)
    search = make_search(rows, s, consts, pick_topk(logits), streams, stop)
    cohort = Cohort(rows, search, Results(len(rows.inputs)))
    return run_batch(backend, cohort, logits, sync_every or default_sync_every(device))
