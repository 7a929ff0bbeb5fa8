"""The static beam search over fixed lanes: a step with static shapes and addresses, compiled like the model's.

After the captured model step (``models/capture.py``) what is left of a decode step is the search's ~80 small ops
(cast, log-softmax, processors, score add, top-k over ``[B, K * V]``, the finished-set merge, reordering the
history, n-gram keys and back-pointers), each a launch. Here the search runs over all ``L * R`` rows of a
:class:`~seqgen_cli.search.protocol.StaticBackend` (the capture path's padded lanes: inputs that left or that pad
the batch run idle, their rows finite and unread), with every tensor preallocated in a :class:`StaticState` kept
with the backend's state for that shape, and the step counter and length limits as 0-d device tensors
(``history.StepLimits``). :func:`static_beam_step` is a pure function of that state and the logits: it
returns the new buffers, which the search copies in (:func:`commit`: one ``_foreach_copy_`` per dtype), so the
same function runs eagerly (the first step of a batch, a fallback) and compiled (``StaticBackend.search_call``: one
graph, on CUDA one replay per step), and a compiled call can be checked against, or rerun as, the eager one.

Launches per decode step on the capture path: the model's graph and its position counter, the search's graph, the
commit (one copy per dtype: 3) and the back-pointers' reorder (2), against ~80-100 eager ops for the search alone;
plus the host check every ``sync_every`` steps. A batch's first search step runs eagerly (its logits come from
the encoder's or prefill's path, not the model's graph).

Exactness: the step is ``beam.BeamSearch.advance`` (the helpers of ``beam_step.py``, the processors of
``processors.py``, in transformers' order), with "only at this step" conditions as ``torch.where`` on the device
step and divisions as eager torch divides by a Python float (on CUDA a product by the float32 inverse,
``beam_step.divide``): run eagerly, tokens and scores are bit for bit those of
``BeamSearch`` (``tests/search/test_static.py``); compiled, log-softmax and sums may round differently, so
tokens are the same where no near-tie separates them, as for the compiled model step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import Tensor

from seqgen_cli.search.beam import BeamConstants, wide_topk
from seqgen_cli.search.beam_step import (
    BIG,
    BeamState,
    TopK,
    candidate_rows,
    candidate_scores,
    early_stop_heuristic,
    get_running_beams_for_next_iteration,
    get_top_k_continuations,
    merge_finished,
    scored_at_most_tokens,
    select_finished,
)
from seqgen_cli.search.history import StaticHistory, StepLimits
from seqgen_cli.search.processors import Processors, append, float32_inverse, process, process_split
from seqgen_cli.search.protocol import SearchOutput, StaticBackend, StaticLayout
from seqgen_cli.search.rows import Leaving, Rows
from seqgen_cli.search.settings import SearchSettings


@dataclass(frozen=True)
class StaticSpec:
    """What a kept :class:`StaticState` and its compiled step are built for: the settings (less the batch's lengths,
    which are device values) and the shape of the history."""

    settings: SearchSettings  # prompt_len, max_length, min_length, begin_index zeroed
    vocab: int
    columns: int  # W: history columns (the prompt width + new tokens)
    new_tokens: int  # T: the most new tokens
    wide: bool  # top-k by chunks (``beam.wide_topk``, ``ties=False``: the CPU) instead of torch.topk
    reciprocal: bool  # divide as CUDA does (see beam_step.divide)
    ids_in_vocab: bool  # the repetition penalty's in-place path
    packed: bool  # n-gram keys packed into int64

    @classmethod
    def of(
        cls, s: SearchSettings, layout: StaticLayout, rows: Rows, topk: TopK, device: torch.device
    ) -> StaticSpec:
        """The spec of a batch with settings ``s`` on ``layout`` (``rows``: its history and processors)."""
        ngram = rows.pipeline.ngram
        return cls(
            settings=replace(s, prompt_len=0, max_length=0, min_length=0, begin_index=0),
            vocab=rows.backend.vocab_size,
            columns=layout.width + layout.new_tokens,
            new_tokens=layout.new_tokens,
            wide=topk is wide_topk,
            reciprocal=device.type == "cuda",
            ids_in_vocab=rows.pipeline.ids_in_vocab,
            packed=ngram is not None and ngram.keys is not None,
        )


@dataclass(eq=False)
class StaticState:
    """A static search's tensors, ``L`` lanes of ``K`` beams (``N = L * K`` rows): the beams' state, the
    history, the limits, and device constants (the processors', ``divisors`` ``[T + 1]`` float32: ``i **
    length_penalty``, or its float32 inverse on CUDA; the top-K candidate mask ``[C]``; EOS ids ``[E]``)."""

    spec: StaticSpec
    limits: StepLimits
    beams: BeamState  # [L, K] ...; fin_tokens [L, K, T]
    history: StaticHistory  # [N, W]
    proc: Processors
    divisors: Tensor
    top_mask: Tensor
    eos: Tensor | None

    @classmethod
    def allocate(
        cls, spec: StaticSpec, lanes: int, rows: Rows, consts: BeamConstants, device: torch.device
    ) -> StaticState:
        """A new state for ``lanes`` lanes; the constants from the batch's processors and ``consts``."""
        s = spec.settings
        powers = [float(i) ** s.length_penalty if i else 1.0 for i in range(spec.new_tokens + 1)]
        divisors = float32_inverse(powers) if spec.reciprocal else torch.tensor(powers, dtype=torch.float32)
        proc = rows.pipeline.proc.static(device)
        return cls(
            spec,
            StepLimits.zeros(device),
            BeamState.start(lanes, s.num_beams, spec.new_tokens, device),
            StaticHistory.empty(lanes * s.num_beams, spec.columns, spec.packed, device),
            proc,
            divisors.to(device),
            consts.top_num_beam_mask,
            consts.eos,
        )

    def empty(self, lanes: int) -> StaticState:
        """A state like this one for ``lanes`` lanes, sharing its constants (what :meth:`take` fills)."""
        device, k = self.top_mask.device, self.spec.settings.num_beams
        beams = BeamState.start(lanes, k, self.spec.new_tokens, device)
        history = StaticHistory.empty(lanes * k, self.spec.columns, self.spec.packed, device)
        return replace(self, limits=StepLimits.zeros(device), beams=beams, history=history)

    def buffers(self) -> list[Tensor]:
        """What a step replaces, in :func:`static_beam_step`'s order."""
        b = self.beams
        beams = [b.running_scores, b.beam_scores, b.is_finished, b.heuristic_unsatisfied, b.fin_tokens]
        return [*beams, b.fin_lengths, *self.history.buffers(), self.limits.t]

    def restart(self, s: SearchSettings, rows: Rows, src: Tensor) -> None:
        """A batch's start, in place: no finished hypothesis, only each input's first beam running (as
        ``BeamState.start``), the batch's history (row ``i`` from its row ``src[i]``) and limits."""
        b = self.beams
        b.running_scores.zero_()
        b.running_scores[:, 1:] = BIG
        b.beam_scores.fill_(BIG)
        b.is_finished.zero_()
        b.heuristic_unsatisfied.fill_(True)
        b.fin_tokens.zero_()
        b.fin_lengths.zero_()
        ngram = rows.pipeline.ngram
        self.history.restart(rows.history, None if ngram is None else ngram.keys, src)
        self.limits.restart(s)

    def take(self, other: StaticState, moved: Tensor) -> None:
        """Row ``i`` := ``other``'s row ``moved[i]`` ([N] int64, whole lanes), in place (a compaction)."""
        k = self.spec.settings.num_beams
        inputs = moved.view(-1, k)[:, 0] // k  # [L] the old lane of each lane
        for dst, src in zip(self.buffers()[:6], other.buffers()[:6], strict=True):
            dst.copy_(src.index_select(0, inputs))
        for dst, src in zip(self.history.buffers(), other.history.buffers(), strict=True):
            dst.copy_(src.index_select(0, moved))
        self.history.pad_lengths.copy_(other.history.pad_lengths.index_select(0, moved))
        for dst, src in zip(self.limits.tensors(), other.limits.tensors(), strict=True):
            dst.copy_(src)


def _finished_sequences(
    st: StaticState, chosen: Tensor, topk_beams: Tensor, topk_tokens: Tensor
) -> tuple[Tensor, Tensor]:
    """``beam._gather_finished_sequences`` over the static history: a candidate place's generated tokens are its
    beam's history from ``prompt_len`` (zeros past the step), the new token at column ``t``."""
    b, lim = st.beams, st.limits
    p, k, total = b.fin_tokens.shape
    steps = st.history.cols[:total]  # [T]
    cand, cand_rows = candidate_rows(chosen, topk_beams)  # [L, K], [L * K]
    generated = st.history.tokens[cand_rows[:, None], (lim.prompt_len + steps)[None, :]]  # [L * K, T]
    new = torch.gather(topk_tokens, 1, cand).reshape(-1, 1)  # [L * K, 1]
    cand_tokens = torch.where(steps == lim.t, new, generated).view(p, k, total)
    return select_finished(b.fin_tokens, b.fin_lengths, chosen, cand_tokens, lim.t + 1)


def static_beam_step(st: StaticState, logits: Tensor) -> list[Tensor]:
    """``BeamSearch.advance`` over every lane, a pure function: ``logits`` [N, V] -> the new values of
    ``st.buffers()``, then the next tokens [N] and the rows they continue [N]."""
    s, lim, b = st.spec.settings, st.limits, st.beams
    p, k = b.running_scores.shape
    length = lim.prompt_len + lim.t  # [] transformers' cur_len
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    if st.proc.renormalize:  # log-softmax again after the processors: in their order, then the running scores
        log_probs = process(st.proc, st.history, lim, log_probs).view(p, k, -1) + b.running_scores[:, :, None]
    else:
        running = b.running_scores.reshape(-1, 1)  # [N, 1]
        log_probs = process_split(st.proc, st.history, lim, log_probs, running)  # [N, V]
    log_probs = log_probs.reshape(p, -1)  # [L, K * V]
    topk = partial(wide_topk, ties=False) if st.spec.wide else torch.topk  # compiled: no host check
    topk_log_probs, topk_beams, topk_tokens = get_top_k_continuations(
        log_probs, st.top_mask.shape[0], k, topk
    )
    last = length + 1 >= lim.max_length  # [] bool
    hits = last.expand(topk_tokens.shape) if st.eos is None else torch.isin(topk_tokens, st.eos) | last
    running, next_beams, next_tokens = get_running_beams_for_next_iteration(
        topk_log_probs, topk_beams, topk_tokens, hits, k
    )
    did_finish = hits & st.top_mask  # [L, C]: only the top K candidates may finish
    divisor = st.divisors.index_select(0, (lim.t + 1).view(1))  # [1] (t + 1) ** length_penalty
    r = st.spec.reciprocal
    scores = candidate_scores(
        topk_log_probs, divisor, b.is_finished, b.heuristic_unsatisfied, did_finish, s.early_stopping, r
    )
    chosen, beam_scores, is_finished = merge_finished(b.beam_scores, b.is_finished, scores, did_finish)
    fin_tokens, fin_lengths = _finished_sequences(st, chosen, topk_beams, topk_tokens)
    if scored_at_most_tokens(s):  # scored at the most new tokens (beam.best_length)
        divisor = st.divisors.index_select(0, (lim.max_length - lim.prompt_len).view(1))  # [1]
    heuristic = early_stop_heuristic(running, is_finished, beam_scores, b.heuristic_unsatisfied, divisor, r)
    rows = (torch.arange(p, device=logits.device)[:, None] * k + next_beams).reshape(-1)  # [N]
    tokens = next_tokens.reshape(-1)  # [N]
    history = append(st.proc, st.history, rows, tokens, length)
    beams = [running, beam_scores, is_finished, heuristic, fin_tokens, fin_lengths]
    return [*beams, *history, lim.t + 1, tokens, rows]


SearchStep = Callable[[StaticState, Tensor], list[Tensor]]


def commit(targets: list[Tensor], values: list[Tensor]) -> None:
    """``targets[i] := values[i]`` in place: one ``_foreach_copy_`` per dtype (on CUDA one launch each; a list of
    mixed dtypes would copy tensor by tensor)."""
    groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    for dst, src in zip(targets, values, strict=True):
        dsts, srcs = groups.setdefault(dst.dtype, ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)


class StaticBeamSearch:
    """Beam search over the lanes of a :class:`~seqgen_cli.search.protocol.StaticBackend` (the ``Search`` of
    ``search/cohort.py``): its :meth:`advance` takes the logits of every lane row (the first step: of the running
    rows, as ``start_rows`` gives them) and returns the layout's token buffer, which the decode loop feeds to the
    backend's ``step`` as it is (then the logits of every lane row come back)."""

    def __init__(self, rows: Rows, settings: SearchSettings, consts: BeamConstants, topk: TopK) -> None:
        backend: StaticBackend = rows.backend  # type: ignore[assignment]
        self.rows, self.s, self.backend = rows, settings, backend
        self.layout = backend.static_layout(rows.state)
        device, k = consts.top_num_beam_mask.device, settings.num_beams
        self.spec = StaticSpec.of(settings, self.layout, rows, topk, device)
        lanes = self.layout.tokens.shape[0] // k
        self.st: StaticState = backend.kept_search(
            rows.state, self.spec, lambda: StaticState.allocate(self.spec, lanes, rows, consts, device)
        )
        running = len(rows.inputs)
        first = torch.arange(lanes, device=device).clamp(max=running - 1)  # idle lanes repeat the last input
        self.src = (first[:, None] * k + torch.arange(k, device=device)).reshape(-1)  # [L * K] row of each
        self.st.restart(settings, rows, self.src)
        self.t = 0  # steps done (host int)

    def advance(self, logits: Tensor) -> Tensor | None:
        """Step ``t`` on the logits ([N, V] of the running rows at step 0, else [L * K, V] of every lane row): the
        token buffer for the next step, or ``None`` after the last step."""
        st, state = self.st, self.rows.state
        if self.t == 0:  # eagerly: the first logits come from elsewhere than the model's graph
            out = static_beam_step(st, logits.index_select(0, self.src))
        else:
            out = self.backend.search_call(state, static_beam_step, st, logits)
        commit([*st.buffers(), self.layout.tokens], out[:-1])
        self.t += 1
        if self.t == self.s.max_new_tokens:
            return None
        self.backend.reorder(state, out[-1])  # the model's back-pointers: [L * K], every lane row
        return self.layout.tokens

    def done(self) -> Tensor:
        """[B] bool: running inputs whose results can no longer change."""
        return self.st.beams.done(self.s.early_stopping).index_select(0, self.layout.inputs)

    def results(self, idx: Tensor) -> SearchOutput:
        """Sequences and scores of running inputs ``idx`` ([D] int64), on the host (after a check only); no per-token
        log-probs (the compiled step keeps none)."""
        return self.st.beams.best(self.layout.inputs.index_select(0, idx), self.s.num_return_sequences)

    def keep(self, leaving: Leaving) -> None:
        """Done inputs leave: the backend idles their lanes, or moves the rows to fewer lanes (then the search
        state moves into the kept one of that shape)."""
        rows, backend = self.rows, self.backend
        backend.keep(rows.state, leaving.keep, leaving.kept_rows)
        gone = set(leaving.inputs)
        rows.inputs = [b for b in rows.inputs if b not in gone]
        layout = backend.static_layout(rows.state)
        if layout.moved is not None:
            old, lanes = self.st, layout.tokens.shape[0] // self.s.num_beams
            self.st = backend.kept_search(rows.state, self.spec, lambda: old.empty(lanes))
            self.st.take(old, layout.moved)
        self.layout = layout
        rows.tokens = layout.tokens  # the next step's (a compaction's new buffer)
