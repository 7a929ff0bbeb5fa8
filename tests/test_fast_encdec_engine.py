"""The engine's searches through the fast encoder-decoder backends give ``model.generate()``'s tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from seqgen_cli.models import FAST_DECODERS
from seqgen_cli.models.generic import GenericDecoder
from seqgen_cli.search import Batch, generate, merge_generation_config
from tests.tiny_models import sample_texts

ENCDEC = ["bart", "mbart", "marian", "pegasus", "t5", "flan-t5"]
SETTINGS = {
    "greedy": {"num_beams": 1, "do_sample": False, "max_new_tokens": 12},
    "greedy-norepeat": {"num_beams": 1, "do_sample": False, "max_new_tokens": 12, "no_repeat_ngram_size": 2},
    "beam4": {"num_beams": 4, "do_sample": False, "max_new_tokens": 12, "length_penalty": 1.3},
    "beam3-norepeat-early": {
        "num_beams": 3,
        "do_sample": False,
        "max_new_tokens": 10,
        "min_new_tokens": 4,
        "no_repeat_ngram_size": 3,
        "early_stopping": True,
    },
}


def _hf_tokens(row: torch.Tensor, eos: int | list[int] | None) -> list[int]:
    """Generated tokens of one ``generate()`` row: drop the decoder start, cut after the first EOS."""
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    out = []
    for tok in row[1:].tolist():
        out.append(tok)
        if tok in eos_ids:
            break
    return out


@pytest.fixture(scope="module")
def loaded(tiny_models):
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            path = tiny_models(family)
            model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
            tok = AutoTokenizer.from_pretrained(path)
            enc = tok(
                sample_texts(5, seed=7), padding=True, truncation=True, max_length=64, return_tensors="pt"
            )
            cache[family] = (model, Batch(enc["input_ids"], enc["attention_mask"]))
        return cache[family]

    return get


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", ENCDEC)
def test_engine_through_fast_decoder_matches_generate(loaded, family: str, setting: str) -> None:
    model, batch = loaded(family)
    kwargs = SETTINGS[setting]
    fast = FAST_DECODERS[model.config.model_type](model)
    config = merge_generation_config(model.generation_config, **kwargs)
    out = generate(fast, batch, config)
    with torch.no_grad():
        ref = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs)
    eos = config.eos_token_id
    expected = [_hf_tokens(row, eos) for row in ref]
    got = [seqs[0] for seqs in out.sequences]
    assert got == expected


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
    config = merge_generation_config(model.generation_config, **kwargs)
    fast = generate(FAST_DECODERS[model.config.model_type](model), batch, config, seed=11)
    slow = generate(GenericDecoder(model), batch, config, seed=11)
    assert fast.sequences == slow.sequences
