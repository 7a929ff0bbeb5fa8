"""Tiny checkpoints for the engine tests: the shared fixture checkpoints, loaded once, EOS-tuned.

The fixture models (``tests/tiny_models.py``) rarely emit EOS, which would leave early stopping, finished
hypotheses and dropping finished inputs untested; :func:`tune_eos` biases the EOS logit in memory so that
outputs end at varied lengths. Inputs are real text (``sample_texts``) through each family's tokenizer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import (
    PreTrainedModel,
)

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.search import Batch, generate
from tests.equivalence import tune_eos
from tests.helpers import load_tiny
from tests.tiny_models import FAMILIES, sample_texts

__all__ = ["FAMILIES", "Loaded", "load", "text_batch"]


@dataclass(frozen=True)
class Loaded:
    model: PreTrainedModel
    tokenizer: object


@functools.cache
def load(path: Path) -> Loaded:
    """Load a fixture checkpoint in float32 and tune its EOS bias (cached per path)."""
    loaded = Loaded(*load_tiny(path))
    tune_eos(loaded.model, text_batch(loaded, 16, seed=99))
    return loaded


def text_batch(loaded: Loaded, n: int, seed: int = 0, max_tokens: int = 40) -> Batch:
    """``n`` sample texts of varied length, padded as generate() expects (right: enc-dec, left: decoder-only)."""
    tok = loaded.tokenizer
    tok.padding_side = "right" if loaded.model.config.is_encoder_decoder else "left"
    enc = tok(
        sample_texts(n, seed=seed), return_tensors="pt", padding=True, truncation=True, max_length=max_tokens
    )
    return Batch(enc["input_ids"], enc["attention_mask"])


def beam_config(loaded: Loaded, **kwargs: Any) -> Any:
    """Beam 3, 10 new tokens (and ``kwargs``) over the checkpoint's generation config."""
    return resolve_generation_config(
        loaded.model.generation_config, None, dict(num_beams=3, max_new_tokens=10) | kwargs
    )


def run_beam(backend: Any, loaded: Loaded, batch: Batch | None = None, **kwargs: Any) -> list:
    """The sequences :func:`beam_config` gives over ``backend`` for ``batch`` (default: 5 texts)."""
    config = beam_config(loaded, **kwargs)
    return generate(backend, batch or text_batch(loaded, 5, seed=5), config).sequences
