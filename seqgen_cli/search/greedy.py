"""One token per row per step: greedy search (the arg-max) and sampling (a draw, ``sampling.py``).

Mirrors transformers' ``_sample``: processors on float32 logits, pick one token per row, a row stops at
EOS (later tokens are pad and discarded), an input stops when all its rows did. Inputs whose rows all
stopped leave the batch at the next host check (see ``rows.default_sync_every``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from seqgen_cli.search.protocol import SearchOutput, TokenLogprobs, token_logprobs
from seqgen_cli.search.rows import Leaving, Rows
from seqgen_cli.search.settings import SearchSettings

Picker = Callable[[torch.Tensor], torch.Tensor]  # processed scores [N, V] -> tokens [N]
# (token history [N, length], scores [N, V]) -> [N] bool: rows whose text now ends in a stop string (transformers'
# StopStringCriteria, built from the tokenizer by the caller: prompts.stop_check)
StopCheck = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TokenSearch:
    """One token per row per step over the inputs of ``rows``, one step per :meth:`advance` (transformers'
    ``_sample`` loop body), for any cohort (``search/cohort.py``). ``stop``: a row also stops where its text
    reaches a stop string (as transformers' stopping criteria: after the token that completes it)."""

    def __init__(
        self,
        rows: Rows,
        settings: SearchSettings,
        pick: Picker,
        eos: torch.Tensor | None,
        stop: StopCheck | None,
    ) -> None:
        self.rows, self.s, self.pick, self.eos, self.stop = rows, settings, pick, eos, stop
        n, device = rows.history.tokens.shape[0], rows.history.tokens.device
        self.pad = settings.pad if settings.pad is not None else 0
        self.finished = torch.zeros(n, dtype=torch.bool, device=device)  # [N]
        # [N] generated length (EOS included)
        self.lengths = torch.full((n,), settings.max_new_tokens, dtype=torch.long, device=device)
        # [N, T] float32: each token's log-prob under the processed scores (``settings.scores``; an ended row's
        # later columns hold its padding's, never read: ``results`` cuts at ``lengths``)
        t_max = settings.max_new_tokens
        self.token_log_probs = (
            torch.zeros(n, t_max, dtype=torch.float32, device=device) if settings.scores else None
        )
        # --logprobs K: each token's raw log-prob [N, T] and the step's K best log-probs and ids [N, T, K]
        k = settings.logprobs
        self.raw = None if k is None else torch.zeros(n, t_max, dtype=torch.float32, device=device)
        self.best = None if not k else torch.zeros(n, t_max, k, dtype=torch.float32, device=device)
        self.best_ids = None if not k else torch.zeros(n, t_max, k, dtype=torch.long, device=device)
        self.t = 0  # steps done (host int)

    def advance(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Step ``t`` on the rows' logits [N, V]: the tokens [N] to feed next, or ``None`` after the last step."""
        rows, history, t = self.rows, self.rows.history, self.t
        raw = (
            logits.float().log_softmax(dim=-1) if self.raw is not None else None
        )  # [N, V], before the processors
        scores = rows.pipeline(history, logits.float())  # [N, V] float32 (transformers casts too)
        tokens = self.pick(scores)  # [N]
        tokens = torch.where(self.finished, self.pad, tokens)
        if self.token_log_probs is not None:  # transformers' compute_transition_scores(normalize_logits=True)
            self.token_log_probs[:, t] = scores.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]  # [N]
        if raw is not None:
            self._keep_logprobs(raw, tokens)
        history.append(tokens)
        rows.pipeline.appended(history)
        if self.eos is not None:
            hit = torch.isin(tokens, self.eos) & ~self.finished
            self.lengths = torch.where(hit, t + 1, self.lengths)
            self.finished = self.finished | hit
        if self.stop is not None:  # over the whole sequence, prompt included, as transformers' input_ids
            hit = self.stop(history.filled, scores) & ~self.finished
            self.lengths = torch.where(hit, t + 1, self.lengths)
            self.finished = self.finished | hit
        self.t += 1
        return None if self.t == self.s.max_new_tokens else tokens

    def _keep_logprobs(self, raw: torch.Tensor, tokens: torch.Tensor) -> None:
        """Step ``t``'s raw log-probs [N, V]: the chosen tokens' ([N]), and the best ones (``--logprobs``)."""
        assert self.raw is not None
        self.raw[:, self.t] = raw.gather(1, tokens[:, None])[:, 0]
        if self.best is not None and self.best_ids is not None:
            self.best[:, self.t], self.best_ids[:, self.t] = torch.topk(raw, self.best.shape[2], dim=-1)

    def done(self) -> torch.Tensor | None:
        """[B] bool: inputs whose rows all stopped; ``None`` without EOS or stop strings (none stops early)."""
        if self.eos is None and self.stop is None:
            return None
        return self.finished.view(-1, self.rows.rows_per_input).all(dim=1)

    def results(self, idx: torch.Tensor) -> SearchOutput:
        """The rows of active inputs ``idx`` ([D] int64) on the host (after a check only), and their summed and
        per-token log-probs where the settings ask for scores."""
        r = self.rows.rows_per_input
        row_ids = self.rows.row_index(idx)  # [D * R]
        tokens = self.rows.history.generated.index_select(0, row_ids).tolist()
        lens = self.lengths.index_select(0, row_ids).tolist()
        d = idx.shape[0]
        sequences = [[tokens[j * r + k][: lens[j * r + k]] for k in range(r)] for j in range(d)]
        logprobs = None if self.raw is None else self._logprobs(row_ids, lens, d)
        if self.token_log_probs is None:
            return SearchOutput(sequences, logprobs=logprobs)
        steps = self.token_log_probs.index_select(0, row_ids)  # [D * R, T]
        ended = (
            torch.arange(steps.shape[1], device=steps.device)
            >= self.lengths.index_select(0, row_ids)[:, None]
        )
        sums = (
            steps.masked_fill(ended, 0.0).sum(dim=1).tolist()
        )  # each row's own tokens, as generate()'s are summed
        rows = steps.tolist()
        per_token = [[rows[j * r + k][: lens[j * r + k]] for k in range(r)] for j in range(d)]
        return SearchOutput(sequences, [sums[j * r : (j + 1) * r] for j in range(d)], per_token, logprobs)

    def _logprobs(self, row_ids: torch.Tensor, lens: list[int], d: int) -> list[list[list[TokenLogprobs]]]:
        """Per input and row, each token's raw log-prob and the step's best (id, log-prob), up to its length."""
        assert self.raw is not None
        r = self.rows.rows_per_input
        raw = self.raw.index_select(0, row_ids).tolist()  # [D * R, T]
        ids = best = None
        if self.best is not None and self.best_ids is not None:
            best = self.best.index_select(0, row_ids).tolist()  # [D * R, T, K]
            ids = self.best_ids.index_select(0, row_ids).tolist()
        rows = [
            token_logprobs(raw[i][:n], ids and ids[i][:n], best and best[i][:n]) for i, n in enumerate(lens)
        ]
        return [rows[j * r : (j + 1) * r] for j in range(d)]

    def keep(self, leaving: Leaving) -> None:
        """Done inputs leave (``Rows.check``'s split)."""
        kept_rows = leaving.kept_rows  # [B' * R]
        self.finished, self.lengths = self.finished[kept_rows], self.lengths[kept_rows]
        if self.token_log_probs is not None:
            self.token_log_probs = self.token_log_probs[kept_rows]
        if self.raw is not None:
            self.raw = self.raw[kept_rows]
        if self.best is not None and self.best_ids is not None:
            self.best, self.best_ids = self.best[kept_rows], self.best_ids[kept_rows]
        self.rows.keep(leaving)
