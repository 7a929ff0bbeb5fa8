"""A cohort: inputs searched together, in lockstep. Its rows (history, processors, next tokens), one search over
them, and the results its inputs leave behind. The decode loop (``search/engine.py``) runs one cohort over a batch's
state, or many over the refill engine's lanes (``search/refill.py``); both build their searches with
:func:`make_search`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from seqgen_cli.search.beam import BeamConstants, BeamSearch, TopK
from seqgen_cli.search.greedy import StopCheck, TokenSearch
from seqgen_cli.search.protocol import SearchOutput, StaticBackend, TokenLogprobs
from seqgen_cli.search.rows import Leaving, Rows
from seqgen_cli.search.sampling import Streams
from seqgen_cli.search.settings import SearchSettings
from seqgen_cli.search.static import StaticBeamSearch


class Search(Protocol):
    """One search's per-step update over :class:`Rows` (``BeamSearch``, ``TokenSearch``)."""

    t: int  # steps done

    def advance(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The next token of each row ([N]) from the logits ([N, V]); ``None`` after the last step."""

    def done(self) -> torch.Tensor | None:
        """[B] bool: inputs whose results can no longer change (``None``: none can stop early)."""

    def results(self, idx: torch.Tensor) -> SearchOutput:
        """Sequences (and scores) of active inputs ``idx`` ([D] int64), on the host."""

    def keep(self, leaving: Leaving) -> None:
        """Done inputs leave."""


def make_search(
    rows: Rows,
    settings: SearchSettings,
    consts: BeamConstants,
    topk: TopK,
    streams: Streams,
    stop: StopCheck | None = None,
) -> Search:
    """The search of ``settings.mode`` over ``rows``: beam search (over a static backend's fixed lanes, a step that
    compiles: ``search/static.py``), or one token per row, the arg-max or a draw from each input's random stream.
    ``consts``: the device constants, built once per call before its first step is queued (host data copied later
    would wait for that step). ``stop``: the stop strings' check (a stop string ends a row, or a beam candidate as
    EOS does; not in the compiled static step)."""
    s = settings
    if (
        s.mode == "beam"
        and rows.pipeline.grammar is None  # the matchers live on the host: not in a compiled step
        and stop is None  # nor the stop strings' check
        and s.logprobs is None  # nor --logprobs' records (kept by the dynamic search only)
        and isinstance(rows.backend, StaticBackend)
        and rows.backend.static_search(rows.state)
    ):
        return StaticBeamSearch(rows, s, consts, topk)
    if s.mode == "beam":
        return BeamSearch(rows, s, consts, topk, stop)
    if s.mode == "sample":
        return TokenSearch(rows, s, streams.picker(rows), consts.eos, stop)
    return TokenSearch(rows, s, lambda scores: scores.argmax(dim=-1), consts.eos, stop)


class Results:
    """Per input (batch position), its sequences and, where the search gives them, their scores and per-token
    log-probs; filled as inputs leave."""

    def __init__(self, num_inputs: int) -> None:
        self.sequences: list[list[list[int]]] = [[] for _ in range(num_inputs)]
        self.scores: list[list[float]] = [[] for _ in range(num_inputs)]
        self.token_scores: list[list[list[float]]] = [[] for _ in range(num_inputs)]
        self.logprobs: list[list[list[TokenLogprobs]]] = [[] for _ in range(num_inputs)]
        self.with_scores = self.with_tokens = self.with_logprobs = False

    def collect(self, search: Search, idx: torch.Tensor, inputs: list[int]) -> None:
        """Copy the results of active inputs ``idx`` ([D] int64; batch positions ``inputs``) to the host: only
        after a host check or the loop (``Rows.check``, ``Rows.remaining``)."""
        found = search.results(idx)
        self.with_scores, self.with_tokens = found.scores is not None, found.token_scores is not None
        self.with_logprobs = found.logprobs is not None
        for j, b in enumerate(inputs):
            self.sequences[b] = found.sequences[j]
            if found.scores is not None:
                self.scores[b] = found.scores[j]
            if found.token_scores is not None:
                self.token_scores[b] = found.token_scores[j]
            if found.logprobs is not None:
                self.logprobs[b] = found.logprobs[j]

    def output(self) -> SearchOutput:
        return SearchOutput(
            self.sequences,
            self.scores if self.with_scores else None,
            self.token_scores if self.with_tokens else None,
            self.logprobs if self.with_logprobs else None,
        )


class Cohort:
    """Inputs that run in lockstep: ``rows``, their ``search``, and ``results`` where leaving inputs go."""

    def __init__(self, rows: Rows, search: Search, results: Results) -> None:
        self.rows, self.search, self.results = rows, search, results
        self.finished = False  # every input has left

    def advance(self, logits: torch.Tensor) -> torch.Tensor | None:
        """One step on the rows' logits [N, V]: the tokens [N] to feed next; ``None`` after the last step (then
        every input's results are collected)."""
        tokens = self.search.advance(logits)
        if tokens is None:
            self.finish()
        self.rows.tokens = tokens
        return tokens

    def check(self) -> Leaving | None:
        """The host check: inputs that are done leave (their results collected, the rest kept); the split, or
        ``None`` when none is done (or the search cannot stop early)."""
        done = self.search.done()
        leaving = self.rows.check(done) if done is not None else None
        if leaving is None:
            return None
        self.results.collect(self.search, leaving.done, leaving.inputs)
        if leaving.all_done:
            self.finished = True
        else:
            self.search.keep(leaving)
        return leaving

    def finish(self) -> None:
        """Collect every input still running (after the last step)."""
        if not self.finished:
            self.results.collect(self.search, *self.rows.remaining())
            self.finished = True
