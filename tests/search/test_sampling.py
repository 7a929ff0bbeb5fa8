"""Sampling's sync-free draw: ``search.sampling.draw`` (an exponential race) draws from the
same distribution as ``torch.multinomial``, never draws a token of probability 0, and repeats with a seed.
(That the decode loop calls no ``multinomial`` is ``tests/search/test_host_sync.py``'s: it forbids the op.)"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from seqgen_cli.search.sampling import draw

N = 60_000  # draws per distribution


def _p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit over the categories with expected > 0 (survival function of the
    chi-square distribution: the regularised upper incomplete gamma function)."""
    seen = expected > 0
    stat = ((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum()
    df = int(seen.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def _homogeneity_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors (same total) come from one distribution."""
    pooled = (a + b) / 2
    seen = pooled > 0
    stat = (((a - pooled) ** 2 + (b - pooled) ** 2)[seen] / pooled[seen]).sum()
    df = int(seen.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


DISTRIBUTIONS = {
    "small, one impossible": torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0]),
    "top-k of a softmax": torch.softmax(torch.linspace(3, -3, 40), 0) * (torch.arange(40) < 12),
    "peaked": torch.tensor([0.0, 0.995, 0.004, 0.001]),
}


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_draw_has_multinomials_distribution(name: str) -> None:
    probs = DISTRIBUTIONS[name] / DISTRIBUTIONS[name].sum()
    rows = probs.expand(N, -1).contiguous()  # [N, V]: one draw per row
    gen = torch.Generator().manual_seed(0)
    ours = torch.bincount(draw(rows, gen), minlength=probs.shape[0]).double()
    theirs = torch.bincount(
        torch.multinomial(rows, 1, generator=torch.Generator().manual_seed(1)).squeeze(1),
        minlength=probs.shape[0],
    ).double()
    assert ours[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    expected = probs.double() * N
    assert _p_value(ours, expected) > 1e-3, (ours, expected)
    assert _p_value(theirs, expected) > 1e-3, "the reference itself: the test's arithmetic is off"
    assert _homogeneity_p_value(ours, theirs) > 1e-3, (ours, theirs)


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_draw_is_atens_single_sample_path(name: str) -> None:
    """Today the draws are torch.multinomial's own for the same generator state (ATen draws one sample as
    this race): seeded outputs did not change when multinomial left the loop. (A torch that draws otherwise
    fails here, not in the distribution tests above.)"""
    rows = (DISTRIBUTIONS[name] / DISTRIBUTIONS[name].sum()).expand(4096, -1).contiguous()
    theirs = torch.multinomial(rows, 1, generator=torch.Generator().manual_seed(11)).squeeze(1)
    assert torch.equal(draw(rows, torch.Generator().manual_seed(11)), theirs)


def test_the_test_rejects_a_wrong_distribution() -> None:
    """The same statistics catch a draw that is slightly off (here: one token's mass moved to another)."""
    probs = DISTRIBUTIONS["small, one impossible"]
    wrong = probs + torch.tensor([-0.02, 0.02, 0, 0, 0, 0])
    counts = torch.bincount(
        draw(wrong.expand(N, -1).contiguous(), torch.Generator().manual_seed(0)), minlength=6
    )
    assert _p_value(counts.double(), probs.double() * N) < 1e-6


def test_rows_draw_from_their_own_distribution() -> None:
    """Rows of different distributions in one call: each row's draws follow its own row."""
    a, b = torch.tensor([0.7, 0.3, 0.0]), torch.tensor([0.0, 0.2, 0.8])
    rows = torch.stack([a, b]).repeat(N // 2, 1)  # [N, 3]: a, b, a, b, ...
    tokens = draw(rows, torch.Generator().manual_seed(3)).view(-1, 2)  # [N / 2, 2]
    for column, probs in ((0, a), (1, b)):
        counts = torch.bincount(tokens[:, column], minlength=3).double()
        assert _p_value(counts, probs.double() * (N // 2)) > 1e-3, counts


def test_a_zero_clock_never_draws_an_impossible_token() -> None:
    """Exp(1) can round to 0; 0 / 0 would be NaN and argmax would take it."""
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0]])
    with mock.patch.object(torch.Tensor, "exponential_", lambda self, generator=None: self.zero_()):
        assert draw(probs).tolist() == [2]


def test_draws_repeat_with_a_seed() -> None:
    rows = torch.softmax(torch.randn(64, 100, generator=torch.Generator().manual_seed(0)), -1)
    first = draw(rows, torch.Generator().manual_seed(7))
    assert torch.equal(first, draw(rows, torch.Generator().manual_seed(7)))
    assert not torch.equal(first, draw(rows, torch.Generator().manual_seed(8)))


def test_a_sampled_output_depends_on_its_seed_and_index_only(tiny_models) -> None:
    """Each input draws from its own stream (``Streams``: --seed and its index in the run): batch size, sort window
    and refill give the same sampled outputs; another seed gives others."""
    from seqgen_cli.generator import Generator
    from tests.tiny_models import sample_texts

    texts = sample_texts(9, seed=4)
    settings = dict(do_sample=True, top_k=20, max_new_tokens=6, num_return_sequences=2)
    gen = Generator(str(tiny_models("bart")), device="cpu", seed=5, **settings)
    whole = gen.generate(texts, batch_size=9)
    assert whole == gen.generate(texts, batch_size=2) == gen.generate(texts, batch_size=1)
    refill = Generator(str(tiny_models("bart")), device="cpu", seed=5, refill=True, **settings)
    assert refill.generate(texts, batch_size=3) == whole
    other = Generator(str(tiny_models("bart")), device="cpu", seed=6, **settings)
    assert other.generate(texts, batch_size=9) != whole
