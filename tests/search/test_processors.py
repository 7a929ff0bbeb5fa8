"""seqgen's logits processors vs transformers' own, bit for bit, on random scores and histories."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")  # every processor is checked on random cases

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

import tests.equivalence  # noqa: F401  (single intra-op thread)
from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.ngram import NGramBlocker
from seqgen_cli.search.processors import LogitsPipeline, top_k_filter, top_p_filter
from seqgen_cli.search.settings import resolve_settings

EOS = 2


def _pipeline(history: TokenHistory, vocab: int, prompt_len: int, max_length: int = 64, **options):
    config = GenerationConfig(eos_token_id=EOS, pad_token_id=1, max_length=max_length, **options)
    s = resolve_settings(config, is_encoder_decoder=False, prompt_len=prompt_len)
    return LogitsPipeline(s, history, vocab, torch.device("cpu"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def _case(seed: int, rows: int, length: int, vocab: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    scores = torch.randn((rows, vocab), generator=g).to(dtype)
    return ids, scores


cases = st.tuples(
    st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 40), st.integers(3, 50)
)  # seed, rows, length, vocab


@settings(max_examples=60, deadline=None)
@given(cases, st.integers(1, 4))
def test_no_repeat_ngram(case, n):
    seed, rows, length, vocab = case
    ids, scores = _case(seed, rows, length, vocab)
    history = TokenHistory(ids, length + 1)
    pipe = _pipeline(history, vocab, length, no_repeat_ngram_size=n)
    assert _same(pipe(history, scores.clone()), NoRepeatNGramLogitsProcessor(n)(ids, scores))


@settings(max_examples=60, deadline=None)
@given(cases, st.sampled_from([0.5, 1.2, 2.0]), st.integers(0, 5))
def test_repetition_penalty(case, penalty, pad):
    seed, rows, length, vocab = case
    ids, scores = _case(seed, rows, length, vocab)
    pad_lengths = torch.full((rows,), min(pad, length - 1))
    history = TokenHistory(ids, length + 1, pad_lengths)
    pipe = _pipeline(history, vocab, length, repetition_penalty=penalty)
    expected = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pad_lengths)(ids, scores)
    assert _same(pipe(history, scores.clone()), expected)


def test_repetition_penalty_prompt_ids_beyond_the_lm_head():
    """Prompt ids >= V (embedding vocab larger than the head) are ignored, as transformers does."""
    ids, scores = _case(3, 4, 12, 20)
    ids[:, 2] = 25
    pad_lengths = torch.tensor([0, 1, 3, 0])
    history = TokenHistory(ids, 13, pad_lengths)
    pipe = _pipeline(history, 20, 12, repetition_penalty=1.5)
    assert not pipe.ids_in_vocab
    expected = RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=pad_lengths)(ids, scores)
    assert _same(pipe(history, scores.clone()), expected)


@settings(max_examples=60, deadline=None)
@given(cases, st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=3), min_size=1, max_size=6))
def test_bad_words(case, bad):
    seed, rows, length, vocab = case
    vocab = max(vocab, 7)
    ids, scores = _case(seed, rows, length, vocab)
    ids = ids % 7  # small alphabet so that multi-token bad words do match
    history = TokenHistory(ids, length + 1)
    pipe = _pipeline(history, vocab, length, bad_words_ids=bad)
    expected = NoBadWordsLogitsProcessor(bad, eos_token_id=EOS)(ids, scores)
    assert torch.equal(pipe(history, scores.clone()), expected)


@settings(max_examples=40, deadline=None)
@given(cases, st.integers(0, 45))
def test_min_length_forced_and_suppress(case, min_length):
    seed, rows, length, vocab = case
    vocab = max(vocab, 8)
    ids, scores = _case(seed, rows, length, vocab)
    max_length = length + 1 + seed % 3
    history = TokenHistory(ids, max_length)
    options = dict(
        min_length=min_length,
        forced_bos_token_id=3,
        forced_eos_token_id=[EOS, 4],
        suppress_tokens=[5, 6],
        begin_suppress_tokens=[7],
    )
    pipe = _pipeline(history, vocab, length - (seed % 2), max_length=max_length, **options)
    expected = scores
    for proc in (
        MinLengthLogitsProcessor(min_length, torch.tensor([EOS])),
        ForcedBOSTokenLogitsProcessor(3),
        ForcedEOSTokenLogitsProcessor(max_length, [EOS, 4]),
        SuppressTokensLogitsProcessor([5, 6]),
        SuppressTokensAtBeginLogitsProcessor([7], pipe.settings.begin_index),
    ):
        expected = proc(ids, expected)
    assert _same(pipe(history, scores.clone()), expected)


@settings(max_examples=60, deadline=None)
@given(cases, st.integers(1, 60), st.sampled_from([0.1, 0.5, 0.9, 0.99]))
def test_warpers(case, k, p):
    seed, rows, length, vocab = case
    ids, scores = _case(seed, rows, length, vocab)
    assert _same(top_k_filter(scores, k), TopKLogitsWarper(k)(ids, scores))
    assert _same(top_p_filter(scores, p), TopPLogitsWarper(p)(ids, scores))
    history = TokenHistory(ids, length + 1)
    pipe = _pipeline(history, vocab, length, do_sample=True, temperature=0.7, top_k=k, top_p=p)
    expected = TopPLogitsWarper(p)(ids, TopKLogitsWarper(k)(ids, TemperatureLogitsWarper(0.7)(ids, scores)))
    assert _same(pipe(history, scores.clone()), expected)


@settings(max_examples=60, deadline=None)
@given(cases, st.sampled_from([0.0, 0.05, 0.3, 1.0]), st.sampled_from([0.2, 0.9, 0.99]), st.sampled_from([3e-4, 0.02]))
def test_later_warpers(case, min_p, typical, cutoff):
    """min-p, typical, epsilon and eta sampling after temperature, top-k and top-p, in generate()'s order."""
    seed, rows, length, vocab = case
    ids, scores = _case(seed, rows, length, vocab)
    history = TokenHistory(ids, length + 1)
    for cut in ("epsilon_cutoff", "eta_cutoff"):
        options = {"temperature": 0.8, "top_k": 0, "min_p": min_p, "typical_p": typical, cut: cutoff}
        pipe = _pipeline(history, vocab, length, do_sample=True, **options)
        last = EpsilonLogitsWarper(cutoff) if cut == "epsilon_cutoff" else EtaLogitsWarper(cutoff, device="cpu")
        expected = TemperatureLogitsWarper(0.8)(ids, scores)
        for warper in (MinPLogitsWarper(min_p), TypicalLogitsWarper(typical), last):
            expected = warper(ids, expected)
        assert _same(pipe(history, scores.clone()), expected), cut


def test_full_pipeline_matches_generate_order(tiny_models):
    """Every processor at once, in the order generate() builds them (private API, on a tiny model)."""
    from tests.tiny_models import load

    model = load(tiny_models("gpt2")).model
    vocab = model.config.vocab_size
    options = dict(
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        bad_words_ids=[[5], [6, 7]],
        min_length=30,
        forced_bos_token_id=3,
        forced_eos_token_id=4,
        suppress_tokens=[8],
        begin_suppress_tokens=[9],
        max_length=40,
        eos_token_id=0,
        pad_token_id=0,
    )
    for length in (1, 12, 39):
        ids, scores = _case(length, 4, length, vocab)
        config = GenerationConfig(**options)
        model._prepare_special_tokens(config, device="cpu")
        hf = model._get_logits_processor(config, input_ids_seq_length=length, device="cpu")
        history = TokenHistory(ids, 41)
        s = resolve_settings(GenerationConfig(**options), is_encoder_decoder=False, prompt_len=length)
        ours = LogitsPipeline(s, history, vocab, torch.device("cpu"))
        assert _same(ours(history, scores.clone()), hf(ids, scores)), length


def test_ngram_long_sequences_through_reordering():
    """> 1024 tokens, incremental updates, random row reordering, fp32/fp16/bf16: same bans as transformers."""
    g = torch.Generator().manual_seed(0)
    rows, vocab, prompt = 6, 11, 1030
    for n, dtype in ((3, torch.float32), (2, torch.float16), (4, torch.bfloat16)):
        ids = torch.randint(0, vocab, (rows, prompt), generator=g)
        history = TokenHistory(ids, prompt + 40)
        blocker = NGramBlocker(n, vocab, history)
        reference = NoRepeatNGramLogitsProcessor(n)
        for _ in range(30):
            scores = torch.randn((rows, vocab), generator=g).to(dtype)
            assert _same(blocker(history, scores.clone()), reference(history.filled, scores))
            order = torch.randint(0, rows, (rows,), generator=g)  # beams copy other beams
            history.select(order)
            blocker.select(order)
            history.append(torch.randint(0, vocab, (rows,), generator=g))
            blocker.appended(history)


def test_ngram_unpacked_fallback():
    """Huge vocab x n beyond int64 packing: the column-comparison path gives the same bans."""
    g = torch.Generator().manual_seed(1)
    vocab, n = 2**20, 5
    ids = torch.randint(0, 3, (3, 50), generator=g)
    history = TokenHistory(ids, 80)
    blocker = NGramBlocker(n, vocab, history)
    assert not blocker.packed
    for _ in range(10):
        scores = torch.randn((3, vocab), generator=g)
        assert _same(
            blocker(history, scores.clone()), NoRepeatNGramLogitsProcessor(n)(history.filled, scores)
        )
        history.append(torch.randint(0, 3, (3,), generator=g))
        blocker.appended(history)


def test_later_warpers_run_on_the_fast_engine(tiny_models):
    """A checkpoint's or a flag's min_p / typical_p / epsilon / eta runs on seqgen's engine (not generate()), its
    outputs repeating with the seed; out of range is one line naming the flag."""
    from seqgen_cli.config import check_flags
    from seqgen_cli.errors import SeqgenError
    from seqgen_cli.generator import Generator

    options = {"do_sample": True, "min_p": 0.1, "typical_p": 0.95, "eta_cutoff": 3e-4, "max_new_tokens": 8}
    gen = Generator(str(tiny_models("gpt2")), backend="auto", seed=5, **options)
    assert gen.backend == "fast" and gen.fallback is None
    texts = ["a first input", "and a second one"]
    assert gen.generate(texts) == Generator(str(tiny_models("gpt2")), seed=5, **options).generate(texts)
    with pytest.raises(SeqgenError, match=r"--min-p 1.5: must be a finite number >= 0 and <= 1"):
        check_flags({"min_p": 1.5})
    with pytest.raises(SeqgenError, match=r"--typical-p 0.0: must be a finite number > 0 and <= 1"):
        check_flags({"typical_p": 0.0})
