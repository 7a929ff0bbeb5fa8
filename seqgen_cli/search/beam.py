"""Vectorised beam search with transformers v5 semantics (``GenerationMixin._beam_search``).

Every step is a fixed set of tensor ops over ``[B, K]`` / ``[B, C]`` (``K = num_beams``,
``C = max(2, 1 + n_eos) * K`` candidates), identical in arithmetic and order to transformers' helpers, whose
names the steps here carry (``_update_finished_beams``, ``_check_early_stop_heuristic``; the arithmetic the
static search shares, ``get_top_k_continuations`` and the others, is in ``beam_step.py``), so scores and
tie-breaking match bit for bit.

Differences that do not change results:

* finished hypotheses keep only their generated tokens ([B, K, T]) and their length, not the prompt;
* an input is *done* once ``early_stopping`` is True and all its K places are finished, or once the early-stop
  heuristic says no running beam can beat its worst finished one. From then on transformers keeps stepping
  it, but every new candidate carries a -1e9 penalty, so its finished set can no longer change. seqgen drops
  a done input (rows, cache, search state) at the next host check (``rows.default_sync_every``);
* the cross-attention cache is not reordered (rows of one input share it; backend's business).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqgen_cli.search.beam_step import (
    BeamState,
    TopK,
    candidate_rows,
    candidate_scores,
    early_stop_heuristic,
    get_running_beams_for_next_iteration,
    get_top_k_continuations,
    merge_finished,
    pick,
    scored_at_most_tokens,
    select_finished,
)
from seqgen_cli.search.greedy import StopCheck
from seqgen_cli.search.protocol import SearchOutput
from seqgen_cli.search.rows import Leaving, Rows
from seqgen_cli.search.settings import SearchSettings

CHUNK = 128  # columns per chunk in :func:`wide_topk`


def wide_topk(scores: torch.Tensor, k: int, ties: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores, k)`` (sorted) over the last dimension of a wide [B, M] tensor, via the chunks of
    ``CHUNK`` columns with the ``k + 1`` largest maxima: one max pass, then a top-(k + 1) over ``(k + 1) * CHUNK``
    columns; in a row where two of those ``k + 1`` values are equal, ``torch.topk``'s order (:func:`topk_in_order`).

    The same values and indices as ``torch.topk``: those ``k + 1`` chunk maxima are elements of the picked columns,
    so the picked columns' (k + 1)-th largest value is at least every element of any other chunk. When the ``k + 1``
    largest picked values are all different, the ``k`` largest of the row are the picked ``k``, each strictly above
    every other element: no tie is left for ``torch.topk`` to order its own way. Else (a tie: often in half
    precision, rare in float32; a host check, free on the CPU) ``torch.topk`` orders the row's ties, run over only
    the chunks whose elements can change its result (:func:`topk_in_order`; docs/EXPERIMENTS.md, "bfloat16: tied
    top-k rows"). ~4x cheaper than ``torch.topk`` over [32, 4 x 55k] on the CPU (docs/EXPERIMENTS.md, "CPU float32:
    what the step does, and what each choice measured"). Its temporaries: :func:`wide_topk_bytes`.

    ``ties=False`` (the static step, compiled: nothing read on the host): no check, so where values are equal they
    may trade places (in float32 an exact tie).
    """
    b, m = scores.shape
    c = k + 1  # chunks picked: one past k, so the value after the k-th is known
    if m < c * CHUNK:  # fewer than k + 1 full chunks
        return torch.topk(scores, k)
    full = m // CHUNK * CHUNK
    maxima = scores[:, :full].view(b, full // CHUNK, CHUNK).amax(-1)  # [B, M // CHUNK]
    if full < m:  # the last, shorter chunk
        maxima = torch.cat((maxima, scores[:, full:].amax(-1, keepdim=True)), dim=1)
    chunks = torch.topk(maxima, c, sorted=False).indices  # [B, k + 1]
    cols = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=scores.device)).view(b, c * CHUNK)
    picked = scores.gather(1, cols.clamp(max=m - 1)).masked_fill_(cols >= m, float("-inf"))  # [B, (k+1)*CHUNK]
    top, pos = torch.topk(picked, c)  # [B, k + 1], sorted
    values, indices = top[:, :k], cols.gather(1, pos[:, :k])  # [B, k], [B, k]
    if not ties:
        return values, indices
    tied = (top[:, 1:] == top[:, :-1]).any(1).nonzero().view(-1)  # rows where two of the k + 1 are equal
    if tied.numel():  # torch.topk's order of equal values (rows are independent)
        values[tied], indices[tied] = topk_in_order(scores, maxima, tied, k)
    return values, indices


def wide_topk_bytes(k: int, columns: int, ties: bool = True) -> int:
    """Bytes :func:`wide_topk` makes per row of ``columns`` columns at most: the chunks' maxima, the picked chunks'
    columns and values and, with ``ties`` (the CPU, where rows that tie go to :func:`topk_in_order`), its per-chunk
    flags and indices and its reduced row at its widest (values, their copy, ``torch.topk``'s (value, index) pairs,
    the kept chunks' indices). Not counted: ``torch.topk``'s pairs over a row that goes whole, 16 B an element per
    thread at work, not per row."""
    chunks = -(-columns // CHUNK)
    tied = chunks * 24 + _widest(k, chunks) * (CHUNK * 24 + 64) if ties else 0
    return chunks * 4 + (k + 1) * CHUNK * 12 + tied


def _fewest(k: int) -> int:
    """Chunks of a reduced row at least: the ``64 k`` columns that keep torch's top-k on ``partial_sort``."""
    return -(-64 * k // CHUNK)


def _widest(k: int, chunks: int) -> int:
    """Chunks :func:`topk_in_order` reduces a row to at most (past it, the whole row): an eighth of them, or
    :func:`_fewest`."""
    return max(_fewest(k), chunks // 8)


def topk_in_order(
    scores: torch.Tensor, maxima: torch.Tensor, rows: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores[rows], k)`` on the CPU, its order of equal values included, over only the chunks whose
    elements can enter its heap: ``scores`` [B, M] (``M >= 64 k``), ``maxima`` its chunks' maxima [B, C] (``CHUNK``
    columns each, the last maybe fewer), ``rows`` [T] -> values, indices [T, k].

    On a row of at least ``64 k`` elements torch's CPU top-k is ``std::partial_sort``: a heap of the first ``k``
    elements, then each later one, in order, replaces the heap's top (its smallest) where strictly larger; the heap
    is sorted at the end. An element that does not enter leaves the heap as it was, so the row without it gives the
    same values and, mapped back, the same indices. No element of a chunk enters when the chunk's maximum is at most
    the ``k``-th largest maximum of chunks before it (elements before it: a floor under the heap's top). Kept, in
    order: the chunks of the first ``k`` elements and each chunk above the floor of the chunks before the last power
    of two (from ``k``) at or below its index, about ``k`` per doubling; then ``-inf`` (it never enters) up to ``64 k``
    columns, so torch takes ``partial_sort`` again (``test_topk_in_order_is_torch_topk_over_rows_full_of_ties``
    holds it to ``torch.topk``). A row that keeps more than :func:`_widest` chunks, or holds a NaN (largest to
    torch, hidden by the chunk comparisons), goes whole to ``torch.topk`` (a view: no copy)."""
    t, c = rows.numel(), maxima.shape[1]
    mx = maxima.index_select(0, rows)  # [T, C]
    floor = torch.full_like(mx, float("-inf"))
    at = k
    while at < c:  # chunks [at, 2 at): the k-th largest maximum of chunks [0, at)
        floor[:, at : 2 * at] = torch.topk(mx[:, :at], k, sorted=False).values.amin(1, keepdim=True)
        at *= 2
    keep = mx > floor  # [T, C]
    keep[:, : -(-k // CHUNK)] = True  # the chunks of the first k elements: the heap they start
    whole = (keep.sum(1) > _widest(k, c)) | mx.isnan().any(1)  # [T]
    if not whole.any():
        return _topk_of_chunks(scores, rows, keep, k)
    values = scores.new_empty((t, k))
    indices = torch.empty((t, k), dtype=torch.long, device=rows.device)
    for i in whole.nonzero().view(-1).tolist():  # a view of the row: no copy
        values[i], indices[i] = torch.topk(scores[rows[i]], k)
    rest = (~whole).nonzero().view(-1)
    if rest.numel():
        values[rest], indices[rest] = _topk_of_chunks(scores, rows[rest], keep[rest], k)
    return values, indices


def _topk_of_chunks(
    scores: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` over each of ``rows``' kept chunks (``keep`` [T, C]), in order, then ``-inf`` up to the
    widest row's chunks and at least ``64 k`` columns -> values, indices [T, k] in the whole row."""
    t, m = rows.numel(), scores.shape[1]
    counts = keep.sum(1)  # [T]
    width = max(int(counts.max()), _fewest(k))  # chunks per reduced row
    row, chunk = keep.nonzero(as_tuple=True)  # [n]: row by row, each row's chunks in order
    slot = torch.arange(row.numel(), device=row.device) - (counts.cumsum(0) - counts)[row]  # its place in its row
    reduced = scores.new_full((t, width, CHUNK), float("-inf"))  # [T, width, CHUNK]
    full = m // CHUNK  # whole chunks
    source, whole_chunk = rows[row], chunk < full
    reduced[row[whole_chunk], slot[whole_chunk]] = scores[:, : full * CHUNK].view(-1, full, CHUNK)[
        source[whole_chunk], chunk[whole_chunk]
    ]  # [n', CHUNK]
    last = (~whole_chunk).nonzero().view(-1)  # the shorter last chunk, where kept: its columns, then -inf
    reduced[row[last], slot[last], : m - full * CHUNK] = scores[source[last], full * CHUNK :]
    chunk_of = torch.zeros((t, width), dtype=torch.long, device=row.device)  # [T, width]: each slot's chunk
    chunk_of[row, slot] = chunk
    values, at_reduced = torch.topk(reduced.view(t, width * CHUNK), k)  # [T, k]
    return values, chunk_of.gather(1, at_reduced // CHUNK) * CHUNK + at_reduced % CHUNK


def _accumulated_log_probs(
    rows: Rows, logits: torch.Tensor, running_scores: torch.Tensor, keep: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs, processed, plus each beam's running score: [N, V] -> [B, K * V]; ``keep``: the processed
    log-probs too, [B, K * V], before the running scores are added (each token's own: ``--scores``).

    The search owns the logits, so the vocabulary-wide passes work in place (same arithmetic and bits, no
    [N, V] allocation per pass).
    """
    bsz, k = running_scores.shape
    log_probs = logits.float().contiguous()  # [N, V]
    torch.log_softmax(log_probs, dim=-1, out=log_probs)
    log_probs = rows.pipeline(rows.history, log_probs)
    vocab = log_probs.shape[-1]
    log_probs = log_probs.view(bsz, k, vocab)  # [B, K, V]
    if keep:  # the same sum, out of place: the processed log-probs stay
        return (log_probs + running_scores[:, :, None]).reshape(bsz, k * vocab), log_probs.reshape(bsz, k * vocab)
    return log_probs.add_(running_scores[:, :, None]).reshape(bsz, k * vocab), None


def _next_token_hits_stopping_criteria(
    topk_tokens: torch.Tensor, eos: torch.Tensor | None, last_step: bool
) -> torch.Tensor:
    """[B, C] bool: the candidate ends its sequence (``MaxLengthCriteria``, ``EosTokenCriteria``)."""
    if last_step:
        return torch.ones(topk_tokens.shape, dtype=torch.bool, device=topk_tokens.device)
    if eos is not None:
        return torch.isin(topk_tokens, eos)
    return torch.zeros(topk_tokens.shape, dtype=torch.bool, device=topk_tokens.device)


def _stop_string_hits(
    stop: StopCheck, rows: Rows, topk_beams: torch.Tensor, topk_tokens: torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """[B, C] bool: the candidate's text now ends in a stop string (transformers' ``stopping_criteria`` over
    ``topk_running_sequences``: its beam's tokens, prompt included, then its new token)."""
    bsz, c = topk_tokens.shape
    k = rows.rows_per_input
    parents = (torch.arange(bsz, device=topk_beams.device)[:, None] * k + topk_beams).reshape(-1)  # [B * C] rows
    sequences = torch.cat((rows.history.filled.index_select(0, parents), topk_tokens.reshape(-1, 1)), dim=1)
    return stop(sequences, scores).view(bsz, c)  # [B * C, L + 1] -> [B, C]


def _update_finished_beams(
    beams: BeamState,
    generated: torch.Tensor,
    topk_log_probs: torch.Tensor,
    topk_beams: torch.Tensor,
    topk_tokens: torch.Tensor,
    did_top_num_beams_just_finish: torch.Tensor,
    t: int,
    settings: SearchSettings,
    records: tuple[TokenRecords, TokenRecords] | None = None,
) -> None:
    """Merge the candidates that just ended into the finished set: the best K of [old K | C candidates].

    ``generated`` ([N, t]): the running rows' generated tokens before step ``t``; ``did_top_num_beams_just_finish``
    ([B, C] bool): the candidate ended and is among the top K; ``records``: the running rows' per-token records
    [N, T, ...] and the candidates' new token's [B, C, ...] (where the finished ones keep theirs).
    """
    scores = candidate_scores(
        topk_log_probs,
        (t + 1) ** settings.length_penalty,
        beams.is_finished,
        beams.heuristic_unsatisfied,
        did_top_num_beams_just_finish,
        settings.early_stopping,
    )
    chosen, beams.beam_scores, beams.is_finished = merge_finished(
        beams.beam_scores, beams.is_finished, scores, did_top_num_beams_just_finish
    )
    _gather_finished_sequences(beams, chosen, generated, topk_beams, topk_tokens, t, records)


def _gather_finished_sequences(
    beams: BeamState,
    chosen: torch.Tensor,
    generated: torch.Tensor,
    topk_beams: torch.Tensor,
    topk_tokens: torch.Tensor,
    t: int,
    records: tuple[TokenRecords, TokenRecords] | None = None,
) -> None:
    """The finished places' tokens after the merge: old places keep theirs, candidate places copy their beam's
    generated tokens plus the new token (and, with ``records``, their records). ``chosen``: [B, K] into
    [old K | C candidates]."""
    bsz, k, total = beams.fin_tokens.shape
    cand, cand_rows = candidate_rows(chosen, topk_beams)  # [B, K], [B * K]
    cand_tokens = torch.zeros((bsz * k, total), dtype=torch.long, device=chosen.device)  # [B*K, T]
    cand_tokens[:, :t] = generated.index_select(0, cand_rows)
    cand_tokens[:, t] = torch.gather(topk_tokens, 1, cand).reshape(-1)
    old = beams.fin_lengths
    beams.fin_tokens, beams.fin_lengths = select_finished(
        beams.fin_tokens, old, chosen, cand_tokens.view(bsz, k, total), t + 1
    )
    if records is not None:
        running, new = records  # name -> [N, T, ...], name -> [B, C, ...]
        for name, x in running.items():
            kept = x.index_select(0, cand_rows)  # [B*K, T, ...]: the beam's tokens' so far
            kept[:, t] = pick(new[name], cand).reshape(bsz * k, *x.shape[2:])
            beams.fin_records[name] = select_finished(
                beams.fin_records[name], old, chosen, kept.view(bsz, k, *x.shape[1:]), t + 1
            )[0]


def best_length(settings: SearchSettings, new_tokens: int) -> int:
    """The length the early-stop heuristic scores the best running beam at, ``new_tokens`` generated: with
    ``early_stopping="never"`` and a positive length penalty the most new tokens, else ``new_tokens``."""
    return settings.max_new_tokens if scored_at_most_tokens(settings) else new_tokens


def _check_early_stop_heuristic(beams: BeamState, cur_len: int, settings: SearchSettings) -> torch.Tensor:
    """[B, 1] bool: can a running beam still beat the worst finished hypothesis (after ``cur_len`` positions)?

    With ``early_stopping="never"`` and a positive length penalty the best running beam is scored at
    ``max_length``, otherwise at ``cur_len``; once unsatisfied, an input stays so.
    """
    divisor = best_length(settings, cur_len - settings.prompt_len) ** settings.length_penalty
    return early_stop_heuristic(
        beams.running_scores, beams.is_finished, beams.beam_scores, beams.heuristic_unsatisfied, divisor
    )


# What a beam search keeps of each token, per running row [N, T, ...] (and per finished hypothesis, BeamState):
# "scores" (--scores: its processed log-prob), "raw" (--logprobs: its raw log-prob), "best" and "best_ids" (--logprobs
# N: the step's N best raw log-probs and their ids)
TokenRecords = dict[str, torch.Tensor]


def _records(settings: SearchSettings, rows: int, device: torch.device) -> TokenRecords:
    """The records ``settings`` ask for, zeros: [N, T] or [N, T, N best]."""
    t, best = settings.max_new_tokens, settings.logprobs
    records = {"scores": torch.zeros(rows, t, device=device)} if settings.scores else {}
    if best is not None:
        records["raw"] = torch.zeros(rows, t, device=device)
    if best:
        records["best"] = torch.zeros(rows, t, best, device=device)
        records["best_ids"] = torch.zeros(rows, t, best, dtype=torch.long, device=device)
    return records


def _at(step: TokenRecords, beams: torch.Tensor, tokens: torch.Tensor, vocab: int) -> TokenRecords:
    """Each record's value for the continuations ``beams``/``tokens`` [B, X]: of a vocabulary-wide one
    ([B, K * V]) at the token, of a beam-wide one ([B, K, ...]) at the beam: [B, X, ...]."""
    return {n: x.gather(1, beams * vocab + tokens) if x.dim() == 2 else pick(x, beams) for n, x in step.items()}


def _beam_rows(next_beams: torch.Tensor) -> torch.Tensor:
    """The row each running beam continues: ``next_beams`` [B, K] (beams within an input) -> [N] rows."""
    bsz, k = next_beams.shape
    return (torch.arange(bsz, device=next_beams.device)[:, None] * k + next_beams).reshape(-1)


def _continue_running_beams(rows: Rows, beam_rows: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Reorder the rows (history, processors, cache) to the beams that run on (``beam_rows`` [N], :func:`_beam_rows`),
    then append their tokens (``next_tokens`` [B, K]); returns the tokens [N] for the next model step."""
    rows.reorder(beam_rows)
    tokens = next_tokens.reshape(-1)  # [N]
    rows.history.append(tokens)
    rows.pipeline.appended(rows.history)
    return tokens


class BeamSearch:
    """Beam search over the inputs of ``rows``, one step per :meth:`advance`: transformers' loop body, so a batch
    (:func:`beam_search`) and a refill cohort (``search/refill.py``) run the same ops in the same order."""

    def __init__(
        self, rows: Rows, settings: SearchSettings, consts: BeamConstants, topk: TopK, stop: StopCheck | None = None
    ) -> None:
        self.rows, self.s, self.consts, self.topk, self.stop = rows, settings, consts, topk, stop
        device = consts.top_num_beam_mask.device
        # each running row's tokens' records (--scores, --logprobs), reordered with the beams
        self.records = _records(settings, len(rows.inputs) * settings.num_beams, device)
        self.beams = BeamState.start(
            len(rows.inputs), settings.num_beams, settings.max_new_tokens, device, self.records
        )
        self.t = 0  # steps done (host int)

    def advance(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Step ``t`` on the rows' next-token logits [N, V]: the tokens [N] to feed next, or ``None`` after the
        last step (every input done)."""
        s, k, c, beams, rows, t = self.s, self.s.num_beams, self.consts, self.beams, self.rows, self.t
        cur_len = s.prompt_len + t
        last_step = cur_len + 1 >= s.max_length
        raw = logits.float().log_softmax(dim=-1) if "raw" in self.records else None  # [N, V], before processors
        keep = "scores" in self.records
        log_probs, processed = _accumulated_log_probs(rows, logits, beams.running_scores, keep)  # [B, K * V]
        topk_log_probs, topk_beams, topk_tokens = get_top_k_continuations(
            log_probs, c.beams_to_keep, k, self.topk
        )
        hits = _next_token_hits_stopping_criteria(topk_tokens, c.eos, last_step)  # [B, C]
        if self.stop is not None and not last_step:  # a stop string ends a candidate as EOS does
            hits = hits | _stop_string_hits(self.stop, rows, topk_beams, topk_tokens, log_probs)
        beams.running_scores, next_beams, next_tokens = get_running_beams_for_next_iteration(
            topk_log_probs, topk_beams, topk_tokens, hits, k
        )
        did_finish = hits & c.top_num_beam_mask[None, :]  # only the top K candidates may finish
        generated, vocab = rows.history.generated, log_probs.shape[1] // k
        step = self._step_records(processed, raw, log_probs.shape[0], k)
        own = (self.records, _at(step, topk_beams, topk_tokens, vocab)) if step else None  # the candidates'
        _update_finished_beams(beams, generated, topk_log_probs, topk_beams, topk_tokens, did_finish, t, s, own)
        self.t += 1
        if last_step:
            return None
        beams.heuristic_unsatisfied = _check_early_stop_heuristic(beams, cur_len + 1, s)
        beam_rows = _beam_rows(next_beams)  # [N]
        running = _at(step, next_beams, next_tokens, vocab)  # the rows that run on, as the history moves
        for name, x in self.records.items():
            x = x.index_select(0, beam_rows)  # [N, T, ...]
            x[:, t] = running[name].reshape(x.shape[0], *x.shape[2:])
            self.records[name] = x
        return _continue_running_beams(rows, beam_rows, next_tokens)  # [N]

    def _step_records(
        self, processed: torch.Tensor | None, raw: torch.Tensor | None, bsz: int, k: int
    ) -> TokenRecords:
        """This step's values of the records kept: the processed log-probs [B, K * V], the raw ones [B, K * V]
        and each row's best [B, K, N best] (values and ids)."""
        step = {"scores": processed} if processed is not None else {}
        if raw is not None:
            step["raw"] = raw.view(bsz, -1)  # [N, V] -> [B, K * V]
            if "best" in self.records:
                values, ids = torch.topk(raw, self.records["best"].shape[2], dim=-1)  # [N, N best]
                step["best"], step["best_ids"] = values.view(bsz, k, -1), ids.view(bsz, k, -1)
        return step

    def done(self) -> torch.Tensor:
        """[B] bool: inputs whose results can no longer change."""
        return self.beams.done(self.s.early_stopping)

    def results(self, idx: torch.Tensor) -> SearchOutput:
        """Sequences and scores of active inputs ``idx`` ([D] int64), on the host (after a check only)."""
        return self.beams.best(idx, self.s.num_return_sequences)

    def keep(self, leaving: Leaving) -> None:
        """Done inputs leave (``Rows.check``'s split)."""
        self.beams.keep(leaving.keep)
        self.records = {name: x[leaving.kept_rows] for name, x in self.records.items()}
        self.rows.keep(leaving)


@dataclass(frozen=True)
class BeamConstants:
    """Device constants of a search (the EOS ids; for beam search its candidate mask), built before its first
    step is queued."""

    beams_to_keep: int  # C: enough candidates that K survive when the top K all end
    eos: torch.Tensor | None  # [E] int64
    top_num_beam_mask: torch.Tensor  # [C] bool: the first K candidates

    @classmethod
    def build(cls, settings: SearchSettings, device: torch.device) -> BeamConstants:
        s, k = settings, settings.num_beams
        beams_to_keep = max(2, 1 + len(s.eos)) * k
        eos = torch.tensor(s.eos, dtype=torch.long, device=device) if s.eos else None
        mask = torch.cat(
            (
                torch.ones(k, dtype=torch.bool, device=device),
                torch.zeros(beams_to_keep - k, dtype=torch.bool, device=device),
            )
        )  # [C]
        return cls(beams_to_keep, eos, mask)


def pick_topk(logits: torch.Tensor) -> TopK:
    """CPU logits (any dtype): top-k by chunks (:func:`wide_topk`, ``torch.topk``'s result, ties included); on a GPU
    ``torch.topk`` itself (its tie check would wait for the device)."""
    return wide_topk if logits.device.type == "cpu" else torch.topk
