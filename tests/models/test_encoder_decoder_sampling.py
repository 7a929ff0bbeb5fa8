"""Sampling through the fast encoder-decoder backends draws exactly what the generic backend draws (same seed)."""

from __future__ import annotations

import pytest

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import fast_backend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.search import Batch, generate
from tests.tiny_models import load_tiny, sample_texts


@pytest.fixture(scope="module")
def loaded(tiny_models):
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            path = tiny_models(family)
            model, tok = load_tiny(path)
            enc = tok(
                sample_texts(5, seed=7), padding=True, truncation=True, max_length=64, return_tensors="pt"
            )
            cache[family] = (model, Batch(enc["input_ids"], enc["attention_mask"]))
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_sampling_fast_equals_generic(loaded, family: str) -> None:
    model, batch = loaded(family)
    kwargs = {
        "do_sample": True,
        "top_k": 20,
        "temperature": 0.9,
        "max_new_tokens": 10,
        "num_return_sequences": 2,
    }
    config = resolve_generation_config(model.generation_config, None, kwargs)
    fast = generate(fast_backend(model), batch, config, seed=11)
    slow = generate(GenericBackend(model), batch, config, seed=11)
    assert fast.sequences == slow.sequences
