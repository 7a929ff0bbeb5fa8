"""Vectorised beam search with transformers v5 semantics (``GenerationMixin._beam_search``).

Every step is a fixed set of tensor ops over ``[B, K]`` / ``[B, C]`` (``K = num_beams``,
``C = max(2, 1 + n_eos) * K`` candidates), identical in arithmetic and order to transformers' helpers
(``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``, ``_update_finished_beams``,
``_check_early_stop_heuristic``), so scores and tie-breaking match bit for bit.

Differences that do not change results:

* finished hypotheses keep only their generated tokens ([B, K, T]) and their length, not the prompt;
* an input is *done* once ``early_stopping`` is True and all its K slots are finished, or once the early-stop
  heuristic says no running beam can beat its worst finished one. From then on transformers keeps stepping
  it, but every new candidate carries a -1e9 penalty, so its finished set can no longer change. seqgen drops
  a done input (rows, cache, search state) at the next host check (``rows.default_sync_every``);
* the cross-attention cache is not reordered (rows of one input share it; backend's business).
"""

from __future__ import annotations

import torch

from seqgen_cli.search.output import SearchOutput
from seqgen_cli.search.protocol import Batch, ModelBackend
from seqgen_cli.search.rows import default_sync_every, start_rows
from seqgen_cli.search.settings import SearchSettings

BIG = -1.0e9  # transformers' "impossible" score
CHUNK = 128  # columns per chunk in :func:`wide_topk`


def wide_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores, k)`` (sorted) over the last dimension of a wide [B, M] tensor, via the chunks of
    ``CHUNK`` columns with the ``k`` largest maxima: one max pass, then a top-k over ``k * CHUNK`` columns.

    Same values as ``torch.topk``: an element of any other chunk is at most the k-th largest chunk maximum,
    itself at most the k-th largest element, so only equal values can trade places (torch leaves the order of
    ties unspecified too). ~4x cheaper than ``torch.topk`` over [32, 4 x 55k] on the CPU (docs/BENCHMARKS.md,
    "CPU float32: attention as two products, top-k by chunks").
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


def beam_search(
    backend: ModelBackend, batch: Batch, settings: SearchSettings, sync_every: int | None = None
) -> SearchOutput:
    s = settings
    k = s.num_beams
    device = batch.input_ids.device
    sync_every = sync_every or default_sync_every(device)
    num_inputs = batch.input_ids.shape[0]
    prompt_len, max_length, total = s.prompt_len, s.max_length, s.max_new_tokens
    lp, early_stopping = s.length_penalty, s.early_stopping
    c = max(2, 1 + len(s.eos)) * k
    eos = torch.tensor(s.eos, dtype=torch.long, device=device) if s.eos else None
    top_num_beam_mask = torch.cat(
        (torch.ones(k, dtype=torch.bool, device=device), torch.zeros(c - k, dtype=torch.bool, device=device))
    )  # [C]

    rows, logits = start_rows(backend, batch, s, k)
    history = rows.history
    vocab = logits.shape[-1]
    # float32 CPU logits: top-k by chunks (equal values may trade places, which in float32 takes an exact
    # tie); half-precision logits tie often, and transformers orders ties as torch.topk does.
    topk = wide_topk if device.type == "cpu" and logits.dtype == torch.float32 else torch.topk

    # Search state, one row per active input.
    running_scores = torch.zeros((num_inputs, k), dtype=torch.float, device=device)  # [B, K]
    running_scores[:, 1:] = BIG
    beam_scores = torch.full((num_inputs, k), BIG, dtype=torch.float, device=device)  # [B, K] finished
    is_finished = torch.zeros((num_inputs, k), dtype=torch.bool, device=device)  # [B, K]
    heuristic_unsatisfied = torch.ones((num_inputs, 1), dtype=torch.bool, device=device)  # [B, 1]
    fin_tokens = torch.zeros((num_inputs, k, total), dtype=torch.long, device=device)  # [B, K, T]
    fin_lengths = torch.zeros((num_inputs, k), dtype=torch.long, device=device)  # [B, K]

    results: list[list[list[int]]] = [[] for _ in range(num_inputs)]
    result_scores: list[list[float]] = [[] for _ in range(num_inputs)]
    nrs = s.num_return_sequences

    def collect(idx: torch.Tensor, inputs: list[int]) -> None:
        """Copy the finished hypotheses of active inputs ``idx`` ([D] int64; batch indices ``inputs``) to the
        host: only after a host check or the loop (``Rows.check``, ``Rows.remaining``)."""
        toks = fin_tokens.index_select(0, idx)[:, :nrs].tolist()
        lens = fin_lengths.index_select(0, idx)[:, :nrs].tolist()
        scores = beam_scores.index_select(0, idx)[:, :nrs].tolist()
        for j, b in enumerate(inputs):
            results[b] = [toks[j][i][: lens[j][i]] for i in range(nrs)]
            result_scores[b] = scores[j]

    for t in range(total):
        cur_len = prompt_len + t
        bsz = running_scores.shape[0]
        last_step = cur_len + 1 >= max_length

        # b. log-probs -> processors -> accumulate: [N, V] -> [B, K * V]. The search owns the logits, so the
        # vocabulary-wide passes work in place (same arithmetic and bits, no [N, V] allocation per pass).
        log_probs = logits.float().contiguous()  # [N, V]
        torch.log_softmax(log_probs, dim=-1, out=log_probs)
        log_probs = rows.pipeline(history, log_probs)
        log_probs = log_probs.view(bsz, k, vocab).add_(running_scores[:, :, None])
        log_probs = log_probs.reshape(bsz, k * vocab)

        # c. top-C continuations over all beams: [B, C]
        topk_log_probs, topk_indices = topk(log_probs, c)
        topk_beams = topk_indices // vocab
        topk_tokens = topk_indices % vocab

        # d. stopping criteria per candidate (MaxLengthCriteria, EosTokenCriteria): [B, C]
        if last_step:
            hits = torch.ones((bsz, c), dtype=torch.bool, device=device)
        elif eos is not None:
            hits = torch.isin(topk_tokens, eos)
        else:
            hits = torch.zeros((bsz, c), dtype=torch.bool, device=device)

        # e. best K unfinished continuations keep running: [B, K]
        topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * BIG
        next_indices = torch.topk(topk_running_log_probs, k=k)[1]
        running_scores = torch.gather(topk_running_log_probs, 1, next_indices)
        next_beams = torch.gather(topk_beams, 1, next_indices)
        next_tokens = torch.gather(topk_tokens, 1, next_indices)

        # f. merge just-finished candidates (top K positions only) into the finished set: [B, K + C] -> [B, K]
        did_finish = hits & top_num_beam_mask[None, :]
        candidate_scores = topk_log_probs / ((cur_len + 1 - prompt_len) ** lp)
        beams_full = torch.all(is_finished, dim=-1, keepdim=True) & (early_stopping is True)
        candidate_scores += beams_full.to(torch.float32) * BIG
        candidate_scores += (~heuristic_unsatisfied).to(torch.float32) * BIG
        candidate_scores += (~did_finish) * BIG
        merged_scores = torch.cat((beam_scores, candidate_scores), dim=1)
        chosen = torch.topk(merged_scores, k=k)[1]  # [B, K] into [old K | C candidates]
        beam_scores = torch.gather(merged_scores, 1, chosen)
        is_finished = torch.gather(torch.cat((is_finished, did_finish), dim=1), 1, chosen)
        # Sequences: old slots keep theirs, candidate slots copy their beam's history plus the new token.
        from_candidate = chosen >= k  # [B, K]
        cand = (chosen - k).clamp(min=0)
        cand_rows = (
            torch.arange(bsz, device=device)[:, None] * k + torch.gather(topk_beams, 1, cand)
        ).reshape(-1)
        cand_tokens = torch.zeros((bsz * k, total), dtype=torch.long, device=device)  # [B*K, T]
        cand_tokens[:, :t] = history.generated.index_select(0, cand_rows)
        cand_tokens[:, t] = torch.gather(topk_tokens, 1, cand).reshape(-1)
        old = chosen.clamp(max=k - 1)
        fin_tokens = torch.where(
            from_candidate[:, :, None],
            cand_tokens.view(bsz, k, total),
            torch.gather(fin_tokens, 1, old[:, :, None].expand(-1, -1, total)),
        )
        fin_lengths = torch.where(from_candidate, t + 1, torch.gather(fin_lengths, 1, old))

        if last_step:
            break

        # g. early-stop heuristic for the next step: [B, 1]
        next_len = cur_len + 1
        if early_stopping == "never" and lp > 0.0:
            best_length = max_length - prompt_len
        else:
            best_length = next_len - prompt_len
        best_running = running_scores[:, :1] / (best_length**lp)
        worst_finished = torch.where(is_finished, torch.min(beam_scores, dim=1, keepdim=True)[0], BIG)
        heuristic_unsatisfied = heuristic_unsatisfied & torch.any(
            best_running > worst_finished, dim=-1, keepdim=True
        )

        # Continue the chosen beams: reorder rows (history, processors, cache), then append their tokens.
        beam_rows = (torch.arange(bsz, device=device)[:, None] * k + next_beams).reshape(-1)  # [N]
        rows.reorder(beam_rows)
        tokens = next_tokens.reshape(-1)  # [N]
        history.append(tokens)
        rows.pipeline.appended(history)

        # Done inputs leave (host check every `sync_every` steps).
        if (t + 1) % sync_every == 0:
            done = ~heuristic_unsatisfied[:, 0]
            if early_stopping is True:
                done = done | is_finished.all(dim=1)
            leaving = rows.check(done)
            if leaving is not None:
                if leaving.all_done:
                    break
                collect(leaving.done, leaving.inputs)
                keep = leaving.keep
                running_scores, beam_scores = running_scores[keep], beam_scores[keep]
                is_finished, heuristic_unsatisfied = is_finished[keep], heuristic_unsatisfied[keep]
                fin_tokens, fin_lengths = fin_tokens[keep], fin_lengths[keep]
                tokens = tokens[leaving.kept_rows]
                rows.keep_inputs(leaving)

        logits = backend.step(rows.state, tokens)  # [N, V]

    collect(*rows.remaining())
    return SearchOutput(sequences=results, scores=result_scores)
