"""The refill engine (``--refill``): generation over a fixed set of input slots; an input that finishes hands its
slot to a waiting one, so steps run with full batches instead of a shrinking tail. Every fast backend refills:
the encoder-decoder ones (BART family, T5) and the decoder-only ones (GPT-2, Llama).

Slots. ``S`` input slots of ``R`` rows each (beams, or samples) live in the model backend's state
(``open_slots``): per slot the source's cross-attention keys/values and mask (encoder-decoder) or the prompt's
keys/values and mask (decoder-only), and a self-attention cache with a step counter per slot
(``models/kv_cache.py``: ``SlotKVCache``, ``DecoderOnlySlotKVCache``). Every decode step runs all ``S * R`` rows
(``slot_step``), each slot at its own step: one shape per span bucket and source width, so on CUDA the
backend is a ``CapturedBackend`` whose ``slot_step`` replays a CUDA graph (``models/capture.py``).

Cohorts. Inputs that join at the same host check (decoder-only: with the same prompt width) form a *cohort*: they
run in lockstep, so a cohort is searched exactly as one batch of the ordinary engine, by the same code
(``BeamSearch`` / ``TokenSearch`` over a ``Rows`` of its own: history, processors, n-gram blocker, beam state).
Each step the engine hands every cohort its rows' logits; the cohorts' beam reorderings go to the backend as one
permutation.

Life cycle of an input: *join* (at a host check, into a free slot: the encoder, or the prompt's prefill, runs for
the joiners only and fills the slots' rows, their self-attention restarts at step 0, a new cohort starts with
fresh search state; decoder-only, the prefill's logits are the cohort's first step at once, as in the ordinary
engine), *run*, *leave* (the periodic host check, ``Rows.check``, finds it done: its results are copied out and
its slot is free; its rows idle until the next join). Joiners are taken from the waiting inputs in the order
given (the caller sorts them by length, so neighbours share a width bucket); a wider joiner widens every slot's
source (prompt) columns, masked. Results are per input index: the writer's order is the caller's business.

Exactness: an input's search is the ordinary one, and its decoder arithmetic does not depend on its
neighbours' steps (a span bucket of slots attended under a mask) nor, decoder-only, on who joins with it (each
prompt is prefilled at a width of its own length), so outputs are token-identical to ``generate()``
(tests/test_slots.py runs the equivalence harness with joins at many different steps) and equal to the input's
own run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from seqgen_cli.errors import SeqgenError
from seqgen_cli.search.beam import BeamConstants, BeamSearch, pick_topk
from seqgen_cli.search.greedy import TokenSearch
from seqgen_cli.search.processors import LogitsPipeline
from seqgen_cli.search.protocol import Batch, SearchOutput
from seqgen_cli.search.rows import Rows, default_sync_every, start_history
from seqgen_cli.search.sampling import draw
from seqgen_cli.search.settings import SearchSettings, settings_for


@dataclass
class SlotStats:
    """What a refill run did (``--stats``): decode steps, rows run and rows of a live input, joins."""

    steps: int = 0
    row_steps: int = 0  # rows run: S * R per step
    live_row_steps: int = 0  # rows of an input not yet seen done
    joins: int = 0  # host checks at which inputs joined

    @property
    def occupancy(self) -> float:
        return self.live_row_steps / self.row_steps if self.row_steps else 0.0

    def add(self, other: SlotStats) -> None:
        self.steps += other.steps
        self.row_steps += other.row_steps
        self.live_row_steps += other.live_row_steps
        self.joins += other.joins


class _Reorders:
    """The backend a cohort's :class:`Rows` sees: it records the cohort's beam reordering (cohort rows) for the
    engine to apply with every other cohort's; inputs that leave idle in their slots (no drop)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def reorder(self, state: Any, rows: torch.Tensor) -> None:
        self.rows = rows

    def drop(self, state: Any, keep: torch.Tensor, rows: torch.Tensor) -> None:
        pass


@dataclass
class _Cohort:
    """Inputs that joined together: one search, in lockstep."""

    search: BeamSearch | TokenSearch
    rows: Rows
    reorders: _Reorders
    physical: torch.Tensor  # [N_c] int64: the cohort's running rows among the S * R


def input_seed(seed: int, index: int) -> int:
    """The seed of input ``index``'s random stream: a function of ``--seed`` and the index only."""
    return (seed * 1_000_003 + index) % (2**63)


@torch.inference_mode()
def generate_slots(
    backend: Any,
    batch: Batch,
    config: GenerationConfig,
    *,
    slots: int,
    seed: int | None = None,
    indices: Sequence[int] | None = None,
    order: Sequence[int] | None = None,
    min_free: int = 1,
    sync_every: int | None = None,
    stats: SlotStats | None = None,
    widths: Sequence[int] | None = None,
) -> SearchOutput:
    """Generate for every input of ``batch`` ([B, W]: right-padded sources, or left-padded prompts) over ``slots``
    input slots.

    ``order``: the order inputs join in (default: batch order); ``min_free``: join only when at least that many
    slots are free (or none runs); ``indices``: each input's index for its sampling stream (default: batch
    position), seeded by :func:`input_seed`; ``widths`` (decoder-only): each prompt's padded width, at most
    ``W``, as ``generate()`` would count its positions (``max_length``, ``min_length``; default: ``W``): inputs of
    one width join as one cohort. Returns what :func:`seqgen_cli.search.generate` returns.
    """
    if not hasattr(backend, "open_slots"):
        raise SeqgenError(
            "--refill runs the fast backends only: BART family, T5, GPT-2, Llama (use --no-refill)"
        )
    s = settings_for(backend, batch, config)
    num_inputs, width = batch.input_ids.shape
    device = batch.input_ids.device
    lengths = batch.attention_mask.sum(dim=1).tolist()
    widths = [width] * num_inputs if widths is None or backend.is_encoder_decoder else list(widths)
    if any(not n <= w <= width for n, w in zip(lengths, widths, strict=True)):
        raise ValueError(f"prompt widths must lie between each prompt's length and the batch's width {width}")
    # the settings of each prompt width: the same but for length limits counted from it (decoder-only)
    at_width = {w: settings_for(backend, _view(batch, w), config) for w in set(widths)}
    max_new_tokens = max(x.max_new_tokens for x in at_width.values())
    r = s.num_beams if s.mode == "beam" else (s.num_return_sequences if s.mode == "sample" else 1)
    sync_every = sync_every or default_sync_every(device)
    stats = stats if stats is not None else SlotStats()
    indices = list(range(num_inputs)) if indices is None else list(indices)
    waiting = deque(range(num_inputs) if order is None else order)
    num_slots = max(1, min(slots, num_inputs))
    state = backend.open_slots(num_slots, r, max_new_tokens)
    consts = BeamConstants.build(s, device) if s.mode == "beam" else None
    eos = torch.tensor(s.eos, dtype=torch.long, device=device) if s.eos else None
    tokens = torch.zeros(num_slots * r, dtype=torch.long, device=device)  # [S * R]: the next step's input
    identity = torch.arange(num_slots * r, device=device)
    free = list(range(num_slots))
    slot_of: dict[int, int] = {}
    generators: dict[int, torch.Generator] = {}
    cohorts: list[_Cohort] = []
    results: list[list[list[int]]] = [[] for _ in range(num_inputs)]
    result_scores: list[list[float]] | None = [[] for _ in range(num_inputs)] if s.mode == "beam" else None

    def sample_pick(rows: Rows):
        def pick(scores: torch.Tensor) -> torch.Tensor:  # [N_c, V] -> [N_c]: each input from its own stream
            probs = torch.nn.functional.softmax(scores, dim=-1)
            return torch.cat(
                [draw(probs[j * r : (j + 1) * r], generators[b]) for j, b in enumerate(rows.inputs)]
            )

        return pick

    topk = pick_topk(torch.empty(0, dtype=getattr(backend, "dtype", torch.float32), device=device))

    def search_for(rows: Rows, s: SearchSettings) -> BeamSearch | TokenSearch:
        if consts is not None:
            return BeamSearch(rows, s, consts, topk)
        if s.mode == "sample":
            return TokenSearch(rows, s, sample_pick(rows), eos)
        return TokenSearch(rows, s, lambda scores: scores.argmax(dim=-1), eos)

    def collect(cohort: _Cohort, idx: torch.Tensor, inputs: list[int]) -> None:
        sequences, scores = cohort.search.results(idx)
        for j, b in enumerate(inputs):
            results[b] = sequences[j]
            if result_scores is not None and scores is not None:
                result_scores[b] = scores[j]
            free.append(slot_of.pop(b))
            generators.pop(b, None)
        free.sort()

    def join() -> None:
        take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        used = free[: len(take)]
        del free[: len(take)]
        slot_ids = torch.tensor(used, dtype=torch.long, device=device)  # [J]
        take_ids = torch.tensor(take, dtype=torch.long, device=device)
        joiners = _columns(
            batch, take_ids, max(lengths[b] for b in take), left=not backend.is_encoder_decoder
        )
        first = backend.join(state, slot_ids, joiners)  # [J, V] (decoder-only) or None
        for b, slot in zip(take, used, strict=True):
            slot_of[b] = slot
            if s.mode == "sample":
                gen = torch.Generator(device=device)
                generators[b] = gen.manual_seed(input_seed(0 if seed is None else seed, indices[b]))
        stats.joins += 1
        for w in sorted({widths[b] for b in take}):  # a cohort per prompt width
            members = [j for j, b in enumerate(take) if widths[b] == w]
            pos = torch.tensor(members, dtype=torch.long, device=device)  # [J_c]: among the joiners
            start(
                [take[j] for j in members],
                slot_ids.index_select(0, pos),
                None if first is None else first.index_select(0, pos),
                w,
            )

    def start(inputs: list[int], slot_ids: torch.Tensor, first: torch.Tensor | None, w: int) -> None:
        """A cohort: ``inputs`` in slots ``slot_ids`` ([J] int64), prompts of width ``w``; ``first``: their first
        logits [J, V] (decoder-only)."""
        physical = (slot_ids[:, None] * r + torch.arange(r, device=device)).reshape(-1)  # [J * R]
        ids = torch.tensor(inputs, dtype=torch.long, device=device)
        prompts = _columns(batch, ids, w, left=not backend.is_encoder_decoder)  # [J, w]
        cs = at_width[w]
        history = start_history(backend, prompts, cs, r)
        reorders = _Reorders()
        rows = Rows(
            reorders, None, history, LogitsPipeline(cs, history, backend.vocab_size, device), r, inputs
        )
        cohort = _Cohort(search_for(rows, cs), rows, reorders, physical)
        if first is None:  # encoder-decoder: the next slot step feeds the decoder start token
            tokens.index_fill_(0, physical, cs.decoder_start)
            cohorts.append(cohort)
            return
        # decoder-only: the prefill's logits are the search's first step (as start_rows gives them)
        nxt = cohort.search.advance(first.repeat_interleave(r, dim=0))  # [J * R]
        reorders.rows = None  # no generated slot is written yet: no back-pointer to move
        if nxt is None:  # one new token: done at once
            collect(cohort, *rows.remaining())
            return
        tokens.index_copy_(0, physical, nxt)
        cohorts.append(cohort)

    fed = 0 if backend.is_encoder_decoder else 1  # tokens a cohort picks before its first slot step
    while True:
        if waiting and free and (len(free) >= min_free or not cohorts):
            join()
        if not cohorts:
            if waiting:
                continue  # every joiner was done at its join
            break
        stats.steps += 1
        stats.row_steps += num_slots * r
        stats.live_row_steps += sum(c.physical.shape[0] for c in cohorts)
        step = max(c.search.t for c in cohorts) - fed  # the generated slot the most advanced cohort writes
        logits = backend.slot_step(state, tokens, step)  # [S * R, V]
        perm: torch.Tensor | None = None
        for cohort in list(cohorts):
            nxt = cohort.search.advance(logits.index_select(0, cohort.physical))  # [N_c]
            if nxt is None:  # its last step: every input done
                collect(cohort, *cohort.rows.remaining())
                cohorts.remove(cohort)
                continue
            if cohort.reorders.rows is not None:
                perm = identity.clone() if perm is None else perm
                perm.index_copy_(0, cohort.physical, cohort.physical.index_select(0, cohort.reorders.rows))
                cohort.reorders.rows = None
            tokens.index_copy_(0, cohort.physical, nxt)
        if perm is not None:
            backend.reorder(state, perm)
        if stats.steps % sync_every == 0:
            for cohort in list(cohorts):
                done = cohort.search.done()
                leaving = cohort.rows.check(done) if done is not None else None
                if leaving is None:
                    continue
                collect(cohort, leaving.done, leaving.inputs)
                if leaving.all_done:
                    cohorts.remove(cohort)
                else:
                    cohort.search.keep(leaving)
                    cohort.physical = cohort.physical.index_select(0, leaving.kept_rows)
    return SearchOutput(sequences=results, scores=result_scores)


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
