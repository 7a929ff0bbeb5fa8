"""Scores per output (``--scores``, ``Generator(scores=True)``): each output's score and summed log-probability,
the numbers ``generate(output_scores=True, return_dict_in_generate=True)`` gives: beam search's ``sequences_scores``
and, for greedy search and sampling, ``compute_transition_scores(normalize_logits=True)`` summed over the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seqgen_cli.generator import Generator
from seqgen_cli.search import generate
from seqgen_cli.search.settings import settings_for
from seqgen_cli.verify import rescore
from tests.equivalence import MASKED_SUM_RTOL, TOKEN_SUM_RTOL
from tests.tiny_models import sample_texts

TEXTS = sample_texts(6, seed=4)
SETTINGS = {
    "beam": dict(num_beams=4, num_return_sequences=2, length_penalty=1.5, no_repeat_ngram_size=2),
    "greedy": dict(num_beams=1, repetition_penalty=1.3),
}


def close(a: float, b: float, length: int, rtol: float = TOKEN_SUM_RTOL) -> bool:
    return abs(a - b) <= rtol * max(length, 1) * max(abs(b), 1.0)


def tokens_close(a: list[float], b: list[float], rtol: float = TOKEN_SUM_RTOL) -> bool:
    """Two outputs' per-token log-probs: one rounding each."""
    return len(a) == len(b) and all(close(x, y, 1, rtol) for x, y in zip(a, b, strict=True))


def outputs(model: Path, backend: str, texts: list[str] = TEXTS, **settings) -> tuple[Generator, object]:
    gen = Generator(str(model), backend=backend, scores=True, max_new_tokens=9, **settings)
    return gen, gen.generate_output([e.ids for e in gen.encode(texts)])


def early_eos(model: Path, settings: dict) -> int:
    """A token the first output generates fourth, as the end-of-sequence token: the random tiny models rarely end
    on their own, and rows that end early must stop adding to their log-probs."""
    _, out = outputs(model, "hf", TEXTS[:1], **settings)
    return out.sequences[0][0][3]


@pytest.mark.parametrize("family", ["bart", "gpt2", "t5"])
@pytest.mark.parametrize("mode", list(SETTINGS))
def test_scores_equal_generates(tiny_models, family: str, mode: str) -> None:
    model = tiny_models(family)
    settings = {**SETTINGS[mode], "eos_token_id": early_eos(model, SETTINGS[mode])}
    _, ours = outputs(model, "fast", **settings)
    _, theirs = outputs(model, "hf", **settings)  # generate(output_scores=True, return_dict_in_generate=True)
    assert ours.sequences == theirs.sequences
    if mode == "greedy":  # (beam search's length penalty of 1.5 may rank the longer hypotheses first)
        lengths = {len(s) for seqs in ours.sequences for s in seqs}
        assert 4 in lengths and len(lengths) > 1, "outputs that end at the chosen EOS, and others"
    pairs = [(a, b, len(s)) for x, y, seqs in zip(ours.scores, theirs.scores, ours.sequences, strict=True)
             for a, b, s in zip(x, y, seqs, strict=True)]  # fmt: skip
    assert len(pairs) == len(TEXTS) * SETTINGS[mode].get("num_return_sequences", 1)
    for a, b, n in pairs:
        assert close(a.score, b.score, n) and close(a.log_prob, b.log_prob, n), (a, b)
        assert len(a.tokens) == n and tokens_close(a.tokens, b.tokens), (a.tokens, b.tokens)
        assert close(sum(a.tokens), a.log_prob, n), "the tokens' log-probs add up to the output's"
        if mode == "greedy":
            assert a.score == a.log_prob, "no length penalty outside beam search"


def test_rows_that_ended_add_nothing_while_their_input_waits_for_a_check(tiny_models) -> None:
    """Between host checks (every 4 steps on a GPU) an ended row runs on, fed padding: its log-prob stays."""
    model = tiny_models("gpt2")
    settings = {**SETTINGS["greedy"], "eos_token_id": early_eos(model, SETTINGS["greedy"])}
    gen, theirs = outputs(model, "hf", **settings)
    fast = Generator(str(model), scores=True, max_new_tokens=9, **settings)
    padded = fast.pad([e.ids for e in fast.encode(TEXTS)])
    ours = generate(fast.model_backend(), padded, fast.config, sync_every=9)  # no check before the last step
    assert ours.sequences == theirs.sequences and any(len(s[0]) == 4 for s in ours.sequences)
    for (mine,), (theirs_,), (seq,), (per,) in zip(
        ours.scores, theirs.scores, ours.sequences, ours.token_scores, strict=True
    ):
        assert close(mine, theirs_.log_prob, len(seq)) and tokens_close(per, theirs_.tokens)


def test_beam_log_prob_is_the_teacher_forced_sum(tiny_models) -> None:
    """The summed log-prob of a beam output (its score times length ** length_penalty) against the output's own
    processed log-probs, re-scored one token at a time through transformers' model."""
    gen, ours = outputs(tiny_models("bart"), "fast", **SETTINGS["beam"])
    model = gen.loaded.use_reference()
    batch = gen.pad([e.ids for e in gen.encode(TEXTS)])
    settings = settings_for(model.config, batch, gen.config)
    for b, (seqs, scored) in enumerate(zip(ours.sequences, ours.scores, strict=True)):
        for seq, sc in zip(seqs, scored, strict=True):
            assert close(sc.log_prob, rescore(model, batch, b, seq, settings) * len(seq) ** 1.5, len(seq))
            assert sc.log_prob < sc.score < 0, "a sum over several tokens, divided by length ** 1.5"


def test_sampled_log_prob_is_the_tempered_distributions(tiny_models) -> None:
    """Sampling (generate()'s draws differ): each sampled output's log_prob is the sum, over its tokens, of
    log_softmax(logits / temperature), the distribution it was drawn from, computed here by teacher forcing."""
    model_dir = tiny_models("gpt2")
    gen, ours = outputs(model_dir, "fast", TEXTS[:3], do_sample=True, temperature=0.7, top_k=0, seed=5,
                        num_return_sequences=2)  # fmt: skip
    reference = gen.loaded.use_reference()
    for text, seqs, scored in zip(TEXTS[:3], ours.sequences, ours.scores, strict=True):
        prompt = gen.encode([text])[0].ids
        for seq, sc in zip(seqs, scored, strict=True):
            ids = torch.tensor([prompt + seq])
            with torch.inference_mode():
                logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
            expected = (logits / 0.7).log_softmax(-1).gather(1, torch.tensor(seq)[:, None])[:, 0]  # [T]
            assert sc.score == sc.log_prob and close(sc.log_prob, float(expected.sum()), len(seq))
            assert tokens_close(sc.tokens, expected.tolist())


@pytest.mark.parametrize("family,mode", [("bart", "beam"), ("gpt2", "greedy")])
def test_refill_gives_the_batchs_scores(tiny_models, family: str, mode: str) -> None:
    model = tiny_models(family)
    _, plain = outputs(model, "fast", **SETTINGS[mode])
    gen = Generator(str(model), scores=True, refill=True, lanes=2, max_new_tokens=9, **SETTINGS[mode])
    lanes = gen.generate_output([e.ids for e in gen.encode(TEXTS)])
    assert gen.refill and lanes.sequences == plain.sequences
    for x, y, seqs in zip(lanes.scores, plain.scores, plain.sequences, strict=True):
        for a, b, s in zip(x, y, seqs, strict=True):  # the lanes' masked span sums in another order
            assert close(a.score, b.score, len(s), MASKED_SUM_RTOL)
            assert close(a.log_prob, b.log_prob, len(s), MASKED_SUM_RTOL)
            assert tokens_close(a.tokens, b.tokens, MASKED_SUM_RTOL)


def test_no_scores_unless_asked(tiny_models) -> None:
    gen = Generator(str(tiny_models("gpt2")), max_new_tokens=4)
    out = gen.generate_output([e.ids for e in gen.encode(TEXTS[:2])])
    assert out.scores is None and not gen.config.output_scores
