"""seqgen's engine vs transformers generate(), token for token: every family x setting x backend
(the generic backend and each family's fast decoder)."""

from __future__ import annotations

import pytest
import torch

from seqgen_cli.models import get_backend
from seqgen_cli.models.generic import GenericBackend
from tests.equivalence import SETTINGS, check_equivalence
from tests.tiny_models import FAMILIES, load, text_batch

BATCH = 32


def generic(model):
    return get_backend(model, generic=True)


BACKENDS = {"generic": generic, "fast": get_backend}


# The inner loop (``pytest -m "not slow"``) checks every family's fast decoder on greedy and one beam setting;
# the rest of the matrix (every setting, the generic backend) is marked slow.
QUICK_SETTINGS = ("greedy", "beam4_ngram3_lp2_minmax_es")


def _matrix() -> list:
    return [
        pytest.param(
            family,
            setting,
            backend,
            marks=() if backend == "fast" and setting in QUICK_SETTINGS else pytest.mark.slow,
            id=f"{family}-{setting}-{backend}",
        )
        for family in FAMILIES
        for setting in SETTINGS
        for backend in BACKENDS
    ]


@pytest.mark.parametrize(("family", "setting", "backend"), _matrix())
def test_equivalence(tiny_models, family: str, setting: str, backend: str) -> None:
    loaded = load(tiny_models(family))
    result = check_equivalence(loaded.model, BACKENDS[backend], text_batch(loaded, BATCH), SETTINGS[setting])
    print(f"{family} {setting} {backend}: {result.summary()}")
    for line in result.near_ties:
        print("  near-tie:", line)
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    if SETTINGS[setting].get("num_beams", 1) == 1:
        assert result.identical == result.total


class NoisyBackend(GenericBackend):
    """Logits perturbed by 1e-2: the harness must notice."""

    def step(self, state, tokens):
        logits = super().step(state, tokens)
        return logits + 1e-2 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(len(tokens)))


@pytest.mark.parametrize("setting", ["greedy", "beam5_es_false"])
def test_harness_detects_differences(tiny_models, setting: str) -> None:
    loaded = load(tiny_models("bart"))
    result = check_equivalence(loaded.model, NoisyBackend, text_batch(loaded, BATCH), SETTINGS[setting])
    assert result.mismatches


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_equivalence_multiple_eos_tokens(tiny_models, family: str) -> None:
    """A list of EOS ids (llama-3 style): 1 + n_eos candidates per beam, any of them ends a hypothesis."""
    loaded = load(tiny_models(family))
    batch = text_batch(loaded, BATCH, seed=4)
    eos = loaded.model.generation_config.eos_token_id
    # The second "EOS" is a token the model actually produces, so both ids end hypotheses.
    frequent = int(torch.mode(batch.input_ids[batch.attention_mask == 1]).values)
    for kwargs in (
        dict(max_new_tokens=20, eos_token_id=[eos, frequent]),
        dict(num_beams=3, max_new_tokens=20, eos_token_id=[eos, frequent], num_return_sequences=2),
    ):
        result = check_equivalence(loaded.model, generic, batch, kwargs)
        print(f"{family} multi-eos {kwargs}: {result.summary()}")
        assert not result.mismatches, "\n".join(result.mismatches[:5])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bart", "t5", "gpt2"])
@pytest.mark.parametrize("setting", ["beam4_ngram3_lp2_minmax_es", "beam5_es_never"])
def test_equivalence_real_vocabularies(real_tokenizer_models, family: str, setting: str) -> None:
    """Tiny models with the real tokenizers' vocabularies (32k-60k): realistic top-k widths."""
    loaded = load(real_tokenizer_models(family))
    result = check_equivalence(loaded.model, generic, text_batch(loaded, BATCH, seed=1), SETTINGS[setting])
    print(f"real-{family} {setting}: {result.summary()}")
    assert not result.mismatches, "\n".join(result.mismatches[:5])
