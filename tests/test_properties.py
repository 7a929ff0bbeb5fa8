"""Property tests (hypothesis, part of the test extra; the module skips without it): the batch plan and the
sentence splitter and scores of ``seqgen eval``. The logits processors' are in search/test_processors.py."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from seqgen_cli.batching import plan_batches  # noqa: E402
from seqgen_cli.metrics import METRICS, ROUGE_TYPES, score, split_sentences  # noqa: E402
from seqgen_cli.shapes import input_width  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 300), max_size=80),
    st.integers(1, 16),
    st.one_of(st.none(), st.integers(1, 2000)),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
)
def test_plan_partitions_within_limits(lengths, batch_size, batch_tokens, rows, sort, buckets) -> None:
    batches = list(plan_batches(lengths, batch_size, batch_tokens, rows, sort, buckets=buckets))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert 1 <= len(b) <= batch_size
        widths = {input_width(lengths[i]) for i in b}
        assert len(widths) == 1 or not buckets  # with buckets, one width bucket per batch
        if batch_tokens is not None and len(b) > 1:  # counted at the batch's widest input
            assert max(widths) * len(b) * rows <= batch_tokens
    if not sort and buckets:  # input order within each bucket
        order = [i for b in batches for i in b]
        assert order == sorted(order, key=lambda i: input_width(lengths[i]))


_word = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1
)


@given(st.lists(_word, max_size=30).map(" ".join))
def test_split_keeps_every_non_space_character(text: str) -> None:
    sentences = split_sentences(text)
    assert "".join("".join(sentences).split()) == "".join(text.split())
    assert all(s and s == s.strip() for s in sentences)


_sentence = st.lists(
    st.sampled_from("alpha beta gamma delta the cat sat on mat".split()), min_size=4, max_size=12
).map(lambda ws: " ".join(ws).capitalize() + ".")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(_sentence, min_size=1, max_size=3).map(" ".join), min_size=1, max_size=5))
def test_refs_against_themselves_score_100(refs: list[str]) -> None:
    result = score(refs, refs, list(METRICS))
    for t in ROUGE_TYPES:
        assert result["rouge"][t]["fmeasure"] == pytest.approx(100.0)
    assert result["bleu"]["score"] == pytest.approx(100.0)
    assert result["chrf"]["score"] == pytest.approx(100.0)
