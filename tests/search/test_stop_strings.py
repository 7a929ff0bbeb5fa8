"""Stop strings on the fast engine (``search/greedy.py``, ``search/beam.py``): beam search ends a candidate whose text
reaches a stop string as it ends one at EOS, as ``generate(stop_strings=..., num_beams=...)`` does; the outputs, their
``sequences_scores`` and per-token log-probs equal ``generate()``'s in float32, on a decoder-only and an
encoder-decoder tiny checkpoint."""

from __future__ import annotations

import math

import pytest

from seqgen_cli.generator import Generator

TEXTS = ["The weather today", "A list of", "Hello there my friend", "In 1990 the"]
BEAMS = {"num_beams": 4, "length_penalty": 0.8, "no_repeat_ngram_size": 3, "max_new_tokens": 24}


def _outputs(gen: Generator) -> tuple[list[list[list[int]]], list]:
    out = gen.generate_output([e.ids for e in gen.encode(TEXTS)])
    assert out.scores is not None
    return out.sequences, out.scores


def _cutting_stops(model, family: str) -> list[str]:
    """Two-character pieces of the plain outputs' texts, from their middles: where a hypothesis reaches one, beam
    search must end it (each candidate's whole text is checked, so any piece can end some hypothesis)."""
    plain = Generator(str(model), backend="fast", **BEAMS)
    texts = [outs[0] for outs in plain.generate(TEXTS)]
    pieces = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts if len(t) > 6]
    assert pieces, texts
    return sorted(set(pieces))[:2]


@pytest.mark.parametrize("family", ["gpt2", "bart"])
def test_beam_search_with_stop_strings_equals_generate_with_scores(tiny_models, family: str) -> None:
    model = tiny_models(family)
    stops = _cutting_stops(model, family)
    fast = Generator(str(model), backend="fast", stop=stops, scores=True, num_return_sequences=2, **BEAMS)
    ref = Generator(str(model), backend="hf", stop=stops, scores=True, num_return_sequences=2, **BEAMS)
    assert fast.stop_check is not None
    (got, got_scores), (want, want_scores) = _outputs(fast), _outputs(ref)
    assert got == want
    for mine, theirs in zip(got_scores, want_scores, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert math.isclose(a.score, b.score, rel_tol=0, abs_tol=1e-5), (a.score, b.score)
    plain = Generator(str(model), backend="fast", **BEAMS).generate_output([e.ids for e in fast.encode(TEXTS)])
    assert got != [seqs[:2] for seqs in plain.sequences]  # the stops changed some output: the test can fail


def test_refill_lanes_stop_beams_as_batches(tiny_models) -> None:
    model = tiny_models("gpt2")
    stops = _cutting_stops(model, "gpt2")
    lanes = Generator(str(model), backend="fast", stop=stops, refill=True, **BEAMS)
    batch = Generator(str(model), backend="fast", stop=stops, refill=False, **BEAMS)
    assert lanes.generate(TEXTS) == batch.generate(TEXTS)
