"""The capture path: a static-step backend's ``decode`` run as CUDA graphs, and which way each batch runs.

A fast backend's step is ``cache.check(t)`` (host), ``decode(state, tokens)`` (tensors only: what is compiled and
captured), then ``t += 1`` and ``cache.advance()``; ``decode`` never branches on the step (``models/lane_table.py``),
so one graph serves every step of a batch shape within a span bucket. Shapes come from a small fixed set
(``shapes.py``): inputs padded to a power-of-two number of *lanes* (copies of the last input, idle), sources
(prompts) to a power-of-two width, new-token positions to a multiple of ``shapes.POSITIONS``; finished inputs idle in
their lane until the running ones fit a smaller power of two, at most twice per batch (``shapes.compacted``).

:class:`CapturedBackend` (CUDA) chooses per batch. One whose first step would run eagerly (after a failure, out of
memory while compiling, inductor skipping it, past ``max_shapes``; by default until compiling its shape pays,
``models/amortized.py``) runs on the wrapped backend's own state (:class:`PlainRun`), as ``--no-capture`` runs it,
its steps counted for the shape a kept state would have run. Every other batch runs padded on its shape's kept state
(``models/kept.py``) through the one guarded compiled call (``models/compiled_calls.py``: first replay checked, a
failure eager with the reason, out of memory raised so the batch is split); so does the static beam search's step
(``search_call``, its state kept with the kept state). The refill engine's lanes pass through (``open_lanes``,
``join``, ``leave``), their ``step`` the same guarded ``decode``. Elsewhere (CPU, ``--no-capture``, the generic
backend) the plain backend runs: :func:`capture` says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.budget import DeviceBudget
from seqgen_cli.models.amortized import CAPTURED_SPEEDUP, HALF_SPEEDUP, Amortized
from seqgen_cli.models.compiled_calls import (
    SKIPPED,
    Guarded,
    SearchCompiler,
    SearchStep,
    compile_decode,
    compile_search,
    watch_recordings,
)
from seqgen_cli.models.fast import FastBackend
from seqgen_cli.models.kept import CapturedState, KeptStates, mark_static
from seqgen_cli.models.lane_table import Decode, check_position, run_step
from seqgen_cli.search.protocol import Batch, ModelBackend, StaticLayout
from seqgen_cli.shapes import compacted, graph_inputs, graph_positions, graph_width, span_bucket

Compiler = Callable[[Decode], Decode]
log = logging.getLogger(__name__)  # notes for the user: a shape compiling (pipeline: Progress.notes)

MAX_SHAPES = 48  # shapes (batch shape x span bucket) one CapturedBackend compiles at most; then eager
COMPILING = "compiling the decode step for shape %s (once per shape; --no-capture: never)"


def capture(
    backend: ModelBackend,
    device: torch.device,
    enabled: bool | None,
    compiler: Compiler = compile_decode,
    search_compiler: SearchCompiler | None = compile_search,
) -> tuple[ModelBackend, str]:
    """``(CapturedBackend, "captured")`` where the step can be captured, else ``(backend, "eager (<reason>)")``.
    ``enabled``: ``True`` compiles each shape at once, ``None`` once its eager steps pay for it (:class:`Amortized`),
    ``False`` never. ``search_compiler``: the beam search's step too (``None``: eager)."""
    if enabled is False:
        reason = "--no-capture"
    elif device.type != "cuda":
        reason = f"{device.type}: no CUDA graphs"
    elif not isinstance(backend, FastBackend):
        reason = f"{type(backend).__name__} has no static step"
    else:
        dtype = next(backend.model.parameters()).dtype
        amortized = None if enabled else Amortized(speedup=CAPTURED_SPEEDUP.get(dtype, HALF_SPEEDUP))
        wrapper = CapturedBackend(backend, compiler, search_compiler=search_compiler, amortized=amortized)
        return wrapper, "captured"
    return backend, f"eager ({reason})"


def shape_name(shape: tuple[int, ...]) -> str:
    """A compiled shape in ``--stats``: rows x width x positions, and a model step's span bucket."""
    rows, width, positions, *span = shape
    return f"{rows}x{width}x{positions}" + (f" span {span[0]}" if span else "")


@dataclass
class PlainRun:
    """A batch on the wrapped backend's own state, as ``--no-capture`` runs it (no padding; finished inputs leave
    at once). Its steps count for the shapes a kept state would have run (:meth:`shape`)."""

    inner: Any  # the wrapped backend's state
    rows_per_input: int
    start: int  # graph inputs a kept state would have (the batch padded to a power of two)
    width: int  # graph width
    positions: int  # new-token positions
    running: int  # inputs still running

    def shape(self) -> tuple[int, ...]:
        """The decode shape a kept state would run now: (physical rows, width, positions, span bucket)."""
        rows = compacted(self.running, self.start) * self.rows_per_input
        return (rows, self.width, self.positions, span_bucket(self.inner.t, self.positions))


class CapturedBackend:
    """:class:`~seqgen_cli.search.protocol.ModelBackend` over a fast backend (:class:`~.fast.FastBackend`), choosing
    per batch: plain, kept state, compiled (module docstring); a :class:`~.fast.Wrapper` (:meth:`unwrap`).
    ``decoder``: the guarded compiled ``decode``; ``search``: the static search's step (``None``: beam search as
    over any backend); ``pool``: the kept states; ``path``: what ran."""

    def __init__(
        self,
        backend: FastBackend,
        compiler: Compiler = compile_decode,
        max_shapes: int | None = None,
        budget: DeviceBudget | None = None,
        search_compiler: SearchCompiler | None = None,
        amortized: Amortized | None = None,
    ) -> None:
        """``max_shapes``: this instance's cap on compiled shapes (default ``MAX_SHAPES``). ``budget``: what the kept
        states are held against (default: the device's, ``DeviceBudget.read``; a ``Generator`` hands over its own).
        ``amortized``: a shape compiles once its eager steps pay for it; ``None``: at once."""
        self.backend, self.amortized = backend, amortized
        self.is_encoder_decoder, self.vocab_size = backend.is_encoder_decoder, backend.vocab_size
        self.max_position_embeddings = backend.max_position_embeddings
        self.max_shapes = MAX_SHAPES if max_shapes is None else max_shapes
        weight = next(backend.model.parameters())
        self.device = weight.device
        mark_static(backend)
        self.decoder = Guarded.for_decode(compiler, self.max_shapes, weight.dtype)
        self.search = None  # the static search's step, guarded alike (None: beam search as over any backend)
        if search_compiler is not None:
            self.search = Guarded.for_search(search_compiler, self.max_shapes, weight.dtype)
        self.pool = KeptStates(backend, self.device, budget or DeviceBudget.read(self.device))
        self.called_batch_shapes: set[tuple[int, ...]] = set()  # the decoder's keys less their span bucket
        self.plain_batches = 0  # batches run on the wrapped backend's own state (PlainRun)
        self.watching = watch_recordings()

    # the decoder's shapes running compiled (batch shape, span bucket) and steps run; the pool's kept states
    shapes = property(lambda self: self.decoder.keys)
    steps = property(lambda self: self.decoder.steps)
    kept = property(lambda self: self.pool.kept)

    def unwrap(self) -> FastBackend:
        """The fast backend whose decoder runs the steps (``fast.Wrapper``)."""
        return self.backend

    def static_search(self, state: Any) -> bool:
        """Whether beam search runs over ``state``'s lanes, compiled: a kept state's, given a search compiler."""
        return self.search is not None and isinstance(state, CapturedState)

    @property
    def path(self) -> str:
        """``captured``; ``captured (<notes>)`` where some shapes ran eagerly; ``eager (<reason>)`` after a
        failure before any captured step, ``captured, then eager (<reason>)`` after one."""
        d = self.decoder
        failure = SKIPPED if d.failure is None and d.skipped_keys and not d.keys else d.failure  # all skipped
        if failure is not None:
            return f"{'captured, then ' if d.steps['captured'] else ''}eager ({failure})"
        notes = d.notes()
        if self.search is not None and self.search.failure is not None:
            notes.append(f"search {self.search.path}")
        if waiting := 0 if self.amortized is None else self.amortized.waiting(d.keys):
            notes.append(f"{waiting} eager until compiling them pays")
        return "captured" + (f" ({'; '.join(notes)})" if notes else "")

    def stats(self) -> dict[str, Any]:
        """For ``--stats``: the decoder's shapes, span buckets and counts, the kept states', the plain batches, the
        search's and the CUDA graphs recorded per compiled shape (where torch tells: more than one, new addresses)."""
        d, s = self.decoder, self.search
        out = {"shapes_compiled": len(d.keys), "max_shapes": self.max_shapes}
        out |= {"span_buckets": sorted({shape[-1] for shape in d.keys}), **d.counts()}
        out |= {"compile_when": "at once" if self.amortized is None else "once it pays", **self.pool.stats()}
        out |= {"plain_batches": self.plain_batches}
        recorded = d.recordings("model ", shape_name)
        if s is not None:
            out |= {"search_path": s.path, **s.counts("search_")}
            recorded.update(s.recordings("search ", lambda key: shape_name(key[0])))
        if self.watching and (self.device.type == "cuda" or recorded.total()):
            out["cuda_graphs_recorded"] = recorded.total()
            out["cuda_graphs_recorded_per_shape"] = {name: n for name, n in sorted(recorded.items()) if n}
        return out

    def padded_shape(self, inputs: int, width: int, new_tokens: int) -> tuple[int, int, int]:
        """``(inputs, width, new tokens)`` of the batch :meth:`start` builds for such a batch: padded to its graph
        shape (``shapes.graph_*``), which every byte count of it (``memory.extra_bytes``, :meth:`cache_bytes`) uses."""
        return graph_inputs(inputs), graph_width(width, self.max_position_embeddings), graph_positions(new_tokens)

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int | None:
        """The wrapped backend's cache bytes for the batch :meth:`start` builds (:meth:`padded_shape`): what the
        batch's kept state holds; kept states of other shapes are held beside it against the budget."""
        inputs, width, positions = self.padded_shape(inputs, width, new_tokens)
        return self.backend.cache_bytes(inputs, width, rows_per_input, positions)

    @torch.inference_mode()
    def start(self, batch: Batch, rows_per_input: int, max_new_tokens: int) -> tuple[Any, Tensor | None]:
        """The batch padded to its shape on the shape's kept state (``KeptStates.open``), or, where its first step
        would run eagerly, on the wrapped backend's own ``start`` (a :class:`PlainRun`)."""
        b, s = batch.input_ids.shape
        r, positions, d = rows_per_input, graph_positions(max_new_tokens), self.decoder
        width, inputs = graph_width(s, self.max_position_embeddings), graph_inputs(b)
        shape = (inputs * r, width, positions, span_bucket(0, positions))  # its first step's
        if d.eager_for_good(shape) or not (d.calls[shape] or self._pays(shape)):
            self.plain_batches += 1
            run = PlainRun(None, r, inputs, width, positions, b)
            run.inner, first = self._run(self.backend.start, batch, r, max_new_tokens)
            return run, first
        self.watching = watch_recordings()  # registered again after a torch._dynamo.reset
        padded = batch.padded(inputs, width, left=not self.is_encoder_decoder)
        return self.pool.open((inputs, r, width, positions), padded, b, max(1, max_new_tokens))

    def _pays(self, shape: tuple[int, ...], step: int | None = None) -> bool:
        """Whether compiling ``shape`` pays (always, but under ``amortized``; ``step``: about to run, charged)."""
        a, compiled = self.amortized, (len(self.shapes), self.decoder.compile_seconds)
        return a is None or (a.paid(shape, compiled) if step is None else a.ready(shape, step, compiled))

    @torch.inference_mode()
    def step(self, state: Any, tokens: Tensor) -> Tensor:
        """The one decode step: a :class:`PlainRun`'s on the wrapped backend (counted for the shape it stands for);
        a kept state's (``tokens``: the running rows' [N], logits [N, V] a copy; or its token buffer, a static
        search's, logits [L * R, V]) and a lane state's (logits [L * R, V]) through the guarded ``decode`` of their
        (rows, width, positions, span bucket): the graph's output, read before the next step."""
        if isinstance(state, PlainRun):
            if self.amortized is not None:
                self.amortized.charge(state.shape(), state.inner.t)
            return self._run(self.decoder.eager, self.backend.step, state.inner, tokens)
        if isinstance(state, CapturedState):
            check_position(state.inner.t, state.limit)
            self.pool.check(state)
            inner, shape, fed, every = state.inner, state.shape, state.tokens, state.feed(tokens)
        else:  # a lane state: shapes are fixed by the lanes, the width only widens
            inner, fed, every = state, tokens, True
            shape = (tokens.shape[0], self.backend.lane_width(state), state.cache.max_len)
        step = inner.cache.span_t(inner.t)
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be overwritten
        decode = self._decoder((*shape, inner.cache.span_at(inner.t)), step)  # a static cache: its bucket
        logits = self._run(run_step, decode, inner, fed)  # [L * R, V]
        if every:
            return logits
        return logits.index_select(0, state.rows)  # [N, V]: a copy, the graph's output is overwritten

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; out of memory, every kept state is released before the error is raised (the batch splits)."""
        try:
            return fn(*args)
        except Exception as err:
            self.pool.release_if_oom(err)
            raise

    def _decoder(self, shape: tuple[int, ...], step: int) -> Decode:
        """``decode`` for ``shape`` (about to run step ``step``): guarded and compiled, or eager where the shape
        runs eagerly for good (``Guarded.eager_for_good``) or, under ``amortized``, its compiling does not pay yet."""
        d, decode = self.decoder, self.backend.decode
        if d.eager_for_good(shape) or not (d.calls[shape] or self._pays(shape, step)):
            return partial(d.eager, decode)
        if not d.calls[shape]:  # the run pauses while it compiles: say why
            log.info(COMPILING, shape_name(shape))
            self.called_batch_shapes.add(shape[:-1])
            self.pool.budget.set_up()  # its graph pool outlives the batch
        return partial(d, shape, decode)

    # -- the static search (search/static.py): search/protocol.py's StaticBackend ---------------------------------
    def static_layout(self, state: CapturedState) -> StaticLayout:
        """``CapturedState.layout``: the running inputs' lanes, the token buffer and the shape's widths."""
        return state.layout(self.is_encoder_decoder)

    def kept_search(self, state: CapturedState, key: Any, make: Callable[[], Any]) -> Any:
        """The static search's state kept with ``state``'s kept state (``KeptStates.search``)."""
        return self.pool.search(state.kept, key, make)

    @torch.inference_mode()
    def search_call(self, state: CapturedState, step: SearchStep, search: Any, logits: Tensor) -> Any:
        """The static search's step, compiled and guarded per (kept state's shape, search settings)."""
        if self.search is None:
            raise RuntimeError("no search compiler: beam search does not run over the lanes")
        if self.amortized is not None and state.shape not in self.called_batch_shapes:
            return self.search.eager(step, search, logits)  # its model step is not compiled yet either
        return self.search((state.shape, getattr(search, "spec", None)), step, search, logits)

    @torch.inference_mode()
    def reorder(self, state: Any, rows: Tensor) -> None:
        """``rows``: each row's source row. A kept state's physical rows (``CapturedState.physical``: of its
        running rows, or of every row, a static search's); a :class:`PlainRun`'s or a lane state's, its own."""
        if isinstance(state, CapturedState):
            self.pool.check(state)
            self.backend.reorder(state.inner, state.physical(rows))
        else:
            self.backend.reorder(state.inner if isinstance(state, PlainRun) else state, rows)

    @torch.inference_mode()
    def keep(self, state: CapturedState | PlainRun, keep: Tensor, rows: Tensor) -> None:
        """Finished inputs leave: a kept state's idle in their lanes until the running ones move into a smaller
        shape's (``KeptStates.keep``); a :class:`PlainRun`'s leave its state at once (the wrapped backend's)."""
        if isinstance(state, CapturedState):
            self.pool.keep(state, keep, rows)
        else:
            self.backend.keep(state.inner, keep, rows)
            state.running = keep.shape[0]

    # -- the refill engine's lanes (search/refill.py): the wrapped backend's, with decode compiled ------------
    @torch.inference_mode()
    def open_lanes(self, lanes: int, rows_per_input: int, max_new_tokens: int) -> Any:
        state = self.backend.open_lanes(lanes, rows_per_input, max_new_tokens)
        mark_static(state)
        self.watching = watch_recordings()  # registered again after a torch._dynamo.reset
        return state

    @torch.inference_mode()
    def join(self, state: Any, lanes: list[int], batch: Batch) -> Tensor | None:
        """The wrapped backend's join; one that widens the lanes' sources (prompts) makes new tensors: marked static."""
        width = self.backend.lane_width(state)
        first = self.backend.join(state, lanes, batch)
        if self.backend.lane_width(state) != width:
            mark_static(state)
        return first

    def leave(self, state: Any, lanes: list[int]) -> None:
        """The wrapped backend's leave: those lanes idle."""
        self.backend.leave(state, lanes)
