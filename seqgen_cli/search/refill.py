"""The refill engine (``--refill``): generation over a fixed set of input *lanes*; an input that finishes hands its
lane to a waiting one, so steps run with full batches instead of a shrinking tail. Every fast backend refills (a
:class:`~seqgen_cli.search.protocol.RefillBackend`): every family of ``models/families/``, encoder-decoder and
decoder-only.

Lanes. ``L`` lanes of ``R`` rows each (beams, or samples) live in the model backend's state (``open_lanes``): per
lane the source's cross-attention keys/values and mask (encoder-decoder) or the prompt's keys/values and mask
(decoder-only), and a self-attention cache with a step counter per lane (``models/kv_cache.py``, built with ``lanes=True``). Every decode step runs all ``L * R`` rows (the backend's ``step`` on the lane state),
each lane at its own step: one shape per span bucket and source width, so on CUDA the backend is a
``CapturedBackend`` whose step replays a CUDA graph (``models/capture.py``).

Cohorts. Inputs that join at the same host check (decoder-only: with the same prompt width) form a
:class:`~seqgen_cli.search.cohort.Cohort`: they run in lockstep, searched exactly as one batch of the ordinary
engine, by the same code (:func:`~seqgen_cli.search.cohort.make_search` over a ``Rows`` of their own), in the same
loop (``search/engine.py``, with :class:`~seqgen_cli.search.engine.Lanes`): each step hands every cohort its rows'
logits; the cohorts' beam reorderings go to the backend as one permutation.

Life cycle of an input: *join* (at a host check, into a free lane: the encoder, or the prompt's prefill, runs for
the joiners only and fills the lanes' rows, their self-attention restarts at step 0, a new cohort starts with fresh
search state; decoder-only, the prefill's logits are the cohort's first step at once, as in the ordinary engine),
*run*, *leave* (the periodic host check finds it done: its results are collected and its lane is free; its rows
idle until the next join). Joiners are taken from the waiting inputs in the order given (the caller sorts them by
length, so neighbours share a width bucket); a wider joiner widens every lane's source (prompt) columns, masked.

Exactness: an input's search is the ordinary one, and its decoder arithmetic does not depend on its neighbours'
steps (a span bucket of cache positions attended under a mask) nor, decoder-only, on who joins with it (each prompt
is prefilled at a width of its own length), so outputs are token-identical to ``generate()`` (tests/search/test_refill.py
runs the equivalence harness with joins at many different steps) and equal to the input's own run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from seqgen_cli.errors import SeqgenError
from seqgen_cli.grammars import Grammar
from seqgen_cli.search.beam import BeamConstants, pick_topk
from seqgen_cli.search.cohort import Cohort, Results, make_search
from seqgen_cli.search.engine import Engine, Lanes, Placed, RefillStats, Reorders
from seqgen_cli.search.grammar import BatchGrammar
from seqgen_cli.search.greedy import StopCheck
from seqgen_cli.search.processors import LogitsPipeline
from seqgen_cli.search.protocol import Batch, RefillBackend, SearchOutput
from seqgen_cli.search.rows import Rows, default_sync_every, start_history
from seqgen_cli.search.sampling import Streams
from seqgen_cli.search.settings import need_stop, rows_per_input, settings_for
from seqgen_cli.shapes import graph_width


class Refill:
    """One call of the refill engine: ``batch``'s inputs over ``lanes`` lanes (see the module docstring), run by the
    decode loop (``search/engine.py``) with lanes; this class joins the waiting inputs as cohorts.

    ``widths`` (decoder-only): each prompt's padded width, as ``generate()`` would count its positions; inputs of
    one width join as one cohort. ``streams``: sampling's per-input random streams."""

    def __init__(
        self,
        backend: RefillBackend,
        batch: Batch,
        config: GenerationConfig,
        lanes: int,
        widths: list[int],
        streams: Streams,
        stats: RefillStats,
        sync_every: int,
        stop: StopCheck | None = None,
        grammar: BatchGrammar | None = None,
    ) -> None:
        self.backend, self.batch, self.widths, self.streams, self.stats = backend, batch, widths, streams, stats
        self.stop, self.grammar = stop, grammar  # the stop strings' check (greedy, sampling); structured outputs
        num_inputs, device = batch.input_ids.shape[0], batch.input_ids.device
        self.device, self.r = device, rows_per_input(config)
        self.lengths = batch.attention_mask.sum(dim=1).tolist()
        # the settings of each prompt width: the same but for length limits counted from it (decoder-only)
        self.at_width = {w: settings_for(backend, _view(batch, w), config) for w in set(widths)}
        s = next(iter(self.at_width.values()))
        self.consts = BeamConstants.build(s, device)
        self.topk = pick_topk(torch.empty(0, dtype=getattr(backend, "dtype", torch.float32), device=device))
        self.max_new_tokens = max(x.max_new_tokens for x in self.at_width.values())
        count = max(1, min(lanes, num_inputs))
        state = backend.open_lanes(count, self.r, self.max_new_tokens)
        self.lanes = Lanes(backend, state, count, self.r, device, stats)
        self.engine = Engine(backend, state, sync_every, self.lanes)
        self.results = Results(num_inputs)

    def join(self, waiting: deque[int]) -> None:
        """The next waiting inputs into the free lanes (as many as fit): the encoder (prefill) for them, then a
        cohort per prompt width."""
        take = [waiting.popleft() for _ in range(min(len(self.lanes.free), len(waiting)))]
        used = self.lanes.take(take)
        lane_ids = torch.tensor(used, dtype=torch.long, device=self.device)  # [J]
        take_ids = torch.tensor(take, dtype=torch.long, device=self.device)
        encoder_decoder = self.backend.is_encoder_decoder
        joiners = _columns(self.batch, take_ids, max(self.lengths[b] for b in take), left=not encoder_decoder)
        first = self.backend.join(self.lanes.state, used, joiners)  # [J, V] (decoder-only) or None
        self.stats.joins += 1
        for w in sorted({self.widths[b] for b in take}):
            members = [j for j, b in enumerate(take) if self.widths[b] == w]
            pos = torch.tensor(members, dtype=torch.long, device=self.device)  # [J_c] among the joiners
            lanes, logits = (
                lane_ids.index_select(0, pos),
                None if first is None else first.index_select(0, pos),
            )
            self.start([take[j] for j in members], lanes, logits, w)

    def start(self, inputs: list[int], lane_ids: torch.Tensor, first: torch.Tensor | None, w: int) -> None:
        """A cohort: ``inputs`` in lanes ``lane_ids`` ([J] int64), prompts of width ``w``; ``first``: their first
        logits [J, V] (decoder-only)."""
        r, s = self.r, self.at_width[w]
        physical = self.lanes.rows(lane_ids)  # [J * R]
        ids = torch.tensor(inputs, dtype=torch.long, device=self.device)
        prompts = _columns(self.batch, ids, w, left=not self.backend.is_encoder_decoder)  # [J, w]
        history = start_history(self.backend, prompts, s, r)
        reorders = Reorders()
        grammar = self.grammar  # the batch's, or each input's: its cohort's inputs'
        if grammar is not None and not isinstance(grammar, Grammar):
            grammar = [grammar[b] for b in inputs]
        pipeline = LogitsPipeline(s, history, self.backend.vocab_size, self.device, grammar)
        rows = Rows(reorders, None, history, pipeline, r, inputs)
        search = make_search(rows, s, self.consts, self.topk, self.streams, self.stop)
        running = Placed(Cohort(rows, search, self.results), physical, reorders)
        if first is None:  # encoder-decoder: the next step feeds the decoder start token
            self.lanes.tokens.index_fill_(0, physical, s.decoder_start)
            self.engine.add(running)
            return
        nxt = running.cohort.advance(first.repeat_interleave(r, dim=0))  # [J * R]: the prefill's step
        reorders.rows = None  # no generated position is written yet: no back-pointer to move
        if nxt is None:  # one new token: done at once
            self.lanes.leave(inputs)
            return
        self.lanes.tokens.index_copy_(0, physical, nxt)
        self.engine.add(running)

    def run(self, order: Sequence[int], min_free: int) -> SearchOutput:
        """Join, step and check until every input in ``order`` has left."""
        waiting = deque(order)

        def join() -> bool:
            free, running = self.lanes.free, self.engine.running
            if waiting and free and (len(free) >= min_free or not running):
                self.join(waiting)
            return bool(waiting)

        self.engine.run(join)
        return self.results.output()


@torch.inference_mode()
def generate_refill(
    backend: Any,
    batch: Batch,
    config: GenerationConfig,
    *,
    lanes: int,
    seed: int | None = None,
    indices: Sequence[int] | None = None,
    order: Sequence[int] | None = None,
    min_free: int = 1,
    sync_every: int | None = None,
    stats: RefillStats | None = None,
    widths: Sequence[int] | None = None,
    lane_tokens: int | None = None,
    stop: StopCheck | None = None,
    grammar: BatchGrammar | None = None,
) -> SearchOutput:
    """Generate for every input of ``batch`` ([B, W]: right-padded sources, or left-padded prompts) over ``lanes``
    input lanes; returns what :func:`seqgen_cli.search.generate` returns (the same, token for token).

    ``order``: the order inputs join in (default: batch order); ``min_free``: join only when at least that many
    lanes are free (or none runs); ``seed``, ``indices``: sampling's streams, as ``generate`` takes them;
    ``widths`` (decoder-only): each prompt's padded width, at most ``W`` (default: ``W``); ``lane_tokens``: at
    most that many padded source tokens x rows over the lanes (fewer lanes where ``lanes`` would not fit at ``W``);
    ``stop``, ``grammar``: the stop strings' check and the outputs' grammar, as ``generate`` takes them.
    """
    need_stop(config, stop)
    if not isinstance(backend, RefillBackend):
        raise SeqgenError(
            "--refill runs the fast decoders only (seqgen models lists them; use --no-refill)"
        )
    num_inputs, width = batch.input_ids.shape
    if lane_tokens is not None:  # as many lanes as hold the window's widest source (graph width)
        held = graph_width(width, getattr(backend, "max_position_embeddings", None)) * rows_per_input(config)
        lanes = max(1, min(lanes, lane_tokens // held))
    lengths = batch.attention_mask.sum(dim=1).tolist()
    widths = [width] * num_inputs if widths is None or backend.is_encoder_decoder else list(widths)
    if any(not n <= w <= width for n, w in zip(lengths, widths, strict=True)):
        raise ValueError(f"prompt widths must lie between each prompt's length and the batch's width {width}")
    device = batch.input_ids.device
    engine = Refill(
        backend,
        batch,
        config,
        lanes,
        widths,
        Streams(seed, device, indices),
        stats if stats is not None else RefillStats(),
        sync_every or default_sync_every(device),
        stop,
        grammar,
    )
    return engine.run(range(num_inputs) if order is None else order, min_free)


def _view(batch: Batch, width: int) -> Batch:
    """A batch of ``width`` columns (what settings depend on): a view of ``batch``'s first."""
    return Batch(batch.input_ids[:, :width], batch.attention_mask[:, :width])


def _columns(batch: Batch, inputs: torch.Tensor, width: int, left: bool = False) -> Batch:
    """Inputs ``inputs`` ([J] int64) of ``batch``, their ``width`` columns: the first (right-padded sources) or the
    last (``left``: left-padded prompts)."""
    chosen = batch.select(inputs)
    cols = slice(chosen.input_ids.shape[1] - width, None) if left else slice(0, width)
    return Batch(chosen.input_ids[:, cols], chosen.attention_mask[:, cols], breaks=chosen.breaks)
