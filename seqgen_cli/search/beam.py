"""Vectorised beam search with transformers v5 semantics (``GenerationMixin._beam_search``).

Every step is a fixed set of tensor ops over ``[B, K]`` / ``[B, C]`` (``K = num_beams``,
``C = max(2, 1 + n_eos) * K`` candidates), identical in arithmetic and order to transformers' helpers, whose
names the steps here carry (``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
``_update_finished_beams``, ``_check_early_stop_heuristic``), so scores and tie-breaking match bit for bit.

Differences that do not change results:

* finished hypotheses keep only their generated tokens ([B, K, T]) and their length, not the prompt;
* an input is *done* once ``early_stopping`` is True and all its K slots are finished, or once the early-stop
  heuristic says no running beam can beat its worst finished one. From then on transformers keeps stepping
  it, but every new candidate carries a -1e9 penalty, so its finished set can no longer change. seqgen drops
  a done input (rows, cache, search state) at the next host check (``rows.default_sync_every``);
* the cross-attention cache is not reordered (rows of one input share it; backend's business).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from seqgen_cli.search.rows import Leaving, Rows
from seqgen_cli.search.settings import SearchSettings

BIG = -1.0e9  # transformers' "impossible" score
CHUNK = 128  # columns per chunk in :func:`wide_topk`


def wide_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores, k)`` (sorted) over the last dimension of a wide [B, M] tensor, via the chunks of
    ``CHUNK`` columns with the ``k`` largest maxima: one max pass, then a top-k over ``k * CHUNK`` columns.

    Same values as ``torch.topk``: an element of any other chunk is at most the k-th largest chunk maximum,
    itself at most the k-th largest element, so only equal values can trade places (torch leaves the order of
    ties unspecified too). ~4x cheaper than ``torch.topk`` over [32, 4 x 55k] on the CPU (docs/BENCHMARKS.md,
    "CPU float32: what the step does, and what each choice measured").
    """
    b, m = scores.shape
    if m < k * CHUNK:  # fewer than k full chunks
        return torch.topk(scores, k)
    full = m // CHUNK * CHUNK
    maxima = scores[:, :full].view(b, full // CHUNK, CHUNK).amax(-1)  # [B, M // CHUNK]
    if full < m:  # the last, shorter chunk
        maxima = torch.cat((maxima, scores[:, full:].amax(-1, keepdim=True)), dim=1)
    chunks = torch.topk(maxima, k, sorted=False).indices  # [B, k]
    cols = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=scores.device)).view(b, k * CHUNK)
    picked = scores.gather(1, cols.clamp(max=m - 1)).masked_fill_(cols >= m, float("-inf"))  # [B, k*CHUNK]
    values, pos = torch.topk(picked, k)
    return values, cols.gather(1, pos)  # [B, k], [B, k]


@dataclass
class BeamState:
    """The search state, one row per active input: transformers' ``running_beam_scores``, ``beam_scores``,
    ``is_sent_finished``, ``is_early_stop_heuristic_unsatisfied`` and ``sequences`` (here only the finished
    hypotheses' generated tokens and lengths)."""

    running_scores: torch.Tensor  # [B, K] float32: accumulated log-probs of the running beams
    beam_scores: torch.Tensor  # [B, K] float32: length-penalised scores of the finished hypotheses
    is_finished: torch.Tensor  # [B, K] bool: the slot holds a finished hypothesis
    heuristic_unsatisfied: torch.Tensor  # [B, 1] bool: a running beam may still beat the worst finished one
    fin_tokens: torch.Tensor  # [B, K, T] int64: generated tokens of the finished hypotheses
    fin_lengths: torch.Tensor  # [B, K] int64: their lengths

    @classmethod
    def start(cls, num_inputs: int, num_beams: int, total: int, device: torch.device) -> BeamState:
        """No finished hypothesis; only the first beam runs (the others score ``BIG``, so the first step's
        candidates all continue beam 0)."""
        shape = (num_inputs, num_beams)
        running_scores = torch.zeros(shape, dtype=torch.float, device=device)
        running_scores[:, 1:] = BIG
        return cls(
            running_scores=running_scores,
            beam_scores=torch.full(shape, BIG, dtype=torch.float, device=device),
            is_finished=torch.zeros(shape, dtype=torch.bool, device=device),
            heuristic_unsatisfied=torch.ones((num_inputs, 1), dtype=torch.bool, device=device),
            fin_tokens=torch.zeros((*shape, total), dtype=torch.long, device=device),
            fin_lengths=torch.zeros(shape, dtype=torch.long, device=device),
        )

    def done(self, early_stopping: bool | str) -> torch.Tensor:
        """[B] bool: inputs whose finished set can no longer change (``_beam_search_has_unfinished_sequences``
        per input): the heuristic says no running beam can win, or ``early_stopping`` and all K finished."""
        done = ~self.heuristic_unsatisfied[:, 0]
        if early_stopping is True:
            done = done | self.is_finished.all(dim=1)
        return done

    def keep(self, keep: torch.Tensor) -> None:
        """Keep active inputs ``keep`` ([B'] int64, ascending); the others left."""
        self.running_scores, self.beam_scores = self.running_scores[keep], self.beam_scores[keep]
        self.is_finished, self.heuristic_unsatisfied = (
            self.is_finished[keep],
            self.heuristic_unsatisfied[keep],
        )
        self.fin_tokens, self.fin_lengths = self.fin_tokens[keep], self.fin_lengths[keep]

    def best(self, inputs: torch.Tensor, n: int) -> tuple[list[list[list[int]]], list[list[float]]]:
        """The ``n`` best finished hypotheses of active inputs ``inputs`` ([D] int64) and their scores, copied to
        the host: only after a host check or the loop (``Rows.check``, ``Rows.remaining``)."""
        tokens = self.fin_tokens.index_select(0, inputs)[:, :n].tolist()
        lengths = self.fin_lengths.index_select(0, inputs)[:, :n].tolist()
        scores = self.beam_scores.index_select(0, inputs)[:, :n].tolist()
        sequences = [
            [toks[i][: lens[i]] for i in range(n)] for toks, lens in zip(tokens, lengths, strict=True)
        ]
        return sequences, scores


def _accumulated_log_probs(rows: Rows, logits: torch.Tensor, running_scores: torch.Tensor) -> torch.Tensor:
    """Log-probs, processed, plus each beam's running score: [N, V] -> [B, K * V].

    The search owns the logits, so the vocabulary-wide passes work in place (same arithmetic and bits, no
    [N, V] allocation per pass).
    """
    bsz, k = running_scores.shape
    log_probs = logits.float().contiguous()  # [N, V]
    torch.log_softmax(log_probs, dim=-1, out=log_probs)
    log_probs = rows.pipeline(rows.history, log_probs)
    vocab = log_probs.shape[-1]
    log_probs = log_probs.view(bsz, k, vocab).add_(running_scores[:, :, None])  # [B, K, V]
    return log_probs.reshape(bsz, k * vocab)


TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _get_top_k_continuations(
    accumulated_log_probs: torch.Tensor, beams_to_keep: int, num_beams: int, topk: TopK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``C = beams_to_keep`` best continuations over all beams: their scores, beams and tokens, [B, C] each."""
    vocab = accumulated_log_probs.shape[-1] // num_beams
    topk_log_probs, topk_indices = topk(accumulated_log_probs, beams_to_keep)
    return topk_log_probs, topk_indices // vocab, topk_indices % vocab


def _next_token_hits_stopping_criteria(
    topk_tokens: torch.Tensor, eos: torch.Tensor | None, last_step: bool
) -> torch.Tensor:
    """[B, C] bool: the candidate ends its sequence (``MaxLengthCriteria``, ``EosTokenCriteria``)."""
    if last_step:
        return torch.ones(topk_tokens.shape, dtype=torch.bool, device=topk_tokens.device)
    if eos is not None:
        return torch.isin(topk_tokens, eos)
    return torch.zeros(topk_tokens.shape, dtype=torch.bool, device=topk_tokens.device)


def _get_running_beams_for_next_iteration(
    topk_log_probs: torch.Tensor,
    topk_beams: torch.Tensor,
    topk_tokens: torch.Tensor,
    hits: torch.Tensor,
    num_beams: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best K candidates that did not end keep running: their scores, beams and tokens, [B, K] each."""
    topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * BIG
    next_indices = torch.topk(topk_running_log_probs, k=num_beams)[1]
    running_scores = torch.gather(topk_running_log_probs, 1, next_indices)
    return (
        running_scores,
        torch.gather(topk_beams, 1, next_indices),
        torch.gather(topk_tokens, 1, next_indices),
    )


def _divide(x: torch.Tensor, divisor: float | torch.Tensor, reciprocal: bool) -> torch.Tensor:
    """``x / divisor`` as eager torch computes a tensor over a Python float: on the CPU a division; on CUDA
    ``x * (1 / divisor)`` (ATen's CPU-scalar fast path), where ``reciprocal`` passes ``divisor`` already inverted
    in float32 (a compiled division on CUDA is not correctly rounded, a product is)."""
    return x * divisor if reciprocal else x / divisor


def _candidate_scores(
    topk_log_probs: torch.Tensor,
    divisor: float | torch.Tensor,
    beams_finished: torch.Tensor,
    heuristic_unsatisfied: torch.Tensor,
    did_top_num_beams_just_finish: torch.Tensor,
    early_stopping: bool | str,
    reciprocal: bool = False,
) -> torch.Tensor:
    """[B, C] length-penalised scores of the candidates that may enter the finished set (``BIG`` added to the
    others): ``divisor`` is ``(t + 1) ** length_penalty`` (see :func:`_divide`); ``beams_finished`` [B, K] bool."""
    candidate_scores = _divide(topk_log_probs, divisor, reciprocal)
    beams_full = torch.all(beams_finished, dim=-1, keepdim=True) & (early_stopping is True)
    candidate_scores += beams_full.to(torch.float32) * BIG
    candidate_scores += (~heuristic_unsatisfied).to(torch.float32) * BIG
    candidate_scores += (~did_top_num_beams_just_finish) * BIG
    return candidate_scores


def _merge_finished(
    beam_scores: torch.Tensor,
    is_finished: torch.Tensor,
    candidate_scores: torch.Tensor,
    did_top_num_beams_just_finish: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best K of [old K | C candidates]: ``chosen`` [B, K] into them, the new scores and finished flags."""
    k = beam_scores.shape[1]
    merged_scores = torch.cat((beam_scores, candidate_scores), dim=1)  # [B, K + C]
    chosen = torch.topk(merged_scores, k=k)[1]  # [B, K] into [old K | C candidates]
    merged_finished = torch.cat((is_finished, did_top_num_beams_just_finish), dim=1)
    return chosen, torch.gather(merged_scores, 1, chosen), torch.gather(merged_finished, 1, chosen)


def _update_finished_beams(
    beams: BeamState,
    generated: torch.Tensor,
    topk_log_probs: torch.Tensor,
    topk_beams: torch.Tensor,
    topk_tokens: torch.Tensor,
    did_top_num_beams_just_finish: torch.Tensor,
    t: int,
    settings: SearchSettings,
) -> None:
    """Merge the candidates that just ended into the finished set: the best K of [old K | C candidates].

    ``generated`` ([N, t]): the running rows' generated tokens before step ``t``; ``did_top_num_beams_just_finish``
    ([B, C] bool): the candidate ended and is among the top K.
    """
    candidate_scores = _candidate_scores(
        topk_log_probs,
        (t + 1) ** settings.length_penalty,
        beams.is_finished,
        beams.heuristic_unsatisfied,
        did_top_num_beams_just_finish,
        settings.early_stopping,
    )
    chosen, beams.beam_scores, beams.is_finished = _merge_finished(
        beams.beam_scores, beams.is_finished, candidate_scores, did_top_num_beams_just_finish
    )
    _gather_finished_sequences(beams, chosen, generated, topk_beams, topk_tokens, t)


def _select_finished(
    fin_tokens: torch.Tensor,
    fin_lengths: torch.Tensor,
    chosen: torch.Tensor,
    cand_tokens: torch.Tensor,
    length: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The finished slots' tokens [B, K, T] and lengths [B, K] after the merge: old slots keep theirs (``chosen``
    [B, K] < K), candidate slots take ``cand_tokens`` [B, K, T] and ``length`` (``t + 1``)."""
    k, total = fin_tokens.shape[1], fin_tokens.shape[2]
    from_candidate = chosen >= k  # [B, K]
    old = chosen.clamp(max=k - 1)
    tokens = torch.where(
        from_candidate[:, :, None],
        cand_tokens,
        torch.gather(fin_tokens, 1, old[:, :, None].expand(-1, -1, total)),
    )
    return tokens, torch.where(from_candidate, length, torch.gather(fin_lengths, 1, old))


def _candidate_rows(chosen: torch.Tensor, topk_beams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each finished slot after the merge (``chosen`` [B, K]): the candidate it would take (``cand`` [B, K],
    0 for old slots) and that candidate's row ([B * K])."""
    bsz, k = chosen.shape
    cand = (chosen - k).clamp(min=0)
    rows = torch.arange(bsz, device=chosen.device)[:, None] * k + torch.gather(topk_beams, 1, cand)
    return cand, rows.reshape(-1)


def _gather_finished_sequences(
    beams: BeamState,
    chosen: torch.Tensor,
    generated: torch.Tensor,
    topk_beams: torch.Tensor,
    topk_tokens: torch.Tensor,
    t: int,
) -> None:
    """The finished slots' tokens after the merge: old slots keep theirs, candidate slots copy their beam's
    generated tokens plus the new token. ``chosen``: [B, K] into [old K | C candidates]."""
    bsz, k, total = beams.fin_tokens.shape
    cand, cand_rows = _candidate_rows(chosen, topk_beams)  # [B, K], [B * K]
    cand_tokens = torch.zeros((bsz * k, total), dtype=torch.long, device=chosen.device)  # [B*K, T]
    cand_tokens[:, :t] = generated.index_select(0, cand_rows)
    cand_tokens[:, t] = torch.gather(topk_tokens, 1, cand).reshape(-1)
    beams.fin_tokens, beams.fin_lengths = _select_finished(
        beams.fin_tokens, beams.fin_lengths, chosen, cand_tokens.view(bsz, k, total), t + 1
    )


def _heuristic(
    running_scores: torch.Tensor,
    is_finished: torch.Tensor,
    beam_scores: torch.Tensor,
    heuristic_unsatisfied: torch.Tensor,
    divisor: float | torch.Tensor,
    reciprocal: bool = False,
) -> torch.Tensor:
    """[B, 1] bool: can the best running beam, scored with ``divisor`` (``best_length ** length_penalty``, see
    :func:`_divide`), still beat the worst finished hypothesis? Once unsatisfied, an input stays so."""
    best_running = _divide(running_scores[:, :1], divisor, reciprocal)
    worst_finished = torch.where(is_finished, torch.min(beam_scores, dim=1, keepdim=True)[0], BIG)
    return heuristic_unsatisfied & torch.any(best_running > worst_finished, dim=-1, keepdim=True)


def best_length(settings: SearchSettings, new_tokens: int) -> int:
    """The length the early-stop heuristic scores the best running beam at, ``new_tokens`` generated: with
    ``early_stopping="never"`` and a positive length penalty the most new tokens, else ``new_tokens``."""
    s = settings
    return s.max_new_tokens if s.early_stopping == "never" and s.length_penalty > 0.0 else new_tokens


def _check_early_stop_heuristic(beams: BeamState, cur_len: int, settings: SearchSettings) -> torch.Tensor:
    """[B, 1] bool: can a running beam still beat the worst finished hypothesis (after ``cur_len`` positions)?

    With ``early_stopping="never"`` and a positive length penalty the best running beam is scored at
    ``max_length``, otherwise at ``cur_len``; once unsatisfied, an input stays so.
    """
    divisor = best_length(settings, cur_len - settings.prompt_len) ** settings.length_penalty
    return _heuristic(
        beams.running_scores, beams.is_finished, beams.beam_scores, beams.heuristic_unsatisfied, divisor
    )


def _continue_running_beams(rows: Rows, next_beams: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Reorder the rows (history, processors, cache) to the beams that run on, then append their tokens.
    ``next_beams``, ``next_tokens``: [B, K]; returns the tokens [N] for the next model step."""
    bsz, k = next_beams.shape
    beam_rows = (torch.arange(bsz, device=next_beams.device)[:, None] * k + next_beams).reshape(-1)  # [N]
    rows.reorder(beam_rows)
    tokens = next_tokens.reshape(-1)  # [N]
    rows.history.append(tokens)
    rows.pipeline.appended(rows.history)
    return tokens


class BeamSearch:
    """Beam search over the inputs of ``rows``, one step per :meth:`advance`: transformers' loop body, so a batch
    (:func:`beam_search`) and a refill cohort (``search/refill.py``) run the same ops in the same order."""

    def __init__(self, rows: Rows, settings: SearchSettings, consts: BeamConstants, topk: TopK) -> None:
        self.rows, self.s, self.consts, self.topk = rows, settings, consts, topk
        device = consts.top_num_beam_mask.device
        self.beams = BeamState.start(len(rows.inputs), settings.num_beams, settings.max_new_tokens, device)
        self.t = 0  # steps done (host int)

    def advance(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Step ``t`` on the rows' next-token logits [N, V]: the tokens [N] to feed next, or ``None`` after the
        last step (every input done)."""
        s, k, c, beams, rows, t = self.s, self.s.num_beams, self.consts, self.beams, self.rows, self.t
        cur_len = s.prompt_len + t
        last_step = cur_len + 1 >= s.max_length
        log_probs = _accumulated_log_probs(rows, logits, beams.running_scores)  # [B, K * V]
        topk_log_probs, topk_beams, topk_tokens = _get_top_k_continuations(
            log_probs, c.beams_to_keep, k, self.topk
        )
        hits = _next_token_hits_stopping_criteria(topk_tokens, c.eos, last_step)  # [B, C]
        beams.running_scores, next_beams, next_tokens = _get_running_beams_for_next_iteration(
            topk_log_probs, topk_beams, topk_tokens, hits, k
        )
        did_finish = hits & c.top_num_beam_mask[None, :]  # only the top K candidates may finish
        generated = rows.history.generated
        _update_finished_beams(beams, generated, topk_log_probs, topk_beams, topk_tokens, did_finish, t, s)
        self.t += 1
        if last_step:
            return None
        beams.heuristic_unsatisfied = _check_early_stop_heuristic(beams, cur_len + 1, s)
        return _continue_running_beams(rows, next_beams, next_tokens)  # [N]

    def done(self) -> torch.Tensor:
        """[B] bool: inputs whose results can no longer change."""
        return self.beams.done(self.s.early_stopping)

    def results(self, idx: torch.Tensor) -> tuple[list[list[list[int]]], list[list[float]] | None]:
        """Sequences and scores of active inputs ``idx`` ([D] int64), on the host (after a check only)."""
        return self.beams.best(idx, self.s.num_return_sequences)

    def keep(self, leaving: Leaving) -> None:
        """Done inputs leave (``Rows.check``'s split)."""
        self.beams.keep(leaving.keep)
        self.rows.keep_inputs(leaving)


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
    """float32 CPU logits: top-k by chunks (equal values may trade places, which in float32 takes an exact tie);
    half-precision logits tie often, and transformers orders ties as torch.topk does."""
    return wide_topk if logits.device.type == "cpu" and logits.dtype == torch.float32 else torch.topk
