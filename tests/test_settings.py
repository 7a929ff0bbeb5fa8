"""Resolution of lengths and special tokens, checked against what generate() actually does."""

from __future__ import annotations

import pytest

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.errors import SeqgenError
from seqgen_cli.models import get_backend
from seqgen_cli.search import settings_for
from tests.engine_models import load, text_batch
from tests.equivalence import check_equivalence


@pytest.mark.parametrize("family", ["bart", "gpt2"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_length=30, min_new_tokens=3, max_new_tokens=12),  # min_new_tokens replaces min_length
        dict(max_length=60, max_new_tokens=10),  # max_new_tokens wins
        dict(min_length=58, max_length=60),  # counts the prompt / the decoder start token
    ],
)
def test_length_precedence_matches_generate(tiny_models, family: str, kwargs: dict) -> None:
    loaded = load(tiny_models(family))
    result = check_equivalence(loaded.model, get_backend, text_batch(loaded, 8, seed=2), kwargs)
    assert result.identical == result.total, result.summary()


def test_resolved_lengths(tiny_models) -> None:
    enc = load(tiny_models("bart"))
    dec = load(tiny_models("gpt2"))
    for loaded, prompt_len in ((enc, 1), (dec, None)):
        batch = text_batch(loaded, 4)
        width = batch.input_ids.shape[1] if prompt_len is None else prompt_len
        decoder = get_backend(loaded.model)
        gc = loaded.model.generation_config
        s = settings_for(
            decoder, batch, resolve_generation_config(gc, None, dict(max_new_tokens=7, min_new_tokens=2))
        )
        assert (s.prompt_len, s.max_length, s.min_length, s.max_new_tokens) == (
            width,
            width + 7,
            width + 2,
            7,
        )
        s = settings_for(decoder, batch, resolve_generation_config(gc))  # nothing set: 20 new tokens
        assert s.max_new_tokens == 20
    with pytest.raises(SeqgenError, match="no room"):
        settings_for(
            get_backend(dec.model),
            text_batch(dec, 4),
            resolve_generation_config(dec.model.generation_config, None, dict(max_length=2)),
        )


def test_special_tokens_fall_back_like_generate(tiny_models) -> None:
    loaded = load(tiny_models("t5"))
    gc = loaded.model.generation_config
    config = resolve_generation_config(gc, None, dict(eos_token_id=[gc.eos_token_id, 5], pad_token_id=None))
    config.pad_token_id = None
    s = settings_for(get_backend(loaded.model), text_batch(loaded, 2), config)
    assert s.eos == (gc.eos_token_id, 5)
    assert s.pad == gc.eos_token_id  # pad falls back to the first EOS
    assert s.decoder_start == gc.decoder_start_token_id
