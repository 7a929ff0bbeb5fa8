"""Logits processors, applied in transformers' order (``GenerationMixin._get_logits_processor``), each written once
over both layouts of the token history (``history.py``).

* :class:`LogitsPipeline`: the dynamic layout (every search's rows that leave and grow): the step a host int, so a
  step condition is a host branch and a ban writes only its columns (``index_fill_``); the pipeline owns the scores
  it is given and modifies them in place where it can. No device->host sync.
* :func:`process` / :func:`process_split` / :func:`append`: the static layout (the static beam search of
  ``static.py``): the history a fixed ``[N, W]`` buffer, the step and limits 0-d device tensors
  (``history.StepLimits``), every step condition a ``torch.where``; one compiled graph serves every step of a shape.

Both run the same functions (:func:`repetition_penalty`, ``ngram.ngram_ban``, :func:`bad_sequences`,
:func:`column_processors`, :func:`renormalize`) over one set of constants (:class:`Processors`); where the layouts
differ, the helpers :func:`ban` and :func:`force` (and ``history.py``'s) branch on the type of the step. Each
processor performs the same elementwise arithmetic as its transformers counterpart, so processed scores match bit
for bit in both layouts (a masked column leaves a score as it is: ``amin`` with ``+inf``, a duplicate of the row's
last token in a repetition-penalty scatter).

Order: repetition penalty, no-repeat n-gram, bad words, min length, forced BOS, forced EOS, suppress tokens,
begin-suppress tokens; then (sampling only) the warpers: temperature, top-k, top-p, the same arithmetic as
transformers' ``*LogitsWarper`` (:class:`Warpers`); then ``renormalize_logits``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from seqgen_cli.search.grammar import BatchGrammar, GrammarMask
from seqgen_cli.search.history import (
    Cond,
    History,
    StaticHistory,
    Step,
    StepLimits,
    TokenHistory,
    columns,
    either,
    filled,
    gate,
    put_column,
    unfilled,
    unless,
)
from seqgen_cli.search.ngram import NGramBlocker, append_key, ngram_ban
from seqgen_cli.search.settings import SearchSettings

NEG_INF = float("-inf")
POS_INF = float("inf")

Limits = SearchSettings | StepLimits  # what a step's conditions compare with: host ints or device values


def _vocab_ids(tokens: tuple[int, ...], vocab_size: int, device: torch.device) -> Tensor | None:
    """[T] int64 ids of ``tokens`` (ids outside the vocab ignored), or None if empty."""
    ids = sorted({t for t in tokens if 0 <= t < vocab_size})
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


@dataclass(frozen=True, eq=False)
class Columns:
    """The token ids a processor acts on, and for the static layout the same as a ``[V]`` vector.

    The dynamic layout writes only these columns (``index_fill_``: I columns instead of reading a [V] mask
    against every row); the static one reads the vector in a ``torch.where`` (one pass that a compiled graph fuses
    with the others)."""

    ids: Tensor  # [I] int64
    mask: Tensor | None = None  # [V] bool: True at ids (static bans)
    row: Tensor | None = None  # [V] float32: 0 at ids, -inf elsewhere (static forced tokens)

    @classmethod
    def of(cls, ids: Tensor | None) -> Columns | None:
        return None if ids is None else cls(ids)

    def static(self, vocab: int, forced: bool = False) -> Columns:
        """With the [V] vector a static step reads: the row of a forced token, else the mask of a ban."""
        device = self.ids.device
        if forced:
            row = torch.full((vocab,), NEG_INF, device=device).index_fill_(0, self.ids, 0.0)
            return Columns(self.ids, row=row)
        mask = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, self.ids, True)
        return Columns(self.ids, mask=mask)


@dataclass(eq=False)
class Processors:
    """The processors of one search as constants: what runs is what is set (for the penalty: not 1)."""

    vocab: int
    penalty: float  # repetition penalty; 1.0: none
    inverse: float | None  # static on CUDA: multiply by 1 / penalty in float32 (see beam_step.divide)
    ids_in_vocab: bool  # no history id >= V: the in-place repetition penalty
    ngram: int  # no_repeat_ngram_size; 0: none
    powers: Tensor | None  # [n-1] int64: V ** (n-2-k), packed n-gram keys (None: columns compared)
    bad_groups: list[tuple[Tensor, Tensor]]  # multi-token bad words by prefix length: [G, prefix], last [G]
    bad: Columns | None  # single-token bad words
    eos: Columns | None  # EOS, banned below the min length
    bos: Columns | None  # forced at position 1
    forced_eos: Columns | None  # forced at max_length - 1
    suppress: Columns | None
    begin: Columns | None  # suppressed at begin_index
    renormalize: bool

    @classmethod
    def build(
        cls, s: SearchSettings, vocab: int, ids_in_vocab: bool, powers: Tensor | None, device: torch.device
    ) -> Processors:
        by_prefix: dict[int, list[tuple[int, ...]]] = {}
        for seq in s.bad_words:
            if len(seq) > 1:
                by_prefix.setdefault(len(seq) - 1, []).append(seq)
        groups = [
            (
                torch.tensor([w[:-1] for w in seqs], dtype=torch.long, device=device),
                torch.tensor([w[-1] for w in seqs], dtype=torch.long, device=device),
            )
            for seqs in by_prefix.values()
        ]
        singles = tuple(seq[0] for seq in s.bad_words if len(seq) == 1)
        bos = None if s.forced_bos is None else torch.tensor([s.forced_bos], dtype=torch.long, device=device)
        return cls(
            vocab=vocab,
            penalty=s.repetition_penalty,
            inverse=None,
            ids_in_vocab=ids_in_vocab,
            ngram=s.no_repeat_ngram_size,
            powers=powers,
            bad_groups=groups,
            bad=Columns.of(_vocab_ids(singles, vocab, device)),
            eos=Columns.of(_vocab_ids(s.eos, vocab, device)),
            bos=Columns.of(bos),
            forced_eos=Columns.of(_vocab_ids(s.forced_eos, vocab, device)),
            suppress=Columns.of(_vocab_ids(s.suppress_tokens, vocab, device)),
            begin=Columns.of(_vocab_ids(s.begin_suppress_tokens, vocab, device)),
            renormalize=s.renormalize_logits,
        )

    def static(self, device: torch.device) -> Processors:
        """These processors for the static layout on ``device``: the column sets with their [V] vectors, and on
        CUDA the penalty's float32 inverse (what eager CUDA multiplies by when it divides by a Python float)."""
        v = self.vocab

        def bans(c: Columns | None) -> Columns | None:
            return None if c is None else c.static(v)

        def forced(c: Columns | None) -> Columns | None:
            return None if c is None else c.static(v, forced=True)

        inverse = float(float32_inverse([self.penalty])[0]) if device.type == "cuda" else None
        return replace(
            self,
            inverse=inverse,
            bad=bans(self.bad),
            eos=bans(self.eos),
            bos=forced(self.bos),
            forced_eos=forced(self.forced_eos),
            suppress=bans(self.suppress),
            begin=bans(self.begin),
        )


def float32_inverse(values: list[float]) -> Tensor:
    """``1 / values`` in float32, correctly rounded (on the host): what CUDA multiplies by when eager torch
    divides a float32 tensor by a Python float (``beam_step.divide``)."""
    return torch.ones(len(values), dtype=torch.float32) / torch.tensor(values, dtype=torch.float32)


# -- the processors, each over both layouts ------------------------------------------------------------------------


def repetition_penalty(p: Processors, h: History, length: Step, scores: Tensor) -> Tensor:
    """Penalise every token already in the row's history (left padding excluded; at a device ``length`` the
    columns from it too). ``scores``: [N, V], modified in place where it can be.

    Same arithmetic as ``RepetitionPenaltyLogitsProcessor``: negative scores are multiplied by the penalty,
    others divided. ``O(L)`` gather/scatter per row, no state to reorder. With ``ids_in_vocab`` (no history
    id >= V) it works in place: columns that do not count point at the row's last token, whose duplicate
    writes carry the same value. Otherwise, like transformers, through a spare column.
    """
    if p.penalty == 1.0:
        return scores
    vocab = scores.shape[-1]
    ids = filled(h.tokens, length)  # [N, length]
    skip = unfilled(h, length, ids.shape[1])  # [N, length] bool, or None
    if p.ids_in_vocab:
        if skip is not None:
            ids = torch.where(skip, columns(h.tokens, length - 1, 1, h.cols), ids)
        picked = torch.gather(scores, 1, ids)
        return scores.scatter_(1, ids, _penalised(p, picked))
    ids = ids.clamp(max=vocab)  # ids beyond the lm head go to the spare column
    if skip is not None:
        ids = ids.masked_fill(skip, vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))  # [N, V + 1]
    picked = torch.gather(padded, 1, ids)
    return padded.scatter_(1, ids, _penalised(p, picked))[:, :vocab]


def _penalised(p: Processors, picked: Tensor) -> Tensor:
    divided = picked / p.penalty if p.inverse is None else picked * p.inverse
    return torch.where(picked < 0, picked * p.penalty, divided)


def bad_sequences(
    p: Processors, h: History, length: Step, scores: Tensor, skip: Tensor | None = None
) -> Tensor:
    """``NoBadWordsLogitsProcessor``'s multi-token entries: ban, in place, the last token of every entry whose
    prefix ends the row's ``length`` columns (none where ``skip``, a 0-d bool). ``scores``: [N, V]."""
    for prefixes, last in p.bad_groups:  # [G, prefix], [G]
        width = prefixes.shape[1]
        fits = length >= width  # the history holds a prefix
        if fits is False:
            continue
        suffix = columns(h.tokens, length - width, width, h.cols)  # [N, prefix]
        matches = unless(gate((suffix[:, None, :] == prefixes[None]).all(-1), fits), skip)  # [N, G]
        values = torch.where(matches, NEG_INF, POS_INF).to(scores.dtype)
        scores = scores.scatter_reduce_(1, last.expand(matches.shape), values, reduce="amin")
    return scores


def column_processors(p: Processors, length: Step, lim: Limits, scores: Tensor) -> Tensor:
    """The processors that act on whole columns, in transformers' order: single-token bad words, min length,
    forced BOS / EOS, suppressed tokens. ``scores`` [N, V] -> [N, V] (static: one elementwise pass, compiled)."""
    below_min = None if p.eos is None else length < lim.min_length
    scores = ban(scores, length, (p.bad, True), (p.eos, below_min))
    bos, eos = forced_steps(p, length, lim)
    scores = force(scores, p.bos, bos)
    scores = force(scores, p.forced_eos, eos)
    at_begin = None if p.begin is None else length == lim.begin_index
    return ban(scores, length, (p.suppress, True), (p.begin, at_begin))


def forced_steps(p: Processors, length: Step, lim: Limits) -> tuple[Cond | None, Cond | None]:
    """Whether this step forces BOS (position 1) and EOS (``max_length - 1``); ``None``: never."""
    bos = None if p.bos is None else length == 1
    return bos, None if p.forced_eos is None else length == lim.max_length - 1


def ban(scores: Tensor, length: Step, *bans: tuple[Columns | None, Cond | None]) -> Tensor:
    """-inf in the columns of each ban whose condition holds (``True``: every step). At a host step each is a
    branch and an ``index_fill_`` of its columns in place; at a device step all are one ``where`` over their [V]
    masks."""
    if isinstance(length, int):
        for cols, cond in bans:
            if cols is not None and cond:
                scores.index_fill_(1, cols.ids, NEG_INF)
        return scores
    mask = None
    for cols, cond in bans:
        if cols is not None and cols.mask is not None and cond is not None:
            mask = either(mask, gate(cols.mask, cond))
    return scores if mask is None else torch.where(mask, NEG_INF, scores)


def force(scores: Tensor, cols: Columns | None, cond: Cond | None) -> Tensor:
    """Where ``cond``: the forced tokens' row (0 at them, -inf elsewhere) replaces the scores. A host condition
    is a branch (a new [N, V] at that step only); a device one a ``where`` against the [V] row."""
    if cols is None or cond is None:
        return scores
    if isinstance(cond, bool):
        return torch.full_like(scores, NEG_INF).index_fill_(1, cols.ids, 0.0) if cond else scores
    return torch.where(cond, cols.row, scores)


def renormalize(scores: Tensor, length: Step) -> Tensor:
    """``LogitNormalization`` (``renormalize_logits``), always last: log-softmax again. At a host step in place
    (same bits, no new [N, V]); at a device step into a new tensor (a compiled graph's output)."""
    if isinstance(length, int):
        scores = scores.contiguous()
        return torch.log_softmax(scores, dim=-1, out=scores)
    return torch.log_softmax(scores, dim=-1)


# -- sampling's warpers (the dynamic layout only) ----------------------------------------------------------------


def top_k_filter(scores: Tensor, k: int) -> Tensor:
    """Keep the ``k`` best entries per row (ties with the k-th kept too). ``scores``: [N, V]."""
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1:]  # [N, 1]
    return scores.masked_fill(scores < kth, NEG_INF)


def top_p_filter(scores: Tensor, p: float, min_tokens_to_keep: int = 1) -> Tensor:
    """Keep the smallest set of best tokens whose probability mass reaches ``p``. ``scores``: [N, V]."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[..., -min_tokens_to_keep:] = False
    remove = remove.scatter(1, sorted_indices, remove)
    return scores.masked_fill(remove, NEG_INF)


def min_p_filter(scores: Tensor, min_p: float) -> Tensor:
    """Keep the tokens whose probability is at least ``min_p`` times the best one's (and the best)."""
    probs = torch.softmax(scores, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(remove, NEG_INF)


def typical_filter(scores: Tensor, mass: float) -> Tensor:
    """Keep the tokens whose surprisal is closest to the entropy, up to ``mass`` of the probability."""
    normalized = torch.nn.functional.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    ent = -(normalized * p).nansum(-1, keepdim=True)  # [N, 1]
    shifted = torch.abs((-normalized) - ent)
    sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
    cumulative = scores.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1).clamp_(max=sorted_scores.shape[-1] - 1)  # [N]
    remove = sorted_scores > sorted_scores.gather(1, last.view(-1, 1))
    remove[..., :1] = 0
    return scores.masked_fill(remove.scatter(1, sorted_indices, remove), NEG_INF)


def cutoff_filter(scores: Tensor, epsilon: float, eta: bool) -> Tensor:
    """Epsilon sampling (``eta``: eta sampling, the cutoff ``min(epsilon, sqrt(epsilon) * exp(-entropy))``): drop
    the tokens of a probability below the cutoff, except the best."""
    probs = scores.softmax(dim=-1)
    if eta:
        cut = torch.tensor(epsilon, device=scores.device)
        entropy = torch.distributions.Categorical(logits=scores).entropy()  # [N]
        cutoff: Tensor | float = torch.min(cut, torch.sqrt(cut) * torch.exp(-entropy))[..., None]
    else:
        cutoff = epsilon
    remove = (probs < cutoff) & (scores < torch.topk(scores, 1)[0][..., -1, None])
    return scores.masked_fill(remove, NEG_INF)


class Warpers:
    """Temperature, top-k, top-p, min-p, typical, epsilon, eta: transformers' order and arithmetic (one row kept at
    least: greedy search's and sampling's ``min_tokens_to_keep``)."""

    def __init__(self, settings: SearchSettings) -> None:
        self.s = settings

    def __call__(self, scores: Tensor) -> Tensor:
        s = self.s
        if s.temperature != 1.0:
            scores = scores / s.temperature
        if s.top_k:
            scores = top_k_filter(scores, s.top_k)
        if s.top_p < 1.0:
            scores = top_p_filter(scores, s.top_p)
        if s.min_p is not None:
            scores = min_p_filter(scores, s.min_p)
        if s.typical_p < 1.0:
            scores = typical_filter(scores, s.typical_p)
        if 0.0 < s.epsilon_cutoff < 1.0:
            scores = cutoff_filter(scores, s.epsilon_cutoff, eta=False)
        if 0.0 < s.eta_cutoff < 1.0:
            scores = cutoff_filter(scores, s.eta_cutoff, eta=True)
        return scores


class LogitsPipeline:
    """All processors for one search call over the dynamic layout. Stateful ones follow row selection via
    :meth:`select`."""

    def __init__(
        self,
        settings: SearchSettings,
        history: TokenHistory,
        vocab_size: int,
        device: torch.device,
        grammar: BatchGrammar | None = None,
    ):
        s = settings
        self.settings = s
        self.ngram = (
            NGramBlocker(s.no_repeat_ngram_size, vocab_size, history) if s.no_repeat_ngram_size > 0 else None
        )
        self.warpers = Warpers(s) if s.mode == "sample" else None
        # Generated ids are always < V; only a prompt id could be out of the lm head's range (one sync here).
        self.ids_in_vocab = s.repetition_penalty != 1.0 and bool((history.filled < vocab_size).all())
        powers = None if self.ngram is None else self.ngram.powers
        self.proc = Processors.build(s, vocab_size, self.ids_in_vocab, powers, device)
        # structured outputs: one matcher per row (where generate() runs a logits_processor: before the warpers)
        self.grammar = None if grammar is None else GrammarMask(grammar, history.tokens.shape[0])

    def select(self, rows: Tensor) -> None:
        if self.ngram is not None:
            self.ngram.select(rows)
        if self.grammar is not None:
            self.grammar.select(rows)

    def appended(self, history: TokenHistory) -> None:
        if self.ngram is not None:
            self.ngram.appended(history)
        if self.grammar is not None:
            self.grammar.appended()

    def __call__(self, history: TokenHistory, scores: Tensor) -> Tensor:
        """``scores``: [N, V] float (log-probs in beam search, raw logits otherwise; modified in place)
        -> processed [N, V]."""
        p, length = self.proc, history.length
        scores = repetition_penalty(p, history, length, scores)
        if self.ngram is not None:
            scores = self.ngram(history, scores)
        scores = bad_sequences(p, history, length, scores)
        scores = column_processors(p, length, self.settings, scores)
        if self.grammar is not None:
            scores = self.grammar(history.filled, scores, any(forced_steps(p, length, self.settings)))
        if self.warpers is not None:
            scores = self.warpers(scores)
        return renormalize(scores, length) if p.renormalize else scores


# -- the static layout's pipeline (static.static_beam_step: beam search, no warpers) ---------------------------------


def process(p: Processors, h: StaticHistory, lim: StepLimits, scores: Tensor) -> Tensor:
    """``LogitsPipeline.__call__`` in its order over the static layout: ``scores`` [N, V] float32 (modified in
    place where it can be) -> processed."""
    length = lim.prompt_len + lim.t  # [] cur_len
    scores = repetition_penalty(p, h, length, scores)
    scores = sparse_bans(p, h, length, scores, skip=None)
    scores = column_processors(p, length, lim, scores)
    return renormalize(scores, length) if p.renormalize else scores


def sparse_bans(
    p: Processors, h: StaticHistory, length: Tensor, scores: Tensor, skip: Tensor | None
) -> Tensor:
    """The no-repeat n-gram and bad-word-sequence bans (a scatter of -inf into ``scores`` [N, V], none where
    ``skip``)."""
    if p.ngram > 0:
        scores = ngram_ban(p.ngram, p.vocab, h, h.keys, length, scores, skip)
    return bad_sequences(p, h, length, scores, skip)


def process_split(p: Processors, h: StaticHistory, lim: StepLimits, scores: Tensor, add: Tensor) -> Tensor:
    """``process`` then ``+ add`` (each beam's running score, broadcast over [N, V]) for a pipeline without
    ``renormalize_logits``, in an order that compiles into one pass over ``scores``: the repetition penalty, the
    column processors and the add first, the sparse bans (-inf: ``-inf + add`` is ``-inf``, and the bans commute
    with the column bans) last, except at a forced step (the forced row replaces them). The same values."""
    length = lim.prompt_len + lim.t
    scores = repetition_penalty(p, h, length, scores)
    scores = column_processors(p, length, lim, scores) + add
    return sparse_bans(p, h, length, scores, either(*forced_steps(p, length, lim)))


def append(p: Processors, h: StaticHistory, rows: Tensor, tokens: Tensor, length: Tensor) -> list[Tensor]:
    """The static history after beam reordering (row ``i`` continues ``rows[i]``, [N]) and one more token per row
    (``tokens`` [N] at column ``length``), with the (n-1)-gram that completes: new ``[tokens, keys]`` buffers."""
    hist = put_column(h.tokens.index_select(0, rows), length, tokens, h.cols)  # [N, W]
    if h.keys is None:
        return [hist]
    keys = h.keys.index_select(0, rows)  # [N, W + 1]
    if p.ngram > 1 and p.powers is not None:
        keys = append_key(p.ngram, p.powers, hist, keys, length + 1, h.cols)
    return [hist, keys]
