"""The logits processors and the token history of the slot search (``search/slots.py``), with static shapes.

The same processors, order and arithmetic as ``search/processors.py`` and ``search/ngram.py`` (transformers'
``_get_logits_processor``), rewritten so that no host integer that changes per step reaches the tensor work: the
history is a fixed ``[N, W]`` buffer (columns ``[0, length)`` filled, the rest zeros), the step's ``length``
(transformers' ``cur_len``) and the batch's limits are 0-d device tensors (:class:`SlotLimits`), and every
"only at this step" condition is a ``torch.where`` on them. So one compiled graph serves every step of a slot
shape, and the values are those of the dynamic processors: a masked column leaves a score as it is (``amin``
with ``+inf``, a duplicate of the row's last token in a repetition-penalty scatter).

Ids outside the vocabulary are ignored as the dynamic processors ignore them (``_vocab_ids``); single-token
bans are ``[V]`` bool columns (``where`` instead of ``index_fill_``: the same values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.processors import NEG_INF, LogitsPipeline
from seqgen_cli.search.settings import SearchSettings

POS_INF = float("inf")


@dataclass(eq=False)
class SlotLimits:
    """A batch's step counter and length limits, 0-d int64 device tensors (refilled in place by every batch)."""

    t: Tensor  # steps done
    prompt_len: Tensor  # decoder positions before the first generated token
    max_length: Tensor
    min_length: Tensor
    begin_index: Tensor

    @classmethod
    def zeros(cls, device: torch.device) -> SlotLimits:
        return cls(*(torch.zeros((), dtype=torch.long, device=device) for _ in range(5)))

    def restart(self, s: SearchSettings) -> None:
        """Step 0 of a batch with settings ``s`` (one fill per value: queued, no copy from host memory)."""
        self.t.zero_()
        self.prompt_len.fill_(s.prompt_len)
        self.max_length.fill_(s.max_length)
        self.min_length.fill_(s.min_length)
        self.begin_index.fill_(s.begin_index)

    def tensors(self) -> list[Tensor]:
        return [self.t, self.prompt_len, self.max_length, self.min_length, self.begin_index]


@dataclass(eq=False)
class SlotHistory:
    """The rows' tokens ``[N, W]`` (prompt, then generated; zeros beyond), left padding per row and, with
    ``no_repeat_ngram_size``, the packed (n-1)-gram keys ``[N, W + 1]`` (``ngram.py``); ``cols``: ``arange(W + 1)``."""

    tokens: Tensor  # [N, W] int64
    pad_lengths: Tensor  # [N] int64: leading pad positions (decoder-only prompts), zeros otherwise
    keys: Tensor | None  # [N, W + 1] int64: key of the (n-1)-gram starting at each column
    cols: Tensor  # [W + 1] int64

    @classmethod
    def empty(cls, rows: int, width: int, packed_ngrams: bool, device: torch.device) -> SlotHistory:
        keys = torch.zeros((rows, width + 1), dtype=torch.long, device=device) if packed_ngrams else None
        tokens = torch.zeros((rows, width), dtype=torch.long, device=device)
        pads = torch.zeros(rows, dtype=torch.long, device=device)
        return cls(tokens, pads, keys, torch.arange(width + 1, device=device))

    def restart(self, history: TokenHistory, keys: Tensor | None, src: Tensor) -> None:
        """Take a batch's starting history (``TokenHistory``, its n-gram keys) in place: slot row ``i`` is row
        ``src[i]`` of it ([N] int64: idle slots repeat a running row)."""
        width = history.tokens.shape[1]  # the batch's max_length <= W
        self.tokens.zero_()
        self.tokens[:, :width] = history.tokens.index_select(0, src)
        self.pad_lengths.zero_()
        if history.pad_lengths is not None:
            self.pad_lengths.copy_(history.pad_lengths.index_select(0, src))
        if self.keys is not None and keys is not None:
            self.keys.zero_()
            self.keys[:, : width + 1] = keys.index_select(0, src)

    def buffers(self) -> list[Tensor]:
        return [self.tokens] if self.keys is None else [self.tokens, self.keys]


def _column_mask(ids: Tensor | None, vocab: int, device: torch.device) -> Tensor | None:
    """[V] bool: True at ``ids`` ([I] int64, in the vocabulary); ``None`` for none."""
    if ids is None:
        return None
    return torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)


def _forced_row(ids: Tensor | None, vocab: int, device: torch.device) -> Tensor | None:
    """[V] float32: 0 at ``ids``, -inf elsewhere (a forced token's scores); ``None`` for none."""
    if ids is None:
        return None
    return torch.full((vocab,), NEG_INF, device=device).index_fill_(0, ids, 0.0)


@dataclass(eq=False)
class SlotProcessors:
    """The processors of one slot search, as device constants (built once per kept slot state): what runs is
    what is not ``None`` (or, for the penalty, not 1)."""

    vocab: int
    penalty: float  # repetition penalty; 1.0: none
    inverse: float  # 1 / penalty in float32 (CUDA's division by a Python float; see beam._divide)
    reciprocal: bool  # divide as CUDA does
    ids_in_vocab: bool  # no history id >= V: the in-place repetition penalty
    ngram: int  # no_repeat_ngram_size; 0: none
    powers: Tensor | None  # [n-1] int64: V ** (n-2-k), packed keys (None: columns compared)
    bad_groups: list[tuple[Tensor, Tensor]]  # per prefix length: prefixes [G, P], last tokens [G]
    bad: Tensor | None  # [V] bool: single-token bad words
    eos: Tensor | None  # [V] bool: EOS, banned below the min length
    bos_row: Tensor | None  # [V] float32: scores at position 1 (forced BOS)
    eos_row: Tensor | None  # [V] float32: scores at max_length - 1 (forced EOS)
    suppress: Tensor | None  # [V] bool
    begin: Tensor | None  # [V] bool: suppressed at begin_index
    renormalize: bool

    @classmethod
    def build(cls, pipeline: LogitsPipeline, vocab: int, device: torch.device) -> SlotProcessors:
        """From the dynamic pipeline of the batch that allocates the kept state (its ids, its keys' packing)."""
        s, p = pipeline.settings, pipeline
        bad = p.bad_words
        inverse = float(float32_inverse([s.repetition_penalty])[0])
        return cls(
            vocab=vocab,
            penalty=s.repetition_penalty,
            inverse=inverse,
            reciprocal=device.type == "cuda",
            ids_in_vocab=p.ids_in_vocab,
            ngram=s.no_repeat_ngram_size,
            powers=None if p.ngram is None else p.ngram.powers,
            bad_groups=[] if bad is None else bad.groups,
            bad=None if bad is None else _column_mask(bad.static, vocab, device),
            eos=_column_mask(p.eos_ids, vocab, device),
            bos_row=None
            if s.forced_bos is None
            else _forced_row(_ids([s.forced_bos], device), vocab, device),
            eos_row=_forced_row(p.forced_eos_ids, vocab, device),
            suppress=_column_mask(p.suppress_ids, vocab, device),
            begin=_column_mask(p.begin_suppress_ids, vocab, device),
            renormalize=s.renormalize_logits,
        )


def float32_inverse(values: list[float]) -> Tensor:
    """``1 / values`` in float32, correctly rounded (on the host): what CUDA multiplies by when eager torch
    divides a float32 tensor by a Python float (``beam._divide``)."""
    return torch.ones(len(values), dtype=torch.float32) / torch.tensor(values, dtype=torch.float32)


def _ids(tokens: list[int], device: torch.device) -> Tensor:
    return torch.tensor(tokens, dtype=torch.long, device=device)


def repetition_penalty(p: SlotProcessors, h: SlotHistory, length: Tensor, scores: Tensor) -> Tensor:
    """``processors.repetition_penalty`` over the filled columns ``[pad, length)`` of each row; the others point
    at the row's last token (duplicates carry the same value) or, with ids beyond the vocabulary, at a spare
    column. ``scores``: [N, V]."""
    n, vocab = scores.shape
    ids, cols = h.tokens, h.cols[: h.tokens.shape[1]]
    filled = (cols[None, :] >= h.pad_lengths[:, None]) & (cols[None, :] < length)  # [N, W]
    if p.ids_in_vocab:
        last = h.tokens.gather(1, (length - 1).view(1, 1).expand(n, 1))  # [N, 1]
        ids = torch.where(filled, ids, last)
        picked = torch.gather(scores, 1, ids)
        return scores.scatter(1, ids, _penalised(p, picked))
    ids = torch.where(filled, ids.clamp(max=vocab), vocab)  # ids beyond the lm head go to the spare column
    padded = torch.nn.functional.pad(scores, (0, 1))  # [N, V + 1]
    picked = torch.gather(padded, 1, ids)
    return padded.scatter(1, ids, _penalised(p, picked))[:, :vocab]


def _penalised(p: SlotProcessors, picked: Tensor) -> Tensor:
    divided = picked * p.inverse if p.reciprocal else picked / p.penalty
    return torch.where(picked < 0, picked * p.penalty, divided)


def ngram_ban(
    p: SlotProcessors, h: SlotHistory, length: Tensor, scores: Tensor, skip: Tensor | None = None
) -> Tensor:
    """``NGramBlocker.__call__`` over every window start (those at or past ``length - n + 1`` masked): bans the
    tokens that would complete an n-gram already in the row (none where ``skip``, a 0-d bool). ``scores``: [N, V]."""
    n, tokens = p.ngram, h.tokens
    rows, width = tokens.shape
    windows = length - n + 1  # [] complete n-grams in the history
    starts = h.cols[: width - n + 1]  # [W'] every window that fits
    if h.keys is not None:
        current = h.keys.gather(1, windows.clamp(min=0).view(1, 1).expand(rows, 1))  # [N, 1]
        matches = h.keys[:, : width - n + 1] == current  # [N, W']
    else:
        at = (windows + h.cols[: n - 1]).clamp(min=0)  # [n-1] the last n-1 tokens
        prefix = tokens.gather(1, at[None, :].expand(rows, n - 1))  # [N, n-1]
        grams = tokens[:, : width - 1].unfold(1, n - 1, 1)[:, : width - n + 1]  # [N, W', n-1]
        matches = (grams == prefix[:, None, :]).all(-1)
    banned = tokens[:, n - 1 :]  # [N, W']: the token completing window j
    ban = _unless(matches & (starts < windows) & (banned < p.vocab), skip)
    values = torch.where(ban, NEG_INF, POS_INF)  # [N, W'] float32
    return scores.scatter_reduce(1, banned.clamp(max=p.vocab - 1), values, reduce="amin")


def bad_sequences(
    p: SlotProcessors, h: SlotHistory, length: Tensor, scores: Tensor, skip: Tensor | None = None
) -> Tensor:
    """``BadWords``' multi-token entries: ban the last token of every entry whose prefix ends the row (none where
    ``skip``, a 0-d bool)."""
    rows = h.tokens.shape[0]
    for prefixes, last in p.bad_groups:  # [G, P], [G]
        width = prefixes.shape[1]
        at = (length - width + h.cols[:width]).clamp(min=0)  # [P] the last P columns
        suffix = h.tokens.gather(1, at[None, :].expand(rows, width))  # [N, P]
        matches = _unless((suffix[:, None, :] == prefixes[None]).all(-1) & (length >= width), skip)  # [N, G]
        values = torch.where(matches, NEG_INF, POS_INF)
        scores = scores.scatter_reduce(1, last.expand(matches.shape), values, reduce="amin")
    return scores


def process(p: SlotProcessors, h: SlotHistory, lim: SlotLimits, scores: Tensor) -> Tensor:
    """``LogitsPipeline.__call__`` (beam search: no warpers) in its order: ``scores`` [N, V] float32 -> processed."""
    length = lim.prompt_len + lim.t  # [] cur_len
    if p.penalty != 1.0:
        scores = repetition_penalty(p, h, length, scores)
    scores = sparse_bans(p, h, lim, scores, skip=None)
    scores = column_processors(p, lim, scores)
    return torch.log_softmax(scores, dim=-1) if p.renormalize else scores


def sparse_bans(
    p: SlotProcessors, h: SlotHistory, lim: SlotLimits, scores: Tensor, skip: Tensor | None
) -> Tensor:
    """The no-repeat n-gram and bad-word-sequence bans (a scatter of -inf into ``scores`` [N, V], none where
    ``skip``)."""
    length = lim.prompt_len + lim.t
    if p.ngram > 0:
        scores = ngram_ban(p, h, length, scores, skip)
    return bad_sequences(p, h, length, scores, skip)


def column_processors(p: SlotProcessors, lim: SlotLimits, scores: Tensor) -> Tensor:
    """The processors that act on whole columns, in transformers' order: single-token bad words, min length,
    forced BOS / EOS, suppressed tokens. ``scores`` [N, V] -> [N, V], one elementwise pass (compiled)."""
    length = lim.prompt_len + lim.t
    before = _either(p.bad, None if p.eos is None else p.eos & (length < lim.min_length))
    if before is not None:
        scores = torch.where(before, NEG_INF, scores)
    if p.bos_row is not None:
        scores = torch.where(length == 1, p.bos_row, scores)
    if p.eos_row is not None:
        scores = torch.where(length == lim.max_length - 1, p.eos_row, scores)
    after = _either(p.suppress, None if p.begin is None else p.begin & (length == lim.begin_index))
    if after is not None:
        scores = torch.where(after, NEG_INF, scores)
    return scores


def forced(p: SlotProcessors, lim: SlotLimits) -> Tensor | None:
    """[] bool: this step forces a token (BOS at position 1, EOS at ``max_length - 1``): its row replaces every
    ban before it; ``None``: never."""
    length = lim.prompt_len + lim.t
    bos = None if p.bos_row is None else length == 1
    return _either(bos, None if p.eos_row is None else length == lim.max_length - 1)


def process_split(p: SlotProcessors, h: SlotHistory, lim: SlotLimits, scores: Tensor, add: Tensor) -> Tensor:
    """``process`` then ``+ add`` (each beam's running score, broadcast over [N, V]) for a pipeline without
    ``renormalize_logits``, in an order that compiles into one pass over ``scores``: the repetition penalty, the
    column processors and the add first, the sparse bans (-inf: ``-inf + add`` is ``-inf``, and the bans commute
    with the column bans) last, except at a forced step (the forced row replaces them). The same values."""
    length = lim.prompt_len + lim.t
    if p.penalty != 1.0:
        scores = repetition_penalty(p, h, length, scores)
    scores = column_processors(p, lim, scores) + add
    return sparse_bans(p, h, lim, scores, forced(p, lim))


def _unless(ban: Tensor, skip: Tensor | None) -> Tensor:
    return ban if skip is None else ban & ~skip


def _either(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return a | b


def append(p: SlotProcessors, h: SlotHistory, rows: Tensor, tokens: Tensor, length: Tensor) -> list[Tensor]:
    """The history after beam reordering (row ``i`` continues ``rows[i]``, [N]) and one more token per row
    (``tokens`` [N] at column ``length``), with the (n-1)-gram that completes: new ``[tokens, keys]`` buffers."""
    hist = h.tokens.index_select(0, rows)
    hist = torch.where(h.cols[: hist.shape[1]] == length, tokens[:, None], hist)  # [N, W]
    if h.keys is None:
        return [hist]
    keys = h.keys.index_select(0, rows)  # [N, W + 1]
    if p.ngram > 1 and p.powers is not None:
        n = p.ngram
        start = length + 2 - n  # [] the (n-1)-gram ending with the new token
        at = (start + h.cols[: n - 1]).clamp(0, hist.shape[1] - 1)  # [n-1]
        key = (hist.gather(1, at[None, :].expand(hist.shape[0], n - 1)) * p.powers).sum(-1)  # [N]
        keys = torch.where((h.cols == start) & (start >= 0), key[:, None], keys)
    return [hist, keys]
