"""The search's boundary: what a call takes (:class:`Batch`) and returns (:class:`SearchOutput`), and the
contract between the search loops (``seqgen_cli.search``) and a model backend (``seqgen_cli.models``).

A backend owns the model and its caches; the search owns tokens, scores and finished hypotheses.

Rows. The running batch has ``N = B_active * R`` rows, input-major: row ``i`` belongs to input
``i // R`` and is that input's beam (or sample) ``i % R``. ``R`` is fixed for a call: ``num_beams`` for
beam search, ``num_return_sequences`` for sampling, 1 for greedy.

Life of a call::

    state, first = backend.start(batch, rows_per_input=R, max_new_tokens=T)
    logits = first if first is not None else backend.step(state, start_tokens)   # [N, V]
    loop (search/engine.py):
        ... choose tokens, maybe beams ...
        backend.reorder(state, rows)        # beam search only: row i continues old row rows[i]
        backend.keep(state, keep, kept)     # inputs finished: keep inputs keep [B'], i.e. rows kept [B' * R]
        logits = backend.step(state, tokens)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class Batch:
    """Tokenised inputs for one call.

    ``input_ids``/``attention_mask``: [B, S] int64. Encoder-decoder sources are right-padded;
    decoder-only prompts are left-padded (as transformers' ``generate()`` expects them). ``widths``: each
    input's own padded width (``shapes.input_width``), at which an encoder-decoder backend runs its encoder;
    ``None``: ``S`` for every input. ``breaks``: [B, K] int64, where each decoder-only prompt may break into
    segments (``prompts.Prompter``; tokens from its first real one, 0 past its own), for the prompt tree
    (``models/prompt_tree.py``); ``None``: none.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    widths: tuple[int, ...] | None = None
    breaks: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> Batch:
        """Inputs ``rows`` ([J] int64 or [B] bool) of the batch, at its width."""
        breaks = None if self.breaks is None else self.breaks[rows]
        return Batch(self.input_ids[rows], self.attention_mask[rows], breaks=breaks)

    def padded(self, inputs: int, width: int, left: bool) -> Batch:
        """[B, S] padded to ``inputs`` rows (copies of the last input) and ``width`` columns (masked; on the left
        for decoder-only prompts, on the right for sources); each input keeps its own width."""
        ids, mask = self.input_ids, self.attention_mask
        b, s = ids.shape
        widths = None if self.widths is None else (*self.widths, *self.widths[-1:] * (inputs - b))
        ids = torch.cat([ids, ids[-1:].expand(inputs - b, s)])  # [inputs, S]
        mask = torch.cat([mask, mask[-1:].expand(inputs - b, s)])
        pad = ids.new_zeros(inputs, width - s)  # [inputs, width - S]: token 0, masked
        ids = torch.cat([pad, ids] if left else [ids, pad], dim=1)  # [inputs, width]
        mask = torch.cat([pad, mask] if left else [mask, pad], dim=1)
        breaks = None if self.breaks is None else torch.cat([self.breaks, self.breaks[-1:].expand(inputs - b, -1)])
        return Batch(ids, mask, widths, breaks)


TokenLogprobs = tuple[float, list[tuple[int, float]]]  # a token's raw log-prob, the step's best (id, log-prob)


def token_logprobs(
    raw: list[float], ids: list[list[int]] | None = None, best: list[list[float]] | None = None
) -> list[TokenLogprobs]:
    """One output's ``--logprobs``: each token's raw log-prob beside its step's best ids and log-probs (none where
    ``--logprobs 0`` keeps none)."""
    if ids is None or best is None:
        return [(lp, []) for lp in raw]
    return [(lp, list(zip(i, v, strict=True))) for lp, i, v in zip(raw, ids, best, strict=True)]


@dataclass
class SearchOutput:
    """Per input, ``num_return_sequences`` generated token lists, best first.

    Tokens are the generated ones only (no decoder start token, no prompt, no padding); a sequence ends with
    EOS when EOS was generated. ``scores``: beam search's ``sequences_scores`` (length-penalised sum of
    processed log-probs, as transformers reports them); for greedy and sampling, where the settings ask for scores,
    the summed log-probs, else ``None``. ``token_scores``: with those, each token's processed log-prob (what
    ``compute_transition_scores`` gives), where the search keeps them (not the static beam search of capture).
    ``logprobs`` (``--logprobs N``): each token's raw log-prob (the model's distribution, before any processor) and
    the ``N`` best ``(id, log-prob)`` of that step.
    """

    sequences: list[list[list[int]]]
    scores: list[list[float]] | None = None
    token_scores: list[list[list[float]]] | None = None
    logprobs: list[list[list[TokenLogprobs]]] | None = None


class ModelBackend(Protocol):
    """What a model backend implements. ``State`` is opaque to the search."""

    is_encoder_decoder: bool
    vocab_size: int  # width of the logits step() returns
    # Optional (read with getattr): ``max_position_embeddings: int | None`` caps transformers' default
    # max_length (20 new tokens) as generate() does; ``cache_bytes(inputs, width, rows_per_input, new_tokens) ->
    # int | None``: the bytes of the caches start() allocates for such a batch (the batcher's memory budget).

    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[Any, torch.Tensor | None]:
        """Run the encoder (or prefill the prompt) once per input and set up caches for ``B * R`` rows.

        Returns ``(state, first_logits)``. Decoder-only backends return the prefill's last-position
        logits ``[B, V]`` (one row per input; the search expands them to ``R`` rows). Encoder-decoder
        backends return ``None``: the search then calls ``step`` with the decoder start token.
        ``max_new_tokens`` bounds the number of ``step`` calls (for preallocated caches).
        """
        ...

    def step(self, state: Any, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row of ``state`` (``tokens``: [N] int64); return next-token logits [N, V]. The one
        way to step: a batch's running rows, every lane of a lane state, every row of a static layout.

        The search owns the returned tensor (it may modify it in place).
        """
        ...

    def reorder(self, state: Any, rows: torch.Tensor) -> None:
        """Beam reordering: new row ``i`` continues old row ``rows[i]`` ([N] int64, same input)."""
        ...

    def keep(self, state: Any, keep: torch.Tensor, rows: torch.Tensor) -> None:
        """Finished inputs leave: keep only inputs ``keep`` ([B'] int64, ascending, indices among active).

        ``rows`` ([B' * R] int64) are their rows, ``keep[i] * R + k`` for ``k < R``: computed once by the
        search (``Rows.keep``) for the backend's per-row state.
        """
        ...


@runtime_checkable
class RefillBackend(ModelBackend, Protocol):
    """A model backend whose state can be ``L`` fixed input lanes of ``R`` rows each (the refill engine,
    ``search/refill.py``), every lane at its own step. Rows are lane-major (row ``l * R + k``); ``step`` feeds and
    returns every row of every lane (idle lanes run on, unread), ``reorder`` takes a permutation of all ``L * R``
    rows, and nothing is dropped: inputs ``leave`` their lanes idle. Implemented by the fast backends
    (``models/encoder_decoder.py``, ``models/decoder_only.py``) and passed through by ``models/capture.py``."""

    def open_lanes(self, lanes: int, rows_per_input: int, max_new_tokens: int) -> Any:
        """The state of ``lanes`` empty lanes (caches preallocated for ``max_new_tokens`` steps)."""
        ...

    def join(self, state: Any, lanes: list[int], batch: Batch) -> torch.Tensor | None:
        """Inputs ``batch`` ([J, W]) into lanes ``lanes`` (J lane numbers): run the encoder (prefill the prompts)
        for them and restart those lanes at step 0. Decoder-only: the prefill's last logits [J, V]; else ``None``."""
        ...

    def leave(self, state: Any, lanes: list[int]) -> None:
        """The inputs of ``lanes`` are done: those lanes idle until the next join (their rows run on, unread, and
        no longer count for the span a step attends)."""
        ...


@dataclass
class StaticLayout:
    """Where a :class:`StaticBackend`'s running rows lie among its fixed ``L * R`` rows (``L`` lanes of ``R``
    rows; lanes of inputs that left, or that pad the batch, run idle)."""

    inputs: torch.Tensor  # [B] int64: the lane of each running input
    tokens: torch.Tensor  # [L * R] int64: the next step's input tokens, a buffer whose address stays
    width: int  # decoder positions a row's history may start with: the prompts' graph width, or 1
    new_tokens: int  # the new tokens a row holds (cache positions)
    moved: torch.Tensor | None  # [lanes * R] int64 after a keep that moved the rows to fewer lanes: row i's old row


@runtime_checkable
class StaticBackend(ModelBackend, Protocol):
    """A model backend with static shapes and addresses whose search step may be compiled too (beam search in
    ``search/static.py``): the search keeps its state over all ``L * R`` rows, writes the next tokens into
    :attr:`StaticLayout.tokens` and feeds that buffer itself to ``step``, which then returns the logits of every
    row ([L * R, V]; read them before the next step), and its ``reorder`` gives all ``L * R`` rows (row ``i``
    continues row ``rows[i]``, same input lane). ``models/capture.py``'s ``CapturedBackend``; beam
    search runs over a state's lanes where ``static_search`` says so (its step is compiled), else as over any
    backend."""

    def static_search(self, state: Any) -> bool:
        """Whether beam search runs over ``state``'s lanes (a state from this backend's ``start``)."""
        ...

    def static_layout(self, state: Any) -> StaticLayout:
        """The layout now (after a ``keep``, the new one)."""
        ...

    def kept_search(self, state: Any, key: Any, make: Callable[[], Any]) -> Any:
        """The search state kept with the state's buffers for ``key`` (``make()`` the first time, or when the key
        changes): its tensors keep their addresses for the backend's life, as the model's do."""
        ...

    def search_call(
        self, state: Any, step: Callable[[Any, torch.Tensor], Any], search: Any, logits: torch.Tensor
    ) -> Any:
        """``step(search, logits)``, a pure function of its tensors, compiled (and guarded)."""
        ...
