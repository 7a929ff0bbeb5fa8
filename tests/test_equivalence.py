"""seqgen's engine (generic backend) vs transformers generate(), token for token, every family x setting."""

from __future__ import annotations

import pytest
import torch

from seqgen_cli.models import get_decoder
from seqgen_cli.models.generic import GenericDecoder
from tests.engine_models import FAMILIES, tiny_model
from tests.equivalence import SETTINGS, check_equivalence, random_batch

BATCH = 32


def generic(model):
    return get_decoder(model, generic=True)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_equivalence(family: str, setting: str) -> None:
    model = tiny_model(family)
    result = check_equivalence(model, generic, random_batch(model, BATCH), SETTINGS[setting])
    print(f"{family} {setting}: {result.summary()}")
    for line in result.near_ties:
        print("  near-tie:", line)
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    if SETTINGS[setting].get("num_beams", 1) == 1:
        assert result.identical == result.total


class NoisyDecoder(GenericDecoder):
    """Logits perturbed by 1e-2: the harness must notice."""

    def step(self, state, tokens):
        logits = super().step(state, tokens)
        return logits + 1e-2 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(len(tokens)))


@pytest.mark.parametrize("setting", ["greedy", "beam5_es_false"])
def test_harness_detects_differences(setting: str) -> None:
    model = tiny_model("bart")
    result = check_equivalence(model, NoisyDecoder, random_batch(model, BATCH), SETTINGS[setting])
    assert result.mismatches
