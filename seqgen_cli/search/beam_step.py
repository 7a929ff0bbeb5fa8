"""The arithmetic of one beam-search step, shared by both searches: ``beam.BeamSearch`` (the dynamic one, rows that
leave) and ``static.static_beam_step`` (the static one, fixed lanes, step and limits as device values).

Each function is one of transformers' helpers of ``GenerationMixin._beam_search`` (the name without its leading
underscore where transformers has one: ``get_top_k_continuations``, ``get_running_beams_for_next_iteration``) or a
part of one (``_update_finished_beams``: :func:`candidate_scores`, :func:`merge_finished`, :func:`select_finished`;
``_check_early_stop_heuristic``: :func:`early_stop_heuristic`), with its arithmetic and order, so scores and
tie-breaking match bit for bit. Where the two searches differ (a step as a host int or a device tensor, a division
as eager torch does it on each device) the caller passes the value; nothing here branches on the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.search.protocol import SearchOutput, token_logprobs
from seqgen_cli.search.settings import SearchSettings

BIG = -1.0e9  # transformers' "impossible" score

TopK = Callable[[Tensor, int], tuple[Tensor, Tensor]]


@dataclass
class BeamState:
    """The search state, one row per input: transformers' ``running_beam_scores``, ``beam_scores``,
    ``is_sent_finished``, ``is_early_stop_heuristic_unsatisfied`` and ``sequences`` (here only the finished
    hypotheses' generated tokens and lengths)."""

    running_scores: Tensor  # [B, K] float32: accumulated log-probs of the running beams
    beam_scores: Tensor  # [B, K] float32: length-penalised scores of the finished hypotheses
    is_finished: Tensor  # [B, K] bool: the place holds a finished hypothesis
    heuristic_unsatisfied: Tensor  # [B, 1] bool: a running beam may still beat the worst finished one
    fin_tokens: Tensor  # [B, K, T] int64: generated tokens of the finished hypotheses
    fin_lengths: Tensor  # [B, K] int64: their lengths
    # what is kept of each finished token [B, K, T, ...] (beam.TokenRecords: processed and raw log-probs, the best)
    fin_records: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        num_inputs: int,
        num_beams: int,
        total: int,
        device: torch.device,
        records: Mapping[str, Tensor] | None = None,
    ) -> BeamState:
        """No finished hypothesis; only the first beam runs (the others score ``BIG``, so the first step's
        candidates all continue beam 0). ``records``: the running rows' per-token records [N, T, ...], kept for
        each finished token too."""
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
            fin_records={name: x.new_zeros((*shape, *x.shape[1:])) for name, x in (records or {}).items()},
        )

    def done(self, early_stopping: bool | str) -> Tensor:
        """[B] bool: inputs whose finished set can no longer change (``_beam_search_has_unfinished_sequences``
        per input): the heuristic says no running beam can win, or ``early_stopping`` and all K finished."""
        done = ~self.heuristic_unsatisfied[:, 0]
        if early_stopping is True:
            done = done | self.is_finished.all(dim=1)
        return done

    def keep(self, keep: Tensor) -> None:
        """Keep inputs ``keep`` ([B'] int64, ascending); the others left."""
        self.running_scores, self.beam_scores = self.running_scores[keep], self.beam_scores[keep]
        self.is_finished, self.heuristic_unsatisfied = (
            self.is_finished[keep],
            self.heuristic_unsatisfied[keep],
        )
        self.fin_tokens, self.fin_lengths = self.fin_tokens[keep], self.fin_lengths[keep]
        self.fin_records = {name: x[keep] for name, x in self.fin_records.items()}

    def best(self, inputs: Tensor, n: int) -> SearchOutput:
        """The ``n`` best finished hypotheses of inputs ``inputs`` ([D] int64), their scores and (where kept) their
        tokens' log-probs, copied to the host: only after a host check or the loop (``Rows.check``, ``Rows.remaining``)."""
        tokens = self.fin_tokens.index_select(0, inputs)[:, :n].tolist()
        lengths = self.fin_lengths.index_select(0, inputs)[:, :n].tolist()
        scores = self.beam_scores.index_select(0, inputs)[:, :n].tolist()
        sequences = [
            [toks[i][: lens[i]] for i in range(n)] for toks, lens in zip(tokens, lengths, strict=True)
        ]
        kept = {name: x.index_select(0, inputs)[:, :n].tolist() for name, x in self.fin_records.items()}

        def cut(name: str) -> list[list[list[Any]]]:  # [D][n][T, ...] -> each hypothesis's own tokens
            return [[row[i][: lens[i]] for i in range(n)] for row, lens in zip(kept[name], lengths, strict=True)]

        per_token = cut("scores") if "scores" in kept else None
        logprobs = None
        if "raw" in kept:
            raw, ids, best = cut("raw"), *((cut("best_ids"), cut("best")) if "best" in kept else (None, None))
            logprobs = [
                [token_logprobs(raw[d][i], ids and ids[d][i], best and best[d][i]) for i in range(n)]
                for d in range(len(raw))
            ]
        return SearchOutput(sequences, scores, per_token, logprobs)


def get_top_k_continuations(
    accumulated_log_probs: Tensor, beams_to_keep: int, num_beams: int, topk: TopK
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``C = beams_to_keep`` best continuations over all beams: their scores, beams and tokens, [B, C] each."""
    vocab = accumulated_log_probs.shape[-1] // num_beams
    topk_log_probs, topk_indices = topk(accumulated_log_probs, beams_to_keep)
    return topk_log_probs, topk_indices // vocab, topk_indices % vocab


def get_running_beams_for_next_iteration(
    topk_log_probs: Tensor, topk_beams: Tensor, topk_tokens: Tensor, hits: Tensor, num_beams: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The best K candidates that did not end (``hits`` [B, C] bool) keep running: their scores, beams and tokens,
    [B, K] each."""
    topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * BIG
    next_indices = torch.topk(topk_running_log_probs, k=num_beams)[1]
    running_scores = torch.gather(topk_running_log_probs, 1, next_indices)
    return (
        running_scores,
        torch.gather(topk_beams, 1, next_indices),
        torch.gather(topk_tokens, 1, next_indices),
    )


def divide(x: Tensor, divisor: float | Tensor, reciprocal: bool) -> Tensor:
    """``x / divisor`` as eager torch computes a tensor over a Python float: on the CPU a division; on CUDA
    ``x * (1 / divisor)`` (ATen's CPU-scalar fast path), where ``reciprocal`` passes ``divisor`` already inverted
    in float32 (a compiled division on CUDA is not correctly rounded, a product is)."""
    return x * divisor if reciprocal else x / divisor


def candidate_scores(
    topk_log_probs: Tensor,
    divisor: float | Tensor,
    beams_finished: Tensor,
    heuristic_unsatisfied: Tensor,
    did_top_num_beams_just_finish: Tensor,
    early_stopping: bool | str,
    reciprocal: bool = False,
) -> Tensor:
    """[B, C] length-penalised scores of the candidates that may enter the finished set (``BIG`` added to the
    others): ``divisor`` is ``(t + 1) ** length_penalty`` (see :func:`divide`); ``beams_finished`` [B, K] bool."""
    scores = divide(topk_log_probs, divisor, reciprocal)
    beams_full = torch.all(beams_finished, dim=-1, keepdim=True) & (early_stopping is True)
    scores += beams_full.to(torch.float32) * BIG
    scores += (~heuristic_unsatisfied).to(torch.float32) * BIG
    scores += (~did_top_num_beams_just_finish) * BIG
    return scores


def merge_finished(
    beam_scores: Tensor, is_finished: Tensor, candidate_scores: Tensor, did_top_num_beams_just_finish: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The best K of [old K | C candidates]: ``chosen`` [B, K] into them, the new scores and finished flags."""
    k = beam_scores.shape[1]
    merged_scores = torch.cat((beam_scores, candidate_scores), dim=1)  # [B, K + C]
    chosen = torch.topk(merged_scores, k=k)[1]  # [B, K] into [old K | C candidates]
    merged_finished = torch.cat((is_finished, did_top_num_beams_just_finish), dim=1)
    return chosen, torch.gather(merged_scores, 1, chosen), torch.gather(merged_finished, 1, chosen)


def candidate_rows(chosen: Tensor, topk_beams: Tensor) -> tuple[Tensor, Tensor]:
    """For each finished place after the merge (``chosen`` [B, K]): the candidate it would take (``cand`` [B, K],
    0 for old places) and that candidate's row ([B * K])."""
    bsz, k = chosen.shape
    cand = (chosen - k).clamp(min=0)
    rows = torch.arange(bsz, device=chosen.device)[:, None] * k + torch.gather(topk_beams, 1, cand)
    return cand, rows.reshape(-1)


def select_finished(
    fin_tokens: Tensor, fin_lengths: Tensor, chosen: Tensor, cand_tokens: Tensor, length: int | Tensor
) -> tuple[Tensor, Tensor]:
    """The finished places' tokens [B, K, T] and lengths [B, K] after the merge: old places keep theirs
    (``chosen`` [B, K] < K), candidate places take ``cand_tokens`` [B, K, T] and ``length`` (``t + 1``)."""
    k = fin_tokens.shape[1]
    from_candidate = chosen >= k  # [B, K]
    old = chosen.clamp(max=k - 1)
    tail = (1,) * (fin_tokens.dim() - 2)  # [B, K, T, ...]: any trailing dimensions
    tokens = torch.where(from_candidate.view(*from_candidate.shape, *tail), cand_tokens, pick(fin_tokens, old))
    return tokens, torch.where(from_candidate, length, torch.gather(fin_lengths, 1, old))


def pick(x: Tensor, index: Tensor) -> Tensor:
    """``x`` [B, C, ...] at ``index`` [B, X] along dim 1: [B, X, ...]."""
    shape = (*index.shape, *(1,) * (x.dim() - 2))
    return torch.gather(x, 1, index.view(shape).expand(*index.shape, *x.shape[2:]))


def early_stop_heuristic(
    running_scores: Tensor,
    is_finished: Tensor,
    beam_scores: Tensor,
    heuristic_unsatisfied: Tensor,
    divisor: float | Tensor,
    reciprocal: bool = False,
) -> Tensor:
    """[B, 1] bool: can the best running beam, scored with ``divisor`` (``best_length ** length_penalty``, see
    :func:`divide`), still beat the worst finished hypothesis? Once unsatisfied, an input stays so."""
    best_running = divide(running_scores[:, :1], divisor, reciprocal)
    worst_finished = torch.where(is_finished, torch.min(beam_scores, dim=1, keepdim=True)[0], BIG)
    return heuristic_unsatisfied & torch.any(best_running > worst_finished, dim=-1, keepdim=True)


def scored_at_most_tokens(settings: SearchSettings) -> bool:
    """Whether the early-stop heuristic scores the best running beam at the most new tokens
    (``early_stopping="never"`` and a positive length penalty) rather than at the tokens generated so far."""
    return settings.early_stopping == "never" and settings.length_penalty > 0.0
