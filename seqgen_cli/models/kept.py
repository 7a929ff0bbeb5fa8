"""The capture path's kept states: one static state per captured batch shape, for the ``CapturedBackend``'s life.

CUDA graphs read a state's tensors in place (static addresses, :func:`mark_static`), and cudagraph trees record a
graph again for every new set of addresses, keep every recording and check them on every call. So the pool
(:class:`KeptStates`) keeps one static state per batch shape (:class:`Kept`: graph inputs, rows per input, width,
positions; the wrapped backend's state and the step's token buffer): the first batch of a shape allocates it (the
backend's ``start``), every later one refills it in place (``restart``: encoder outputs, cross K/V or prompt K/V and
masks copied in; the self-attention cache, back-pointers and counters reset), and a compaction copies the running
inputs into the smaller shape's kept state (``compact``, allocating it the first time). A batch's addresses are its
shape's, so each (shape, span bucket) records once per kept state. A batch on a kept state is a
:class:`CapturedState` (where its running rows are: :meth:`KeptStates.open` starts it, :meth:`KeptStates.keep`
idles finished inputs and compacts). One batch at a time: a batch whose kept state a later batch took (or that was
released) raises on its next call instead of reading another batch's caches. The static beam search's state
(``search/static.py``) is kept with its shape's state (``Kept.search``), its bytes counted in the kept state's.

The kept states (one per batch shape seen: input counts and widths are powers of two) stay allocated beside the
running batch, their bytes held against the run's :class:`~seqgen_cli.budget.DeviceBudget` (the budget the
batcher cuts batches by; on the CPU no limit): a new shape first releases the least recently used idle ones until
they and the new batch's state and logits fit; an out-of-memory error releases every one before it is raised (the
batch is split).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.batching import LOGIT_BYTES
from seqgen_cli.budget import DeviceBudget
from seqgen_cli.errors import is_oom
from seqgen_cli.models.fast import FastBackend, FastState
from seqgen_cli.models.kv_store import select_into
from seqgen_cli.search.protocol import Batch, StaticLayout
from seqgen_cli.shapes import compacted

# a kept state's shape: (graph inputs, rows per input, graph width, new-token positions)
Key = tuple[int, int, int, int]


def tensors_of(obj: Any, seen: set[int] | None = None) -> Iterator[Tensor]:
    """Every tensor a backend or its state holds (attributes, lists, ``partial`` arguments, nested objects;
    not inside ``nn.Module``s, whose parameters torch.compile already treats as static), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from tensors_of(item, seen)
    elif isinstance(obj, partial):
        yield from tensors_of([*obj.args, *obj.keywords.values()], seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module | type):
        for value in vars(obj).values():
            yield from tensors_of(value, seen)


def mark_static(obj: Any) -> None:
    """The tensors of a backend (fused weights) or its state keep their addresses while a graph replays
    (reorder is in place): CUDA graphs read them where they are instead of copying them in every replay. A new
    address re-records the graph (torch's limit: 128 re-records per function): batch states are kept per shape,
    so only a new shape (or a refill window's lanes) brings new ones."""
    for t in tensors_of(obj):
        torch._dynamo.mark_static_address(t)


def held_bytes(tensors: Iterable[Tensor]) -> int:
    """Device bytes behind ``tensors``: each storage once (views and shared tensors count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@dataclass(eq=False)
class Kept:
    """One captured batch shape's state, kept for the pool's life: the wrapped backend's static state and the
    step's token buffer, allocated once, refilled by every batch (or compaction) of the shape, so their addresses,
    which CUDA graphs read in place, never change."""

    key: Key
    inner: FastState  # the wrapped backend's static state
    tokens: Tensor  # [L * R] int64: the step's input tokens for every physical row
    nbytes: int = 0  # device bytes held (each storage once), the kept search state's with them
    owner: weakref.ref[CapturedState] | None = None  # the batch running on it; None: idle
    used: int = 0  # when a batch last took it (least recently used is released first)
    search: tuple[Any, Any] | None = None  # (key, state) of the static search kept with it (search/static.py)


@dataclass
class CapturedState:
    """A batch on its shape's kept state (``CapturedBackend.start``): the backend's state over the padded batch,
    and where the running rows are in it."""

    inner: FastState  # the wrapped backend's state (physical lanes): a kept one
    rows_per_input: int
    inputs: Tensor  # [B] int64: physical lane of each running input
    rows: Tensor  # [B * R] int64: physical row of each running row
    tokens: Tensor  # [L * R] int64: the step's input tokens for every physical row (idle rows: stale ones)
    limit: int  # steps the search may run (positions are rounded up)
    shape: tuple[int, ...]  # (physical rows, padded width, positions): a compiled graph per span bucket each
    start: int  # lanes at the start (compaction stops at a quarter of them)
    kept: Kept = field(repr=False)  # whose buffers ``inner`` and ``tokens`` are
    moved: Tensor | None = None  # [lanes * R] after a keep moved the rows to fewer lanes: each row's old row

    def feed(self, tokens: Tensor) -> bool:
        """The step's ``tokens`` into the token buffer: the running rows' [N] copied into their rows (``False``), or
        the buffer itself, a static search's (``True``: the step's logits are every row's)."""
        if tokens is self.tokens:
            return True
        self.tokens.index_copy_(0, self.rows, tokens)
        return False

    def physical(self, rows: Tensor) -> Tensor:
        """A reorder as one of every physical row: of the running rows ([N]: physical row ``self.rows[i]``
        continues ``self.rows[rows[i]]``, idle rows continue themselves), or of every row ([L * R]) as it is."""
        n = self.tokens.shape[0]
        if rows.shape[0] == n:  # every row (when none idles, running rows are every row: the same map)
            return rows
        physical = torch.arange(n, device=rows.device)  # [L * R]
        return physical.index_copy_(0, self.rows, self.rows.index_select(0, rows))

    def layout(self, encoder_decoder: bool) -> StaticLayout:
        """The running inputs' lanes, the token buffer, the history's prompt width (decoder-only: the graph width)
        and new-token positions, and the last keep's move (``search/static.py``)."""
        width = 1 if encoder_decoder else self.shape[1]
        return StaticLayout(self.inputs, self.tokens, width, self.shape[2], self.moved)


class KeptStates:
    """The pool of kept states of one ``CapturedBackend`` (module docstring): ``backend``'s static states by shape,
    their bytes held against ``budget``; ``allocations`` per shape and ``released`` for ``--stats``."""

    def __init__(self, backend: FastBackend, device: torch.device, budget: DeviceBudget) -> None:
        self.backend, self.device, self.budget = backend, device, budget
        self.kept: dict[Key, Kept] = {}  # a static state per batch shape
        self.allocations: Counter[Key] = Counter()  # kept states allocated, per shape (a release frees one)
        self.released = 0  # kept states released (room for another shape; out of memory)
        self._uses = 0  # batches and compactions that took a kept state (its ``used`` stamp)

    @property
    def nbytes(self) -> int:
        """Device bytes the kept states hold."""
        return sum(kept.nbytes for kept in self.kept.values())

    def open(self, key: Key, batch: Batch, running: int, limit: int) -> tuple[CapturedState, Tensor | None]:
        """``batch`` (padded to shape ``key``; its first ``running`` inputs real) on the kept state of ``key``, for
        at most ``limit`` steps, and its first logits: the state allocated by the shape's first batch (the
        backend's ``start``; its cache made static: a shape per span bucket), refilled in place by every later one
        (``restart``: nothing allocated). One batch at a time: an earlier batch of the shape that is still held
        cannot step on (its buffers are taken)."""
        kept, (inputs, r, width, positions) = self.kept.get(key), key
        try:
            if kept is None:
                self.make_room(key, busy=())
                inner, first = self.backend.start(batch, r, positions)
                inner.cache.make_static()
                kept = self._keep(key, inner)
            else:
                first = self.backend.restart(kept.inner, batch)
                kept.tokens.zero_()
        except Exception as err:
            self.release_if_oom(err)
            raise
        arange = partial(torch.arange, device=kept.tokens.device)
        state = CapturedState(
            kept.inner,
            r,
            inputs=arange(running),
            rows=arange(running * r),
            tokens=kept.tokens,
            limit=limit,
            shape=(inputs * r, width, positions),
            start=inputs,
            kept=kept,
        )
        self.take(kept, state)
        return state, None if first is None else first[:running]  # [B, V]

    def keep(self, state: CapturedState, keep: Tensor, rows: Tensor) -> None:
        """Finished inputs idle in their lanes; the lanes shrink (a new shape) only to a smaller power of two, at
        most two halvings (``shapes.compacted``): the running inputs move into the smaller shape's kept state
        (:meth:`compact`), and the larger one waits for the next batch of its shape."""
        inputs, r = state.inputs.index_select(0, keep), state.rows_per_input  # [B']
        state.moved, b = None, inputs.shape[0]
        lanes = compacted(b, state.start)
        if lanes * r == state.tokens.shape[0]:
            state.inputs, state.rows = inputs, state.rows.index_select(0, rows)
            return
        self.check(state)
        kept = torch.cat([inputs, inputs[-1:].expand(lanes - b)])  # [lanes]: the last one again as padding
        kept_rows = (kept[:, None] * r + torch.arange(r, device=kept.device)).reshape(-1)  # [lanes * R]
        target = self.compact(state.kept, (lanes, *state.kept.key[1:]), kept, kept_rows)
        self.take(target, state)
        state.inner, state.tokens, state.kept = target.inner, target.tokens, target
        state.inputs = torch.arange(b, device=kept.device)
        state.rows = torch.arange(b * r, device=kept.device)
        state.shape, state.moved = (lanes * r, *state.shape[1:]), kept_rows

    def compact(self, source: Kept, key: Key, inputs: Tensor, rows: Tensor) -> Kept:
        """The running ``inputs`` of ``source`` (their physical ``rows``) copied into the kept state of shape
        ``key`` (allocated by the first compaction to it), their tokens too; ``source`` goes idle (the next batch
        of its shape takes it)."""
        target = self.kept.get(key)
        try:
            if target is None:
                self.make_room(key, busy=[source.key])
                target = self._keep(key, self.backend.keep_into(source.inner, inputs, rows))
            else:
                self.backend.keep_into(source.inner, inputs, rows, into=target.inner)
        except Exception as err:
            self.release_if_oom(err)
            raise
        select_into(target.tokens, source.tokens, rows)
        source.owner = None
        return target

    def take(self, kept: Kept, state: CapturedState) -> None:
        """``state`` runs on ``kept`` from now on (an earlier holder cannot step on)."""
        self._uses += 1
        kept.owner, kept.used = weakref.ref(state), self._uses

    def check(self, state: CapturedState) -> None:
        """``state`` still holds its kept state (not taken by a later batch, nor released)."""
        owner = state.kept.owner
        if owner is None or owner() is not state:
            raise RuntimeError(
                f"the kept state of shape {state.kept.key} was taken by a later batch or released: "
                "a CapturedBackend runs one batch at a time"
            )

    def search(self, kept: Kept, key: Any, make: Callable[[], Any]) -> Any:
        """The static search's state kept with ``kept``: ``make()``, its tensors marked static, the first time or when
        ``key`` changes; its bytes count in the kept state's."""
        if kept.search is None or kept.search[0] != key:
            search = make()
            mark_static(search)
            kept.search = (key, search)
            self._count(kept, held_bytes([*tensors_of(kept.inner), kept.tokens, *tensors_of(search)]))
        return kept.search[1]

    def batch_bytes(self, key: Key) -> int:
        """Device bytes a batch of shape ``key`` holds: its state (``cache_bytes``) and its logits rows."""
        inputs, r, width, positions = key
        caches = self.backend.cache_bytes(inputs, width, r, positions)
        return caches + inputs * r * self.backend.vocab_size * LOGIT_BYTES

    def make_room(self, key: Key, busy: Iterable[Key]) -> None:
        """Release kept states (least recently used first, never those of ``busy``) until what is held and a batch
        of shape ``key`` (:meth:`batch_bytes`) fit the budget."""
        need, busy = self.batch_bytes(key), set(busy)
        for kept in sorted((k for k in self.kept.values() if k.key not in busy), key=lambda k: k.used):
            if self.budget.fits(need):
                break
            self._drop(kept)

    def release_if_oom(self, err: BaseException) -> None:
        """Out of memory: release every kept state (the batch is split, its halves find the memory they held)."""
        if is_oom(err):
            for kept in list(self.kept.values()):
                self._drop(kept)

    def stats(self) -> dict[str, int]:
        """For ``--stats``: batch shapes held, their bytes, allocations and releases."""
        return {
            "kept_shapes": len(self.kept),
            "kept_bytes": self.nbytes,
            "kept_allocations": sum(self.allocations.values()),
            "kept_released": self.released,
        }

    def _keep(self, key: Key, inner: FastState) -> Kept:
        """A newly allocated static state becomes the kept one of ``key``, its tensors static addresses."""
        tokens = torch.zeros(key[0] * key[1], dtype=torch.long, device=self.device)
        mark_static(inner)
        torch._dynamo.mark_static_address(tokens)
        kept = self.kept[key] = Kept(key, inner, tokens)
        self.allocations[key] += 1
        self._count(kept, held_bytes([*tensors_of(inner), tokens]))
        self.budget.set_up()
        return kept

    def _count(self, kept: Kept, nbytes: int) -> None:
        """``kept`` holds ``nbytes`` from now on (against the budget while the pool keeps it)."""
        if self.kept.get(kept.key) is kept:
            self.budget.hold(nbytes - kept.nbytes)
        kept.nbytes = nbytes

    def _drop(self, kept: Kept) -> None:
        del self.kept[kept.key]
        kept.owner = None  # a state still running on it fails its next call
        self.released += 1
        self.budget.hold(-kept.nbytes)
