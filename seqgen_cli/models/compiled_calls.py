"""A compiled call, made and checked: torch's recompile limit held for every call, dynamo's guards narrowed once a
shape has settled, the first replay compared with the eager step, CUDA graph recordings counted; and the beam
search's slot step compiled and guarded that way (:class:`CompiledSearch`). ``models/capture.py`` guards the
model's step with the same pieces.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.errors import is_oom

# (search state, logits [P * R, V]) -> its new tensors, tokens, rows (search/slots.py)
SearchStep = Callable[[Any, Tensor], list[Tensor]]
SearchCompiler = Callable[[SearchStep], SearchStep]

SKIPPED = "inductor skipped CUDA graphs: cudagraph_skips"  # a shape's calls raised inductor's counter
SETTLING_CALLS = 3  # a shape's first calls: compile + warm-up, CUDA graph recording, first replay


def step_tolerance(dtype: torch.dtype) -> float:
    """How far a compiled step's logits may be from the eager step's, relative to the largest: other kernels
    round differently (16 units of the model dtype's last place, at least 1e-3); a stale or misplaced cache
    write is off by the logits' own size."""
    return max(1e-3, 16 * torch.finfo(dtype).eps)


def first_line(err: BaseException) -> str:
    """An error's first line, at most 200 characters."""
    return (str(err).strip().splitlines() or [""])[0][:200]


def call_under_limit(limit: int, fn: Callable[..., Any], *args: Any, settled: bool = False) -> Any:
    """``fn(*args)`` (a compiled function) under torch's recompile limit raised to at least ``limit`` (ours
    decides; a guard that misses on a known shape recompiles under it too) and a hit of it raising instead of
    running eagerly unseen. Set and restored by attribute: ~6 µs a call (``config.patch``: ~100).

    ``settled``: the call's shape (the caller's key: batch shape and span bucket, or slot shape and search
    settings) has run its :data:`SETTLING_CALLS`, so a compiled entry for it exists and every host value its
    graph depends on is in the key. Then only dynamo's *differentiating* guards run
    (:func:`unguarded`): every tensor's metadata, and the values that told the entries apart so far, not the
    type, id and constant checks that cannot change for a kept state (45-58 against 77-96 µs a call on the
    CPU of docs/BENCHMARKS.md, "Compiled step on the CPU"). A new key's first calls run every guard, so a host
    value that selects another graph (a new span bucket) recompiles and becomes a differentiating guard. The key
    must name every such value: a settled call whose differentiating guards pass may run a graph traced for another
    value, silently (``tests/test_capture.py``: a key without its span gives other tokens); one whose guards all
    fail (torch refuses to compile under the stance, before running anything) is made again with every guard."""
    cfg = torch._dynamo.config
    old = cfg.recompile_limit, cfg.fail_on_recompile_limit_hit
    cfg.recompile_limit, cfg.fail_on_recompile_limit_hit = max(old[0], limit), True
    try:
        if settled:
            try:
                with unguarded():
                    return fn(*args)
            except RuntimeError as err:  # no entry passed them: torch refuses to compile under the stance
                if "skip_guard_eval_unsafe" not in str(err):
                    raise
        return fn(*args)  # every guard (and a compile where no entry fits): nothing ran in the refused call
    finally:
        cfg.recompile_limit, cfg.fail_on_recompile_limit_hit = old


def unguarded() -> Any:
    """A context in which compiled calls run only the differentiating guards (``torch.compiler.set_stance``'s
    ``skip_guard_eval_unsafe``), or nothing where torch lacks it or a caller chose another stance."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    if _SKIP_GUARDS and stance is not None and (stance.stance, stance.backend) == ("default", None):
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


_SKIP_GUARDS = "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


def outputs_differ(compiled: list[Tensor], eager: list[Tensor], tolerance: float) -> str | None:
    """Why a compiled search step's outputs are not the eager step's, or ``None``: integer and boolean ones
    (tokens, rows, flags, lengths) must be equal, float ones (scores) within ``tolerance`` of each value (at least
    of 1). One host sync."""
    same = []
    for ours, theirs in zip(compiled, eager, strict=True):
        if ours.is_floating_point():
            gap = torch.where(ours == theirs, 0.0, (ours - theirs).abs())  # nan stays nan: differs
            same.append((gap <= tolerance * theirs.abs().nan_to_num(0.0, 0.0, 0.0).clamp(min=1.0)).all())
        else:
            same.append((ours == theirs).all())
    flags = torch.stack(same).tolist()  # the one sync
    for i, ok in enumerate(flags):
        if not ok:
            return f"compiled search step differs from eager: output {i} of {len(compiled)}"
    return None


_RECORDED = [0]  # CUDA graphs recorded in this process so far (counted by _on_compile_start)


def _on_compile_start(args: Any) -> None:
    if args.callback_trigger.name == "CUDAGRAPH_RECORDING":
        _RECORDED[0] += 1


def watch_recordings() -> bool:
    """Count CUDA graph recordings (``graphs_recorded``): cudagraph trees run torch.compile's start callbacks with
    the ``CUDAGRAPH_RECORDING`` trigger for each graph they record (one process-wide callback, registered again
    after a ``torch._dynamo.reset``, which clears them). ``False`` where this torch announces no recordings."""
    try:
        from torch._dynamo.callback import CallbackTrigger, callback_handler

        if not hasattr(CallbackTrigger, "CUDAGRAPH_RECORDING"):
            return False
        if _on_compile_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_compile_start)
    except (ImportError, AttributeError):  # a torch whose compile callbacks differ: nothing counted
        return False
    return True


def graphs_recorded() -> int:
    """CUDA graphs recorded in this process since :func:`watch_recordings` (any thread, any compiled function):
    read around a call for the call's."""
    return _RECORDED[0]


class CompiledSearch:
    """The search's slot step (``search/slots.py``) compiled once by ``compiler`` (torch traces it once per slot
    shape) and guarded as ``decode`` is: a compile or recording error, torch's recompile limit or inductor skipping
    CUDA graphs falls back to the eager step for good, with the reason (the step is a pure function of its
    tensors: the failed call reruns eagerly); an out-of-memory error is re-raised; each shape's first replay is
    checked against the eager step."""

    def __init__(self, compiler: SearchCompiler, max_shapes: int, tolerance: float) -> None:
        from torch._dynamo.utils import counters

        self.compiler, self.max_shapes, self.tolerance = compiler, max_shapes, tolerance
        self.compiled: dict[SearchStep, SearchStep] = {}
        self.calls: Counter[Any] = Counter()  # compiled calls per slot shape
        self.failure: str | None = None  # why compiled calls stopped
        self.steps = Counter({"compiled": 0, "eager": 0})
        self.compile_seconds = 0.0
        self.recorded: Counter[Any] = Counter()  # CUDA graphs recorded per slot shape (graphs_recorded)
        self._counters = counters

    def __call__(self, shape: Any, step: SearchStep, search: Any, logits: Tensor) -> list[Tensor]:
        if self.failure is not None:
            return self.eager(step, search, logits)
        compiled = self.compiled.get(step) or self.compiled.setdefault(step, self.compiler(step))
        call = self.calls[shape]
        self.calls[shape] += 1
        skips, t0 = self._counters["inductor"]["cudagraph_skips"], time.perf_counter()
        recorded = graphs_recorded()
        try:
            out = call_under_limit(self.max_shapes, compiled, search, logits, settled=call >= SETTLING_CALLS)
        except Exception as err:  # noqa: BLE001 - any compile/capture failure: eager, with the reason
            if is_oom(err):
                raise
            return self._fall_back(f"{type(err).__name__}: {first_line(err)}", step, search, logits)
        finally:
            self.recorded[shape] += graphs_recorded() - recorded
        if call < SETTLING_CALLS - 1:
            self.compile_seconds += time.perf_counter() - t0
        if self._counters["inductor"]["cudagraph_skips"] > skips:
            return self._fall_back(SKIPPED, step, search, logits)
        if call == SETTLING_CALLS - 1:  # the shape's first replay: checked once against the eager step
            eager = step(search, logits)
            self.failure = outputs_differ(out, eager, self.tolerance)
            if self.failure is not None:
                self.steps["eager"] += 1
                return eager
        self.steps["compiled"] += 1
        return out

    def eager(self, step: SearchStep, search: Any, logits: Tensor) -> list[Tensor]:
        """The step run eagerly (counted)."""
        self.steps["eager"] += 1
        return step(search, logits)

    def _fall_back(self, reason: str, step: SearchStep, search: Any, logits: Tensor) -> list[Tensor]:
        self.failure = reason
        return self.eager(step, search, logits)

    @property
    def path(self) -> str:
        return "compiled" if self.failure is None else f"eager ({self.failure})"
