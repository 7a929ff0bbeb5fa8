"""A graph-capturable decode step and the capture path.

The fast backends' step has three parts; only the middle one touches the model, and it has static shapes:

    state.cache.check(state.t)                host: ValueError past the slots allocated by start()
    logits = backend.decode(state, tokens)    tensors only: the part that is compiled and captured
    state.t += 1; state.cache.advance()       host counter; the device slot tensor moves on (queued)

``decode`` reads the step's slot from a device tensor (``cache.slot``), writes the caches with
``index_copy_``, attends over a span bucket of the preallocated slots under a mask built from tensors and never
branches on the step number (``models/kv_cache.py``), so one compiled graph serves every step of a batch shape
within a span bucket (``shapes.span_bucket``: powers of two from 64; a step reads at most twice the slots
written, not all of them).

:class:`CapturedBackend` (CUDA, by default: a shape once its eager steps pay for compiling it,
:class:`Amortized`; ``--capture``: every shape at once) runs ``decode`` through
``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)``: a CUDA graph per batch shape and span
bucket, replayed every step. Shapes come from a small fixed set, so a long length-sorted run compiles a handful:
inputs are padded to a power-of-two number of *slots* (copies of the last input; their rows run idle),
sources (or prompts) to a power-of-two width (at least ``shapes.MIN_WIDTH``, at most the model's position limit) and
the new-token slots to a multiple of ``shapes.SLOTS``; finished inputs idle in their slot, and the rows are compacted
only when they fit a smaller power of two, at most twice per batch (:func:`~seqgen_cli.shapes.compacted`). Each instance compiles
at most ``max_shapes`` shapes (torch's recompile limit raised to match for its calls); later shapes run
``decode`` eagerly. ``scripts/capture_shapes.py`` counts the shapes of a CNN/DM run.

Kept states: the graphs read the state's tensors in place (static addresses), and cudagraph trees record a graph
again for every new set of addresses, keep every recording and check them on every call. So each instance keeps
one static state per batch shape (:class:`Kept`: graph inputs, rows per input, width, slots; the wrapped
backend's state and the step's token buffer) for its life: the first batch of a shape allocates it (the backend's
``start``), every later one refills it in place (``restart``: encoder outputs, cross K/V or prompt K/V and masks
copied in; the self-attention cache, back-pointers and counters reset), and a compaction copies the running
inputs into the smaller shape's kept state (``compact``, allocating it the first time). A batch's addresses
are its shape's, so each (shape, span bucket) records once per kept state. One batch at a time: a batch
whose kept state a later batch took (or that was released) raises on its next call instead of reading another
batch's caches. The kept states (one per batch shape seen: input counts and widths are powers of two) stay
allocated, beside the running batch, within ``keep_bytes`` (on CUDA the same free-memory budget the batcher
plans with): a new shape first releases the least recently used idle ones until they and the new batch's
state and logits fit; an out-of-memory error releases every one before it is raised (the batch is split).

How a compiled call is made and checked lives in ``models/compiled_calls.py`` (the search's step too:
:class:`CompiledSearch`), when a shape is worth compiling in ``models/amortized.py``.

Checked: each shape's first replay is compared with the eager step on the same state (``decode`` again:
idempotent); logits further apart than :func:`step_tolerance` switch to eager for good, with the reason. After
that, dynamo's guards: a shape's (key's) later calls run only the differentiating ones (:func:`call_under_limit`,
``settled``), the key naming every host value a graph depends on (batch shape, source width, slots, span bucket).

The beam search's step is compiled the same way (``search/slots.py``; ``search_compiler``, :func:`compile_search`,
which :func:`capture` passes): a pure function over the search's own static state, kept with each kept state
(``Kept.search``, :meth:`CapturedBackend.kept_search`, moved along by a compaction), that reads the logits of every
slot row (the search feeds :meth:`CapturedBackend.step` the kept token buffer itself: no gather of the running
rows) and writes the next step's tokens into that buffer; so a decode step is two graph replays (model, search) and a handful of launches around them.
:class:`CompiledSearch` guards it as ``decode`` is guarded below (the first replay of each shape checked, any
failure or CUDA-graph skip: the eager step for good, with the reason in ``path`` and ``stats()``).

Batches that would not run compiled run on the wrapped backend's own state (:class:`PlainRun`), as ``--no-capture``
runs them: no padding, finished inputs leaving at once, beam search as over any backend. That is a batch whose first
step's shape runs eagerly for good (after a failure, out of memory while compiling, inductor skipping it, past
``max_shapes``) or, under :class:`Amortized`, has not paid for compiling yet; its steps count for the shapes a kept
state would have run (:meth:`PlainRun.shape`), so a frequent shape pays and its next batch runs captured. Within a
captured batch, a later shape (a span bucket, a compaction) that has not paid runs its steps eagerly on the kept
state until it does.

Fallbacks: every compiled call is guarded (cudagraph trees warm up on a shape's first call, record on the
second, replay from the third; a new batch of a kept shape replays). A failure (compile error, recording error, torch's
recompile limit, inductor skipping CUDA graphs: ``cudagraph_skips`` read around every call) falls back to
eager for good, with the reason in :attr:`CapturedBackend.path`; the failed call is rerun eagerly (``decode``
is idempotent: same slot, same values). An out-of-memory error stays one, so the batch is split
(``batching.generate_split``); raised during a shape's compile or recording, that shape runs eagerly from then
on. :meth:`CapturedBackend.stats` (``--stats``) counts shapes compiled, compile seconds, steps run captured
and eager, the kept states (shapes, bytes, allocations, releases), the batches run plain and, on CUDA where torch
announces them (:func:`watch_recordings`), the graphs recorded per compiled shape. Everything else (CPU,
``--no-capture``, the generic backend) runs the plain backend: :func:`capture` says why.

The refill engine (``search/refill.py``, ``--refill``) runs through the same wrapper: ``open_lanes``, ``join`` and
``leave`` are the wrapped backend's, and ``step`` on a lane state runs the guarded compiled ``decode`` (every check
and fallback above applies). Its shapes need no padding: the ``L * R`` rows are fixed for a window, the lanes' source
(prompt) width only widens to a :func:`~seqgen_cli.shapes.graph_width` and the attended span is a bucket
(``shapes.span_bucket`` of the furthest live lane's step), so a shape is (rows, width, generated positions, span)
and a whole window runs on a handful of graphs. The lane state is marked static when opened and again when a wider
joiner reallocates it (lane states are a window's: not kept). Its ``decode`` is idempotent too (``begin`` derives
where it writes from the lane counters, which only ``advance`` moves, after it).
"""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.batching import free_memory_budget
from seqgen_cli.errors import is_oom
from seqgen_cli.models.amortized import CAPTURED_SPEEDUP, HALF_SPEEDUP, Amortized
from seqgen_cli.models.compiled_calls import (
    SETTLING_CALLS,
    SKIPPED,
    CompiledSearch,
    SearchCompiler,
    SearchStep,
    call_under_limit,
    first_line,
    graphs_recorded,
    step_tolerance,
    watch_recordings,
)
from seqgen_cli.models.kv_cache import Decode, check_slot, run_step, select_into
from seqgen_cli.search.protocol import Batch, ModelBackend, SlotLayout
from seqgen_cli.shapes import compacted, graph_inputs, graph_slots, graph_width, span_bucket

Compiler = Callable[[Decode], Decode]
log = logging.getLogger(__name__)  # notes for the user: a shape compiling (pipeline: Progress.notes)

MAX_SHAPES = 48  # shapes (batch shape x span bucket) one CapturedBackend compiles at most; then eager


_COMPILE_PARAMS = frozenset(inspect.signature(torch.compile).parameters)


def compile_decode(decode: Decode) -> Decode:
    """CUDA graphs through ``torch.compile``: one graph per shape, replayed (static caches, see above). Where
    torch offers it, the compiled entries are this call's own, so other instances' shapes do not count against
    its recompile limit."""
    isolate = {"isolate_recompiles": True} if "isolate_recompiles" in _COMPILE_PARAMS else {}
    return torch.compile(decode, mode="reduce-overhead", fullgraph=True, dynamic=False, **isolate)


def compile_search(step: SearchStep) -> SearchStep:
    """The beam search's slot step (``search/slots.py``) as CUDA graphs, compiled as :func:`compile_decode`
    compiles the model's: one graph per slot shape, its state's tensors static addresses (kept per shape)."""
    isolate = {"isolate_recompiles": True} if "isolate_recompiles" in _COMPILE_PARAMS else {}
    return torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False, **isolate)


def capture(
    backend: ModelBackend,
    device: torch.device,
    enabled: bool | None,
    compiler: Compiler = compile_decode,
    search_compiler: SearchCompiler | None = compile_search,
) -> tuple[ModelBackend, str]:
    """The backend to run and its step path: ``(CapturedBackend, "captured")`` where the step can be captured,
    else ``(backend, "eager (<reason>)")``. ``enabled``: ``True`` compiles each shape at once, ``None`` (the
    default) once its eager steps pay for it (:class:`Amortized`), ``False`` never. ``search_compiler``: the beam
    search's step too (``None``: eager)."""
    if enabled is False:
        reason = "--no-capture"
    elif device.type != "cuda":
        reason = f"{device.type}: no CUDA graphs"
    elif not hasattr(backend, "decode"):
        reason = f"{type(backend).__name__} has no static step"
    else:
        dtype = next(backend.model.parameters()).dtype
        amortized = None if enabled else Amortized(speedup=CAPTURED_SPEEDUP.get(dtype, HALF_SPEEDUP))
        return CapturedBackend(
            backend, compiler, search_compiler=search_compiler, amortized=amortized
        ), "captured"
    return backend, f"eager ({reason})"


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
    address re-records the graph (torch's limit: 128 re-records per function): batch states are kept per shape
    (:class:`Kept`), so only a new shape (or a refill window's lanes) brings new ones."""
    for t in tensors_of(obj):
        torch._dynamo.mark_static_address(t)


def held_bytes(tensors: Iterable[Tensor]) -> int:
    """Device bytes behind ``tensors``: each storage once (views and shared tensors count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def shape_name(shape: tuple[int, ...]) -> str:
    """A compiled shape in ``--stats``: rows x width x slots, and a model step's span bucket."""
    rows, width, slots, *span = shape
    return f"{rows}x{width}x{slots}" + (f" span {span[0]}" if span else "")


Key = tuple[int, int, int, int]  # a kept state's shape: (graph inputs, rows per input, graph width, slots)


@dataclass(eq=False)
class Kept:
    """One captured batch shape's state, kept for the :class:`CapturedBackend`'s life: the wrapped backend's
    static state and the step's token buffer, allocated once, refilled by every batch (or compaction) of the
    shape, so their addresses, which CUDA graphs read in place, never change."""

    key: Key
    inner: Any  # the wrapped backend's static state
    tokens: Tensor  # [P * R] int64: the step's input tokens for every physical row
    nbytes: int  # device bytes held (each storage once), the kept search state's with them
    owner: weakref.ref[Any] | None = None  # the CapturedState running on it; None: idle
    used: int = 0  # when a batch last took it (least recently used is released first)
    search: tuple[Any, Any] | None = None  # (key, state) of the slot search kept with it (search/slots.py)


@dataclass
class CapturedState:
    """A call on :class:`CapturedBackend`: the backend's state over the padded batch, and where the running
    rows are in it."""

    inner: Any  # the wrapped backend's state (physical slots): a kept one
    rows_per_input: int
    inputs: Tensor  # [B] int64: physical slot of each running input
    rows: Tensor  # [B * R] int64: physical row of each running row
    tokens: Tensor  # [P * R] int64: the step's input tokens for every physical row (idle rows: stale ones)
    limit: int  # steps the search may run (slots are rounded up)
    shape: tuple[int, ...]  # (physical rows, padded width, slots): a compiled graph per span bucket each
    start: int  # input slots at the start (compaction stops at a quarter of them)
    kept: Kept = field(repr=False)  # whose buffers ``inner`` and ``tokens`` are
    moved: Tensor | None = None  # [P' * R] after the last drop moved the rows to P' slots: each row's old row


@dataclass
class PlainRun:
    """A batch on the wrapped backend's own state, as ``--no-capture`` runs it (no padding; finished inputs leave
    at once): one whose first step would run eagerly anyway, or under :class:`Amortized` one whose first shape has
    not paid for compiling yet. Its steps count for the shapes a kept state would have run (:meth:`shape`)."""

    inner: Any  # the wrapped backend's state
    rows_per_input: int
    start: int  # graph inputs a kept state would have (the batch padded to a power of two)
    width: int  # graph width
    slots: int  # new-token slots
    running: int  # inputs still running

    def shape(self) -> tuple[int, ...]:
        """The decode shape a kept state would run now: (physical rows, width, slots, span bucket)."""
        rows = compacted(self.running, self.start) * self.rows_per_input
        return (rows, self.width, self.slots, span_bucket(self.inner.t, self.slots))


class CapturedBackend:
    """:class:`~seqgen_cli.search.protocol.ModelBackend` over a static-step backend with ``decode`` compiled
    (see the module docstring). ``path``: what ran (``"captured"``, or how it fell back to eager); ``stats()``:
    the counts behind it."""

    def __init__(
        self,
        backend: Any,
        compiler: Compiler = compile_decode,
        max_shapes: int | None = None,
        keep_bytes: int | None = None,
        search_compiler: SearchCompiler | None = None,
        amortized: Amortized | None = None,
    ) -> None:
        """``max_shapes``: this instance's cap on compiled shapes (default ``MAX_SHAPES``). ``keep_bytes``: the
        device bytes its kept states may hold with a batch's logits (default: the device's memory budget,
        :func:`~seqgen_cli.batching.free_memory_budget`; on the CPU none). ``search_compiler``: compiles beam
        search's slot step (:func:`compile_search`; ``None``: beam search runs as over any backend, eagerly).
        ``amortized``: a shape compiles once its eager steps pay for it (:class:`Amortized`); ``None``: at once."""
        from torch._dynamo.utils import counters

        self.backend = backend
        self.is_encoder_decoder = backend.is_encoder_decoder
        self.vocab_size = backend.vocab_size
        self.max_position_embeddings = getattr(backend, "max_position_embeddings", None)
        self.max_shapes = MAX_SHAPES if max_shapes is None else max_shapes
        mark_static(backend)
        self.compiled: Decode | None = compiler(backend.decode)  # None after a failure: eager for good
        self.shapes: set[tuple[int, ...]] = set()  # shapes running compiled (a compiled call returned)
        self.calls: Counter[tuple[int, ...]] = Counter()  # compiled calls per shape
        self.called_batch_shapes: set[tuple[int, ...]] = set()  # shapes of ``calls`` less their span bucket
        self.oom_shapes: set[tuple[int, ...]] = set()  # out of memory while compiling or recording: eager
        self.failure: str | None = None  # why compiled calls stopped
        self.skipped_shapes: set[tuple[int, ...]] = set()  # inductor ran them without CUDA graphs: eager
        self.capped = False  # a shape beyond max_shapes ran eagerly
        self.compile_seconds = 0.0  # host seconds in each shape's compile + warm-up and recording calls
        self.steps = Counter({"captured": 0, "eager": 0})
        self._counters = counters  # torch's: counters["inductor"]["cudagraph_skips"]
        weight = next(backend.model.parameters())
        self.tolerance = step_tolerance(weight.dtype)
        self.device = weight.device
        self.kept: dict[Key, Kept] = {}  # a static state per batch shape, for this instance's life
        self.allocations: Counter[Key] = Counter()  # kept states allocated, per shape (a release frees one)
        self.released = 0  # kept states released (room for another shape; out of memory)
        self.plain_batches = 0  # batches run on the wrapped backend's own state (PlainRun)
        self.keep_bytes = free_memory_budget(self.device) if keep_bytes is None else keep_bytes
        self._uses = 0  # batches and compactions that took a kept state (its ``used`` stamp)
        self.recorded: Counter[tuple[int, ...]] = Counter()  # CUDA graphs recorded per compiled shape
        self.watching = watch_recordings()
        self.search = (
            None
            if search_compiler is None
            else CompiledSearch(search_compiler, self.max_shapes, self.tolerance)
        )
        self.amortized = amortized

    def slot_search(self, state: Any) -> bool:
        """Whether beam search runs over ``state``'s slots, its step compiled: a kept state's, given a search
        compiler (a :class:`PlainRun` runs as over any backend)."""
        return self.search is not None and isinstance(state, CapturedState)

    @property
    def path(self) -> str:
        """``captured``; ``captured (<notes>)`` where some shapes ran eagerly; ``eager (<reason>)`` after a
        failure before any captured step, ``captured, then eager (<reason>)`` after one."""
        failure = self.failure
        if (
            failure is None and self.skipped_shapes and not self.shapes
        ):  # every shape skipped: eager as a whole
            failure = SKIPPED
        if failure is not None:
            return f"{'captured, then ' if self.steps['captured'] else ''}eager ({failure})"
        notes = [f"{self.max_shapes} shapes; eager beyond"] if self.capped else []
        if self.skipped_shapes:
            notes.append(f"{len(self.skipped_shapes)} eager: inductor skipped CUDA graphs")
        if self.oom_shapes:
            notes.append(f"{len(self.oom_shapes)} eager: out of memory while compiling")
        if self.search is not None and self.search.failure is not None:
            notes.append(f"search {self.search.path}")
        waiting = 0 if self.amortized is None else self.amortized.waiting(self.shapes)
        if waiting:
            notes.append(f"{waiting} eager until compiling them pays")
        return "captured" + (f" ({'; '.join(notes)})" if notes else "")

    def stats(self) -> dict[str, Any]:
        """For ``--stats``: shapes compiled (of at most ``max_shapes``; a shape is a batch shape and a span bucket),
        the span buckets they reach, compile seconds, decode steps run captured and eagerly; the kept states (batch
        shapes held, their bytes, allocations and releases), the batches run on the plain backend and, on CUDA
        where torch tells (:func:`watch_recordings`), the CUDA graphs this backend's calls recorded, in all and per
        compiled shape (a kept state is recorded once per shape; more means new addresses)."""
        out = {
            "shapes_compiled": len(self.shapes),
            "max_shapes": self.max_shapes,
            "span_buckets": sorted({shape[-1] for shape in self.shapes}),
            "compile_seconds": round(self.compile_seconds, 1),
            "compile_when": "at once" if self.amortized is None else "once it pays",
            "captured_steps": self.steps["captured"],
            "eager_steps": self.steps["eager"],
            "kept_shapes": len(self.kept),
            "kept_bytes": sum(kept.nbytes for kept in self.kept.values()),
            "kept_allocations": sum(self.allocations.values()),
            "kept_released": self.released,
            "plain_batches": self.plain_batches,
        }
        if self.search is not None:
            out |= {
                "search_path": self.search.path,
                "search_compiled_steps": self.search.steps["compiled"],
                "search_eager_steps": self.search.steps["eager"],
                "search_compile_seconds": round(self.search.compile_seconds, 1),
            }
        recorded = self._recorded()
        if self.watching and (self.device.type == "cuda" or recorded.total()):
            out["cuda_graphs_recorded"] = recorded.total()
            out["cuda_graphs_recorded_per_shape"] = {name: n for name, n in sorted(recorded.items()) if n}
        return out

    def _recorded(self) -> Counter[str]:
        """CUDA graphs recorded per compiled shape, model steps and search steps, by name."""
        named = Counter({"model " + shape_name(shape): n for shape, n in self.recorded.items()})
        if self.search is not None:
            named.update({"search " + shape_name(key[0]): n for key, n in self.search.recorded.items()})
        return named

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int | None:
        """The wrapped backend's cache bytes for the batch :meth:`start` builds: inputs padded to a power of two,
        the width to its bucket, the new-token slots to a multiple of ``shapes.SLOTS``. What the batch's kept state
        holds: kept states of other shapes are held beside it within ``keep_bytes``."""
        width = graph_width(width, self.max_position_embeddings)
        return self.backend.cache_bytes(graph_inputs(inputs), width, rows_per_input, graph_slots(new_tokens))

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[CapturedState, Tensor | None]:
        """The batch padded to its shape runs on the shape's kept state: the first batch of a shape allocates it
        (the wrapped backend's ``start``), later ones refill it (its ``restart``: nothing allocated). One batch at
        a time: an earlier batch of the shape that is still held cannot step on (its buffers are taken)."""
        b, s = batch.input_ids.shape
        r, slots = rows_per_input, graph_slots(max_new_tokens)
        width, inputs = graph_width(s, self.max_position_embeddings), graph_inputs(b)
        if not self._captures((inputs * r, width, slots, span_bucket(0, slots))):
            return self._start_plain(batch, PlainRun(None, r, inputs, width, slots, b), max_new_tokens)
        padded = batch.padded(inputs, width, left=not self.is_encoder_decoder)
        key = (inputs, r, width, slots)
        kept = self.kept.get(key)
        self.watching = watch_recordings()  # registered again after a torch._dynamo.reset
        try:
            if kept is None:
                self._make_room(key, busy=())
                inner, first = self.backend.start(padded, r, slots)
                inner.cache.make_static()  # span buckets: one shape per bucket, CPU or CUDA
                kept = self._keep(key, inner)
            else:
                first = self.backend.restart(kept.inner, padded)
                kept.tokens.zero_()
        except Exception as err:
            self._release_if_oom(err)
            raise
        device = batch.input_ids.device
        state = CapturedState(
            kept.inner,
            r,
            inputs=torch.arange(b, device=device),
            rows=torch.arange(b * r, device=device),
            tokens=kept.tokens,
            limit=max(1, max_new_tokens),
            shape=(inputs * r, width, slots),
            start=inputs,
            kept=kept,
        )
        self._take(kept, state)
        return state, None if first is None else first[:b]  # [B, V]

    def _captures(self, shape: tuple[int, ...]) -> bool:
        """Whether a batch whose first step has ``shape`` runs on a kept state: not where that step would run
        eagerly (:meth:`_eager_for_good`), nor, under ``amortized``, before compiling the shape pays."""
        if self._eager_for_good(shape):
            return False
        if self.amortized is None or self.calls[shape]:
            return True
        return self.amortized.paid(shape, (len(self.shapes), self.compile_seconds))

    def _start_plain(
        self, batch: Batch, run: PlainRun, max_new_tokens: int
    ) -> tuple[PlainRun, Tensor | None]:
        """The batch on the wrapped backend's own ``start`` (its caches sized to the batch)."""
        self.plain_batches += 1
        try:
            run.inner, first = self.backend.start(batch, run.rows_per_input, max_new_tokens)
        except Exception as err:
            self._release_if_oom(err)
            raise
        return run, first

    def _plain(self, run: PlainRun, tokens: Tensor) -> Tensor:
        """A :class:`PlainRun`'s step, counted eager and, under ``amortized``, for the shape it stands for."""
        if self.amortized is not None:
            self.amortized.charge(run.shape(), run.inner.t)
        self.steps["eager"] += 1
        try:
            return self.backend.step(run.inner, tokens)
        except Exception as err:
            self._release_if_oom(err)
            raise

    def _batch_bytes(self, key: Key) -> int:
        """Device bytes a batch of shape ``key`` holds: its state (``cache_bytes``) and its logits rows."""
        from seqgen_cli.batching import LOGIT_BYTES

        inputs, r, width, slots = key
        return self.backend.cache_bytes(inputs, width, r, slots) + inputs * r * self.vocab_size * LOGIT_BYTES

    def _keep(self, key: Key, inner: Any) -> Kept:
        """A newly allocated static state becomes the kept one of ``key``, its tensors static addresses."""
        tokens = torch.zeros(key[0] * key[1], dtype=torch.long, device=self.device)
        mark_static(inner)
        torch._dynamo.mark_static_address(tokens)
        kept = Kept(key, inner, tokens, held_bytes([*tensors_of(inner), tokens]))
        self.kept[key] = kept
        self.allocations[key] += 1
        return kept

    def _take(self, kept: Kept, state: CapturedState) -> None:
        """``state`` runs on ``kept`` from now on (an earlier holder cannot step on)."""
        self._uses += 1
        kept.owner, kept.used = weakref.ref(state), self._uses

    def _check(self, state: CapturedState) -> None:
        """``state`` still holds its kept state (not taken by a later batch, nor released)."""
        owner = state.kept.owner
        if owner is None or owner() is not state:
            raise RuntimeError(
                f"the kept state of shape {state.kept.key} was taken by a later batch or released: "
                "a CapturedBackend runs one batch at a time"
            )

    def _make_room(self, key: Key, busy: Iterable[Key]) -> None:
        """Release kept states (least recently used first, never those of ``busy``) until they and a batch of
        shape ``key`` (:meth:`_batch_bytes`) fit in ``keep_bytes``."""
        if self.keep_bytes is None:
            return
        need, busy = self._batch_bytes(key), set(busy)
        held = sum(kept.nbytes for kept in self.kept.values())
        idle = sorted((k for k in self.kept.values() if k.key not in busy), key=lambda k: k.used)
        for kept in idle:
            if held + need <= self.keep_bytes:
                break
            self._drop_kept(kept)
            held -= kept.nbytes

    def _release_if_oom(self, err: BaseException) -> None:
        """Out of memory: release every kept state (the batch is split, its halves find the memory they held)."""
        if is_oom(err):
            self._release(busy=())

    def _release(self, busy: Iterable[Key]) -> None:
        """Release every kept state but those of ``busy`` (out of memory)."""
        busy = set(busy)
        for kept in [k for k in self.kept.values() if k.key not in busy]:
            self._drop_kept(kept)

    def _drop_kept(self, kept: Kept) -> None:
        del self.kept[kept.key]
        kept.owner = None  # a state still running on it fails its next call
        self.released += 1

    @torch.inference_mode()
    def step(self, state: Any, tokens: Tensor) -> Tensor:
        """The one decode step, whatever the state. A :class:`PlainRun`'s on the wrapped backend (counted for the
        shape it stands for). A kept state's over its physical rows: ``tokens`` are the running rows' [N] (logits
        [N, V], a copy), or the layout's token buffer itself, a static search's (the logits of every row [P * R, V],
        the graph's output: read them before the next step). A lane state's (the refill engine) over every lane
        (logits [L * R, V], the graph's output). The last two through the guarded compiled ``decode`` of their
        shape: (rows, source or prompt width, new-token slots) and the span bucket of the step."""
        if isinstance(state, PlainRun):
            return self._plain(state, tokens)
        if isinstance(state, CapturedState):
            check_slot(state.inner.t, state.limit)
            self._check(state)
            every = tokens is state.tokens
            if not every:
                state.tokens.index_copy_(0, state.rows, tokens)
            inner, shape, fed = state.inner, state.shape, state.tokens
        else:  # a lane state: shapes are fixed by the lanes, the width only widens
            inner, fed, every = state, tokens, True
            shape = (tokens.shape[0], self.backend.lane_width(state), state.cache.max_len)
        step = inner.cache.now(inner.t)
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be overwritten
        try:
            decode = self._decoder((*shape, span_bucket(step, inner.cache.max_len)), step)
            logits = run_step(decode, inner, fed)  # [P * R, V]
        except Exception as err:
            self._release_if_oom(err)
            raise
        if every:
            return logits
        return logits.index_select(0, state.rows)  # [N, V], a copy: the graph's output is overwritten

    # -- the static search (search/slots.py): search/protocol.py's SlotBackend ---------------------------------
    def slot_layout(self, state: CapturedState) -> SlotLayout:
        """The running inputs' slots, the token buffer, the history's prompt width (decoder-only: the graph width)
        and new-token slots, and the last drop's move."""
        width = 1 if self.is_encoder_decoder else state.shape[1]
        return SlotLayout(state.inputs, state.tokens, width, state.shape[2], state.moved)

    def kept_search(self, state: CapturedState, key: Any, make: Callable[[], Any]) -> Any:
        """The slot search's state kept with ``state``'s kept buffers (one per shape): ``make()``, its tensors
        marked static, the first time or when ``key`` changes; its bytes count in the kept state's (``keep_bytes``)."""
        kept = state.kept
        if kept.search is None or kept.search[0] != key:
            search = make()
            mark_static(search)
            kept.search = (key, search)
            kept.nbytes = held_bytes([*tensors_of(kept.inner), kept.tokens, *tensors_of(search)])
        return kept.search[1]

    @torch.inference_mode()
    def search_call(
        self, state: CapturedState, step: SearchStep, search: Any, logits: Tensor
    ) -> list[Tensor]:
        """The slot search's step, compiled and guarded (:class:`CompiledSearch`)."""
        if self.search is None:
            raise RuntimeError("no search compiler: beam search does not run over the slots")
        if self.amortized is not None and state.shape not in self.called_batch_shapes:
            return self.search.eager(step, search, logits)  # its model step is not compiled yet either
        return self.search((state.shape, getattr(search, "spec", None)), step, search, logits)

    def _decoder(self, shape: tuple[int, ...], step: int) -> Decode:
        """The guarded compiled ``decode`` for ``shape`` (about to run step ``step``); the eager one after a
        failure, for a shape that ran out of memory while compiling, for new shapes once ``max_shapes`` are
        compiled, and for a shape whose compiling does not pay yet (``amortized``)."""
        if self._eager_for_good(shape):
            return self._eager
        if self.amortized is not None and not self.calls[shape]:
            if not self.amortized.ready(shape, step, (len(self.shapes), self.compile_seconds)):
                return self._eager
        return partial(self._guarded, shape)

    def _eager_for_good(self, shape: tuple[int, ...]) -> bool:
        """Whether ``shape``'s steps run eagerly whatever comes: after a failure, a shape that ran out of memory
        while compiling or that inductor skipped, a new shape once ``max_shapes`` are compiled (noted)."""
        if self.compiled is None or shape in self.oom_shapes or shape in self.skipped_shapes:
            return True
        if shape not in self.shapes and len(self.shapes) >= self.max_shapes:
            self.capped = True
            return True
        return False

    def _eager(self, state: Any, tokens: Tensor) -> Tensor:
        self.steps["eager"] += 1
        return self.backend.decode(state, tokens)

    def _guarded(self, shape: tuple[int, ...], state: Any, tokens: Tensor) -> Tensor:
        """One compiled call: a failure falls back to eager for good (the call is rerun eagerly), an OOM is
        re-raised (during a shape's compile or recording, the shape runs eagerly from then on). The first two
        calls of a shape count as compile seconds, failed or not."""
        call = self.calls[shape]
        self.calls[shape] += 1
        if call == 0:  # the run pauses while it compiles: say why
            self.called_batch_shapes.add(shape[:-1])
            log.info(
                "compiling the decode step for shape %s (once per shape; --no-capture: never)",
                shape_name(shape),
            )
        skips, recorded = self._skips(), graphs_recorded()
        t0 = time.perf_counter()
        try:
            logits = self._call(state, tokens, settled=call >= SETTLING_CALLS)
        except Exception as err:  # noqa: BLE001 - any compile/capture failure: eager, with the reason
            failure: str | None = f"{type(err).__name__}: {first_line(err)}"
            if is_oom(err):
                if call < SETTLING_CALLS - 1:  # compile + warm-up, or recording
                    self.compile_seconds += time.perf_counter() - t0
                    self.oom_shapes.add(shape)
                    self.shapes.discard(shape)
                raise
        else:
            failure = None
        finally:
            self.recorded[shape] += graphs_recorded() - recorded
        if call < SETTLING_CALLS - 1:
            self.compile_seconds += time.perf_counter() - t0
        if (
            failure is None and self._skips() > skips
        ):  # inductor ran this shape without CUDA graphs (and goes on
            self.skipped_shapes.add(shape)  # so): this shape eager from now on, the others as they were
            self.shapes.discard(shape)
            return self._eager(state, tokens)
        if failure is not None:
            return self._fall_back(failure, state, tokens)
        if call == SETTLING_CALLS - 1:  # the shape's first replay: checked once against the eager step
            eager = self.backend.decode(state, tokens)  # idempotent: rewrites the same slot
            failure = self._differs(logits, eager, shape)
            if failure is not None:
                self.compiled, self.failure = None, failure
                self.steps["eager"] += 1
                return eager
        self.shapes.add(shape)
        self.steps["captured"] += 1
        return logits

    def _call(self, state: Any, tokens: Tensor, settled: bool = False) -> Tensor:
        """The compiled ``decode`` under :func:`call_under_limit` (``max_shapes``; ``settled``: the shape's
        settling calls are done)."""
        return call_under_limit(self.max_shapes, self.compiled, state, tokens, settled=settled)  # type: ignore[arg-type]

    def _differs(self, compiled: Tensor, eager: Tensor, shape: tuple[int, ...]) -> str | None:
        """Why the compiled step's logits are not the eager step's (beyond :func:`step_tolerance` of the largest
        eager logit), or ``None``. One host sync per shape."""
        compiled, eager = compiled.float(), eager.float()
        gap = torch.where(compiled == eager, 0.0, (compiled - eager).abs()).max()  # nan stays nan: differs
        scale = eager.abs().nan_to_num(0.0, 0.0, 0.0).max().clamp(min=1.0)
        if bool(gap <= self.tolerance * scale):
            return None
        return f"compiled step differs from eager: max |diff| {float(gap):.3g} of {float(scale):.3g}, shape {shape}"

    def _skips(self) -> int:
        return self._counters["inductor"]["cudagraph_skips"]

    def _fall_back(self, reason: str, state: Any, tokens: Tensor) -> Tensor:
        """Eager for good from this call on (``decode`` is idempotent: the rerun writes the same slot)."""
        self.compiled = None
        self.failure = reason
        return self._eager(state, tokens)

    @torch.inference_mode()
    def reorder(self, state: Any, rows: Tensor) -> None:
        """A kept state: physical row ``state.rows[i]`` continues ``state.rows[rows[i]]`` ([N], running rows;
        idle rows continue themselves), or, ``rows`` of every physical row ([P * R], a static search's), row ``i``
        continues ``rows[i]``. A :class:`PlainRun`'s rows and a lane state's are the wrapped backend's own."""
        if not isinstance(state, CapturedState):
            self.backend.reorder(state.inner if isinstance(state, PlainRun) else state, rows)
            return
        self._check(state)
        n = state.tokens.shape[0]
        if rows.shape[0] == n:  # every row (when none idles, running rows are every row: the same map)
            self.backend.reorder(state.inner, rows)
            return
        physical = torch.arange(n, device=rows.device).index_copy_(
            0, state.rows, state.rows.index_select(0, rows)
        )  # [P * R]
        self.backend.reorder(state.inner, physical)

    @torch.inference_mode()
    def drop(self, state: CapturedState | PlainRun, keep: Tensor, rows: Tensor) -> None:
        """Finished inputs idle in their slots; the slots shrink (a new shape) only to a smaller power of two, at
        most two halvings (:func:`~seqgen_cli.shapes.compacted`): the running inputs are copied into the smaller
        shape's kept state (allocated by the first compaction to it), and the larger one waits for the next batch
        of its shape. A :class:`PlainRun`'s inputs leave its state at once (the wrapped backend's ``drop``)."""
        if isinstance(state, PlainRun):
            self.backend.drop(state.inner, keep, rows)
            state.running = keep.shape[0]
            return
        inputs, r = state.inputs.index_select(0, keep), state.rows_per_input  # [B']
        state.moved = None
        b = inputs.shape[0]
        slots = compacted(b, state.start)
        if slots * r == state.tokens.shape[0]:
            state.inputs, state.rows = inputs, state.rows.index_select(0, rows)
            return
        self._check(state)
        kept = torch.cat([inputs, inputs[-1:].expand(slots - b)])  # [slots]: the last one again as padding
        kept_rows = (kept[:, None] * r + torch.arange(r, device=kept.device)).reshape(-1)  # [slots * R]
        key = (slots, *state.kept.key[1:])
        target = self.kept.get(key)
        try:
            if target is None:
                self._make_room(key, busy=[state.kept.key])
                target = self._keep(key, self.backend.compact(state.inner, kept, kept_rows))
            else:
                self.backend.compact(state.inner, kept, kept_rows, into=target.inner)
        except Exception as err:
            self._release_if_oom(err)
            raise
        select_into(target.tokens, state.tokens, kept_rows)
        state.kept.owner = None  # idle: the next batch of its shape takes it
        self._take(target, state)
        state.inner, state.tokens, state.kept = target.inner, target.tokens, target
        state.inputs = torch.arange(b, device=kept.device)
        state.rows = torch.arange(b * r, device=kept.device)
        state.shape = (slots * r, *state.shape[1:])
        state.moved = kept_rows

    # -- the refill engine's lanes (search/refill.py): the wrapped backend's, with decode compiled ------------
    @torch.inference_mode()
    def open_lanes(self, slots: int, rows_per_input: int, max_new_tokens: int) -> Any:
        state = self.backend.open_lanes(slots, rows_per_input, max_new_tokens)
        mark_static(state)
        self.watching = watch_recordings()  # registered again after a torch._dynamo.reset
        return state

    @torch.inference_mode()
    def join(self, state: Any, lanes: list[int], batch: Batch) -> Tensor | None:
        """The wrapped backend's join; a join that widens the lanes' sources (prompts) makes new tensors: marked
        static (their first replay re-records, under a new shape)."""
        width = self.backend.lane_width(state)
        first = self.backend.join(state, lanes, batch)
        if self.backend.lane_width(state) != width:
            mark_static(state)
        return first

    def leave(self, state: Any, lanes: list[int]) -> None:
        """The wrapped backend's leave: those lanes idle."""
        self.backend.leave(state, lanes)
