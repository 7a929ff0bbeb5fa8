"""Logits processors, applied in transformers' order (``GenerationMixin._get_logits_processor``).

The pipeline owns the scores it is given and modifies them in place where it can. All processors are vectorised over rows and step-dependent conditions use the host-side ``cur_len`` (the same
for every row), so a step needs no device->host sync. Each one performs the same elementwise arithmetic as
its transformers counterpart, so processed scores match bit for bit.

Order: repetition penalty, no-repeat n-gram, bad words, min length, forced BOS, forced EOS, suppress tokens,
begin-suppress tokens; then (sampling only) the warpers: temperature, top-k, top-p, the same arithmetic as
transformers' ``*LogitsWarper`` (:class:`Warpers`).
"""

from __future__ import annotations

import torch

from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.ngram import NGramBlocker
from seqgen_cli.search.settings import SearchSettings

NEG_INF = float("-inf")


def _vocab_ids(tokens: tuple[int, ...], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """[T] int64 ids of ``tokens`` (ids outside the vocab ignored), or None if empty.

    Masks are applied with ``index_fill_`` over these columns: it touches T columns instead of
    reading a [V] bool mask against every row (same values, a fraction of the memory traffic).
    """
    ids = sorted({t for t in tokens if 0 <= t < vocab_size})
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def repetition_penalty(
    history: TokenHistory, scores: torch.Tensor, penalty: float, ids_in_vocab: bool
) -> torch.Tensor:
    """Penalise every token already in the row's history (left-padding excluded). ``scores``: [N, V].

    Same arithmetic as ``RepetitionPenaltyLogitsProcessor``: negative scores are multiplied by the penalty,
    others divided. ``O(L)`` gather/scatter per row, no state to reorder. With ``ids_in_vocab`` (no history
    id >= V) it works in place: left-pad positions are pointed at the row's last token, whose duplicate
    writes carry the same value. Otherwise, like transformers, through a spare column.
    """
    vocab_size = scores.shape[-1]
    ids = history.filled  # [N, L]
    positions = torch.arange(ids.shape[1], device=ids.device)
    if ids_in_vocab:
        if history.pad_lengths is not None:
            ids = torch.where(positions[None, :] < history.pad_lengths[:, None], ids[:, -1:], ids)
        picked = torch.gather(scores, 1, ids)
        picked = torch.where(picked < 0, picked * penalty, picked / penalty)
        return scores.scatter_(1, ids, picked)
    ids = ids.clamp(max=vocab_size)  # ids beyond the lm head go to the spare column
    if history.pad_lengths is not None:
        ids = ids.masked_fill(positions[None, :] < history.pad_lengths[:, None], vocab_size)
    padded = torch.nn.functional.pad(scores, (0, 1))  # [N, V + 1]
    picked = torch.gather(padded, 1, ids)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return padded.scatter(1, ids, picked)[:, :vocab_size]


class BadWords:
    """``bad_words_ids``: single tokens via a static mask, longer sequences matched against the history suffix."""

    def __init__(self, bad_words: tuple[tuple[int, ...], ...], vocab_size: int, device: torch.device) -> None:
        self.static = _vocab_ids(tuple(seq[0] for seq in bad_words if len(seq) == 1), vocab_size, device)
        by_prefix: dict[int, list[tuple[int, ...]]] = {}
        for seq in bad_words:
            if len(seq) > 1:
                by_prefix.setdefault(len(seq) - 1, []).append(seq)
        # One group per prefix length: prefixes [G, P] int64, last tokens [G] int64.
        self.groups = [
            (
                torch.tensor([s[:-1] for s in seqs], dtype=torch.long, device=device),
                torch.tensor([s[-1] for s in seqs], dtype=torch.long, device=device),
            )
            for seqs in by_prefix.values()
        ]

    def __call__(self, history: TokenHistory, scores: torch.Tensor) -> torch.Tensor:
        if self.static is not None:
            scores.index_fill_(1, self.static, NEG_INF)
        for prefixes, last in self.groups:
            p = prefixes.shape[1]
            if p > history.length:
                continue
            suffix = history.tokens[:, history.length - p : history.length]  # [N, P]
            matches = (suffix[:, None, :] == prefixes[None]).all(-1)  # [N, G]
            values = torch.full(matches.shape, float("inf"), dtype=scores.dtype, device=scores.device)
            values.masked_fill_(matches, NEG_INF)
            scores.scatter_reduce_(1, last.expand(matches.shape), values, reduce="amin")
        return scores


def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` best entries per row (ties with the k-th kept too). ``scores``: [N, V]."""
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1:]  # [N, 1]
    return scores.masked_fill(scores < kth, NEG_INF)


def top_p_filter(scores: torch.Tensor, p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Keep the smallest set of best tokens whose probability mass reaches ``p``. ``scores``: [N, V]."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[..., -min_tokens_to_keep:] = False
    remove = remove.scatter(1, sorted_indices, remove)
    return scores.masked_fill(remove, NEG_INF)


class Warpers:
    """Temperature, then top-k, then top-p (transformers' order)."""

    def __init__(self, settings: SearchSettings) -> None:
        self.temperature = settings.temperature
        self.top_k = settings.top_k
        self.top_p = settings.top_p

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k:
            scores = top_k_filter(scores, self.top_k)
        if self.top_p < 1.0:
            scores = top_p_filter(scores, self.top_p)
        return scores


class LogitsPipeline:
    """All processors for one search call. Stateful ones follow row selection via :meth:`select`."""

    def __init__(
        self, settings: SearchSettings, history: TokenHistory, vocab_size: int, device: torch.device
    ):
        s = settings
        self.settings = s
        self.ngram = (
            NGramBlocker(s.no_repeat_ngram_size, vocab_size, history) if s.no_repeat_ngram_size > 0 else None
        )
        self.bad_words = BadWords(s.bad_words, vocab_size, device) if s.bad_words else None
        self.eos_ids = _vocab_ids(s.eos, vocab_size, device)
        self.forced_eos_ids = _vocab_ids(s.forced_eos, vocab_size, device)
        self.suppress_ids = _vocab_ids(s.suppress_tokens, vocab_size, device)
        self.begin_suppress_ids = _vocab_ids(s.begin_suppress_tokens, vocab_size, device)
        self.warpers = Warpers(s) if s.mode == "sample" else None
        # Generated ids are always < V; only a prompt id could be out of the lm head's range (one sync here).
        self.ids_in_vocab = s.repetition_penalty != 1.0 and bool((history.filled < vocab_size).all())

    def select(self, rows: torch.Tensor) -> None:
        if self.ngram is not None:
            self.ngram.select(rows)

    def appended(self, history: TokenHistory) -> None:
        if self.ngram is not None:
            self.ngram.appended(history)

    def __call__(self, history: TokenHistory, scores: torch.Tensor) -> torch.Tensor:
        """``scores``: [N, V] float (log-probs in beam search, raw logits otherwise; modified in place)
        -> processed [N, V]."""
        s, cur_len = self.settings, history.length
        if s.repetition_penalty != 1.0:
            scores = repetition_penalty(history, scores, s.repetition_penalty, self.ids_in_vocab)
        if self.ngram is not None:
            scores = self.ngram(history, scores)
        if self.bad_words is not None:
            scores = self.bad_words(history, scores)
        if self.eos_ids is not None and cur_len < s.min_length:
            scores.index_fill_(1, self.eos_ids, NEG_INF)
        if s.forced_bos is not None and cur_len == 1:
            scores = torch.full_like(scores, NEG_INF)
            scores[:, s.forced_bos] = 0
        if self.forced_eos_ids is not None and cur_len == s.max_length - 1:
            scores = torch.full_like(scores, NEG_INF).index_fill_(1, self.forced_eos_ids, 0.0)
        if self.suppress_ids is not None:
            scores.index_fill_(1, self.suppress_ids, NEG_INF)
        if self.begin_suppress_ids is not None and cur_len == s.begin_index:
            scores.index_fill_(1, self.begin_suppress_ids, NEG_INF)
        if self.warpers is not None:
            scores = self.warpers(scores)
        if s.renormalize_logits:  # always last, as transformers' LogitNormalization
            scores = scores.contiguous()
            scores = torch.log_softmax(scores, dim=-1, out=scores)  # in place: same bits, no new [N, V]
        return scores
