"""Resolution of lengths and special tokens, checked against what generate() actually does."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.errors import SeqgenError
from seqgen_cli.models import get_backend
from seqgen_cli.search import settings_for, unsupported_reason
from seqgen_cli.search.settings import new_token_limits, num_return_sequences, rows_per_input
from tests.equivalence import check_equivalence
from tests.tiny_models import load, text_batch


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


@pytest.mark.parametrize(
    "kwargs, rows, outputs",
    [
        (dict(), 1, 1),  # greedy
        (dict(num_beams=4, num_return_sequences=2), 4, 2),  # beams run, the best two return
        (dict(do_sample=True, num_return_sequences=3), 3, 3),  # one row per sample
    ],
)
def test_rows_and_outputs_per_input(kwargs: dict, rows: int, outputs: int) -> None:
    config = resolve_generation_config(GenerationConfig(), None, kwargs)
    assert (rows_per_input(config), num_return_sequences(config)) == (rows, outputs)


def test_new_token_limits_count_the_decoder_prompt() -> None:
    config = resolve_generation_config(GenerationConfig(), None, dict(max_length=10, min_length=3))
    assert new_token_limits(config, True) == (9, 2)  # the decoder start token is one position
    assert new_token_limits(config, True, prompt_len=5) == (9, 2)  # whatever the source width
    assert new_token_limits(config, False, prompt_len=4) == (6, 0)  # never negative
    assert new_token_limits(config, False, prompt_len=12) == (0, 0)
    unset = resolve_generation_config(GenerationConfig(), None, dict(min_new_tokens=2))
    assert new_token_limits(unset, False, prompt_len=30) == (20, 2)  # transformers' default: 20 new tokens


@pytest.mark.parametrize("beams, returned", [(1, 2), (2, 3)])
def test_return_sequences_rule_is_one_rule(beams: int, returned: int) -> None:
    """The merge and the engine reject too many returned sequences with the same message."""
    with pytest.raises(SeqgenError) as merged:
        resolve_generation_config(
            GenerationConfig(), None, dict(num_beams=beams, num_return_sequences=returned)
        )
    config = GenerationConfig(num_beams=beams)
    config.num_return_sequences = returned  # past transformers' own check
    assert unsupported_reason(config) == str(merged.value)
    assert "at least as many beams" in str(merged.value)
    sampled = resolve_generation_config(
        GenerationConfig(), None, dict(do_sample=True, num_return_sequences=3)
    )
    assert unsupported_reason(sampled) is None
