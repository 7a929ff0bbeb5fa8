"""The refill engine (``--refill``): generation over a fixed set of input *lanes*; an input that finishes hands its
lane to a waiting one, so steps run with full batches instead of a shrinking tail. Every fast backend refills (a
:class:`~seqgen_cli.search.protocol.RefillBackend`): the encoder-decoder ones (BART family, T5) and the
decoder-only ones (GPT-2, Llama).

Lanes. ``L`` lanes of ``R`` rows each (beams, or samples) live in the model backend's state (``open_lanes``): per
lane the source's cross-attention keys/values and mask (encoder-decoder) or the prompt's keys/values and mask
(decoder-only), and a self-attention cache with a step counter per lane (``models/kv_cache.py``: ``LaneKVCache``,
``DecoderOnlyLaneKVCache``). Every decode step runs all ``L * R`` rows (``lane_step``), each lane at its own step:
one shape per span bucket and source width, so on CUDA the backend is a ``CapturedBackend`` whose ``lane_step``
replays a CUDA graph (``models/capture.py``).

Cohorts. Inputs that join at the same host check (decoder-only: with the same prompt width) form a
:class:`~seqgen_cli.search.cohort.Cohort`: they run in lockstep, searched exactly as one batch of the ordinary
engine, by the same code (:func:`~seqgen_cli.search.cohort.make_search` over a ``Rows`` of their own). Each step
the engine hands every cohort its rows' logits; the cohorts' beam reorderings go to the backend as one permutation.

Life cycle of an input: *join* (at a host check, into a free lane: the encoder, or the prompt's prefill, runs for
the joiners only and fills the lanes' rows, their self-attention restarts at step 0, a new cohort starts with fresh
search state; decoder-only, the prefill's logits are the cohort's first step at once, as in the ordinary engine),
*run*, *leave* (the periodic host check finds it done: its results are collected and its lane is free; its rows
idle until the next join). Joiners are taken from the waiting inputs in the order given (the caller sorts them by
length, so neighbours share a width bucket); a wider joiner widens every lane's source (prompt) columns, masked.

Exactness: an input's search is the ordinary one, and its decoder arithmetic does not depend on its neighbours'
steps (a span bucket of cache slots attended under a mask) nor, decoder-only, on who joins with it (each prompt
is prefilled at a width of its own length), so outputs are token-identical to ``generate()`` (tests/test_refill.py
runs the equivalence harness with joins at many different steps) and equal to the input's own run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from seqgen_cli import openmp
from seqgen_cli.errors import SeqgenError
from seqgen_cli.search.beam import BeamConstants, pick_topk
from seqgen_cli.search.cohort import Cohort, Results, make_search
from seqgen_cli.search.processors import LogitsPipeline
from seqgen_cli.search.protocol import Batch, RefillBackend, SearchOutput
from seqgen_cli.search.rows import Rows, default_sync_every, start_history
from seqgen_cli.search.sampling import Streams
from seqgen_cli.search.settings import SearchSettings, rows_per_input, settings_for


@dataclass
class RefillStats:
    """What a refill run did (``--stats``): decode steps, rows run and rows of a live input, joins."""

    steps: int = 0
    row_steps: int = 0  # rows run: L * R per step
    live_row_steps: int = 0  # rows of an input not yet seen done
    joins: int = 0  # host checks at which inputs joined

    @property
    def occupancy(self) -> float:
        return self.live_row_steps / self.row_steps if self.row_steps else 0.0

    def report(self) -> dict[str, float]:
        """For ``--stats`` (``device.refill``)."""
        return {
            "occupancy": round(self.occupancy, 4), "joins": self.joins, "steps": self.steps,
            "row_steps": self.row_steps, "live_row_steps": self.live_row_steps,
        }  # fmt: skip

    def add(self, other: RefillStats) -> None:
        self.steps += other.steps
        self.row_steps += other.row_steps
        self.live_row_steps += other.live_row_steps
        self.joins += other.joins


class _Reorders:
    """The backend a cohort's :class:`Rows` sees: it records the cohort's beam reordering (cohort rows) for the
    engine to apply with every other cohort's; inputs that leave idle in their lanes (no drop)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def reorder(self, state: Any, rows: torch.Tensor) -> None:
        self.rows = rows

    def drop(self, state: Any, keep: torch.Tensor, rows: torch.Tensor) -> None:
        pass


@dataclass
class _Running:
    """A cohort and where it runs: ``physical`` [N_c] int64, its running rows among the ``L * R``."""

    cohort: Cohort
    reorders: _Reorders
    physical: torch.Tensor


class Refill:
    """One call of the refill engine: ``batch``'s inputs over ``lanes`` lanes (see the module docstring).

    ``widths`` (decoder-only): each prompt's padded width, as ``generate()`` would count its positions; inputs of
    one width join as one cohort. ``streams``: sampling's per-input random streams."""

    def __init__(
        self, backend: RefillBackend, batch: Batch, config: GenerationConfig, lanes: int, widths: list[int],
        streams: Streams, stats: RefillStats,
    ) -> None:  # fmt: skip
        self.backend, self.batch, self.widths, self.streams, self.stats = (
            backend,
            batch,
            widths,
            streams,
            stats,
        )
        num_inputs, device = batch.input_ids.shape[0], batch.input_ids.device
        self.device, self.r = device, rows_per_input(config)
        self.lengths = batch.attention_mask.sum(dim=1).tolist()
        # the settings of each prompt width: the same but for length limits counted from it (decoder-only)
        self.at_width = {w: settings_for(backend, _view(batch, w), config) for w in set(widths)}
        s = next(iter(self.at_width.values()))
        self.consts = BeamConstants.build(s, device)
        self.topk = pick_topk(torch.empty(0, dtype=getattr(backend, "dtype", torch.float32), device=device))
        self.max_new_tokens = max(x.max_new_tokens for x in self.at_width.values())
        self.num_lanes = max(1, min(lanes, num_inputs))
        self.state = backend.open_lanes(self.num_lanes, self.r, self.max_new_tokens)
        self.tokens = torch.zeros(
            self.num_lanes * self.r, dtype=torch.long, device=device
        )  # [L * R] next input
        self.identity = torch.arange(self.num_lanes * self.r, device=device)
        self.free = list(range(self.num_lanes))
        self.lane_of: dict[int, int] = {}
        self.running: list[_Running] = []
        self.results = Results(num_inputs)

    # -- joining -------------------------------------------------------------------------------------------------
    def join(self, waiting: deque[int]) -> None:
        """The next waiting inputs into the free lanes (as many as fit): the encoder (prefill) for them, then a
        cohort per prompt width."""
        take = [waiting.popleft() for _ in range(min(len(self.free), len(waiting)))]
        used, self.free = self.free[: len(take)], self.free[len(take) :]
        lane_ids = torch.tensor(used, dtype=torch.long, device=self.device)  # [J]
        take_ids = torch.tensor(take, dtype=torch.long, device=self.device)
        encoder_decoder = self.backend.is_encoder_decoder
        joiners = _columns(self.batch, take_ids, max(self.lengths[b] for b in take), left=not encoder_decoder)
        first = self.backend.join(self.state, lane_ids, joiners)  # [J, V] (decoder-only) or None
        self.lane_of.update(zip(take, used, strict=True))
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
        physical = (lane_ids[:, None] * r + torch.arange(r, device=self.device)).reshape(-1)  # [J * R]
        ids = torch.tensor(inputs, dtype=torch.long, device=self.device)
        prompts = _columns(self.batch, ids, w, left=not self.backend.is_encoder_decoder)  # [J, w]
        history = start_history(self.backend, prompts, s, r)
        reorders = _Reorders()
        pipeline = LogitsPipeline(s, history, self.backend.vocab_size, self.device)
        rows = Rows(reorders, None, history, pipeline, r, inputs)
        running = _Running(Cohort(rows, self._search(rows, s), self.results), reorders, physical)
        if first is None:  # encoder-decoder: the next lane step feeds the decoder start token
            self.tokens.index_fill_(0, physical, s.decoder_start)
            self.running.append(running)
            return
        nxt = running.cohort.advance(first.repeat_interleave(r, dim=0))  # [J * R]: the prefill's step
        reorders.rows = None  # no generated slot is written yet: no back-pointer to move
        if nxt is None:  # one new token: done at once
            self._free(inputs)
            return
        self.tokens.index_copy_(0, physical, nxt)
        self.running.append(running)

    def _search(self, rows: Rows, s: SearchSettings) -> Any:
        return make_search(rows, s, self.consts, self.topk, self.streams)

    def _free(self, inputs: list[int]) -> None:
        self.free = sorted(self.free + [self.lane_of.pop(b) for b in inputs])

    # -- stepping ------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """One lane step over every lane, then each cohort's search step; the cohorts' reorderings at once."""
        fed = 0 if self.backend.is_encoder_decoder else 1  # tokens a cohort picks before its first lane step
        self.stats.steps += 1
        self.stats.row_steps += self.num_lanes * self.r
        self.stats.live_row_steps += sum(run.physical.shape[0] for run in self.running)
        step = max(run.cohort.search.t for run in self.running) - fed  # the cache slot the furthest writes
        logits = self.backend.lane_step(self.state, self.tokens, step)  # [L * R, V]
        openmp.tick()
        perm: torch.Tensor | None = None
        for run in list(self.running):
            nxt = run.cohort.advance(logits.index_select(0, run.physical))  # [N_c]
            if nxt is None:  # its last step: every input done
                self._free(run.cohort.rows.inputs)
                self.running.remove(run)
                continue
            if run.reorders.rows is not None:
                perm = self.identity.clone() if perm is None else perm
                perm.index_copy_(0, run.physical, run.physical.index_select(0, run.reorders.rows))
                run.reorders.rows = None
            self.tokens.index_copy_(0, run.physical, nxt)
        if perm is not None:
            self.backend.reorder(self.state, perm)

    def check(self) -> None:
        """The host check of every cohort: done inputs leave and free their lanes."""
        for run in list(self.running):
            leaving = run.cohort.check()
            if leaving is None:
                continue
            self._free(leaving.inputs)
            if leaving.all_done:
                self.running.remove(run)
            else:
                run.physical = run.physical.index_select(0, leaving.kept_rows)

    def run(self, order: Sequence[int], min_free: int, sync_every: int) -> SearchOutput:
        """Join, step and check until every input in ``order`` has left."""
        waiting = deque(order)
        while True:
            if waiting and self.free and (len(self.free) >= min_free or not self.running):
                self.join(waiting)
            if not self.running:
                if waiting:
                    continue  # every joiner was done at its join
                return self.results.output()
            self.step()
            if self.stats.steps % sync_every == 0:
                self.check()


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
) -> SearchOutput:
    """Generate for every input of ``batch`` ([B, W]: right-padded sources, or left-padded prompts) over ``lanes``
    input lanes; returns what :func:`seqgen_cli.search.generate` returns (the same, token for token).

    ``order``: the order inputs join in (default: batch order); ``min_free``: join only when at least that many
    lanes are free (or none runs); ``seed``, ``indices``: sampling's streams, as ``generate`` takes them;
    ``widths`` (decoder-only): each prompt's padded width, at most ``W`` (default: ``W``).
    """
    if not isinstance(backend, RefillBackend):
        raise SeqgenError(
            "--refill runs the fast backends only: BART family, T5, GPT-2, Llama (use --no-refill)"
        )
    num_inputs, width = batch.input_ids.shape
    lengths = batch.attention_mask.sum(dim=1).tolist()
    widths = [width] * num_inputs if widths is None or backend.is_encoder_decoder else list(widths)
    if any(not n <= w <= width for n, w in zip(lengths, widths, strict=True)):
        raise ValueError(f"prompt widths must lie between each prompt's length and the batch's width {width}")
    device = batch.input_ids.device
    engine = Refill(
        backend, batch, config, lanes, widths, Streams(seed, device, indices),
        stats if stats is not None else RefillStats(),
    )  # fmt: skip
    order = range(num_inputs) if order is None else order
    return engine.run(order, min_free, sync_every or default_sync_every(device))


def _view(batch: Batch, width: int) -> Batch:
    """A batch of ``width`` columns (what settings depend on): a view of ``batch``'s first."""
    return Batch(batch.input_ids[:, :width], batch.attention_mask[:, :width])


def _columns(batch: Batch, inputs: torch.Tensor, width: int, left: bool = False) -> Batch:
    """Inputs ``inputs`` ([J] int64) of ``batch``, their ``width`` columns: the first (right-padded sources) or the
    last (``left``: left-padded prompts)."""
    ids = batch.input_ids.index_select(0, inputs)
    mask = batch.attention_mask.index_select(0, inputs)
    cols = slice(ids.shape[1] - width, None) if left else slice(0, width)
    return Batch(ids[:, cols], mask[:, cols])
