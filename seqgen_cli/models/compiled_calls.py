"""A compiled call, made and guarded: :class:`Guarded`, the one guard of the capture path, used for the model's decode
step (``models/capture.py``) and the static beam search's step (``search/static.py``) alike.

Made: :func:`compile_decode` and :func:`compile_search` compile with ``torch.compile(mode="reduce-overhead",
fullgraph=True, dynamic=False)``, a CUDA graph per key, replayed (cudagraph trees warm up on a key's first call,
record on the second, replay from the third). Every call runs under torch's recompile limit raised to the
caller's cap, a hit of it raising (:func:`call_under_limit`); once a key has run its :data:`SETTLING_CALLS`, only
dynamo's differentiating guards (the key naming every host value a graph depends on: batch shape, source width,
positions, span bucket; or kept state's shape and search settings).

Guarded (:class:`Guarded`): each key's first replay is compared with the eager call on the same inputs (both steps
are idempotent: the model's ``decode`` rewrites the same position, the search step is a pure function of its tensors):
logits further apart than :func:`step_tolerance` (:func:`logits_differ`), search outputs that differ
(:func:`outputs_differ`) switch to eager for good, with the reason. A failure (compile error, recording error,
torch's recompile limit) falls back to eager for good, with the reason; the failed call is rerun eagerly. An
out-of-memory error stays one (the batch is split, ``batching.generate_split``); raised while a key settles (its
compile or recording), that key runs eagerly from then on. Inductor skipping CUDA graphs (``cudagraph_skips``, read
around every call) turns that key eager (the model's step) or every call (``skip_for_good``: the search's). Counted:
calls per key, steps compiled and eager, compile seconds, and, where torch announces them
(:func:`watch_recordings`), the CUDA graphs each key's calls recorded.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.errors import is_oom

# (search state, logits [L * R, V]) -> its new tensors, tokens, rows (search/static.py)
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

    ``settled``: the call's shape (the caller's key: batch shape and span bucket, or kept state's shape and
    search settings) has run its :data:`SETTLING_CALLS`, so a compiled entry for it exists and every host value its
    graph depends on is in the key. Then only dynamo's *differentiating* guards run
    (:func:`unguarded`): every tensor's metadata, and the values that told the entries apart so far, not the
    type, id and constant checks that cannot change for a kept state (45-58 against 77-96 µs a call on the
    CPU of docs/EXPERIMENTS.md, "Compiled step on the CPU"). A new key's first calls run every guard, so a host
    value that selects another graph (a new span bucket) recompiles and becomes a differentiating guard. The key
    must name every such value: a settled call whose differentiating guards pass may run a graph traced for another
    value, silently (``tests/models/test_capture.py``: a key without its span gives other tokens); one whose guards all
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


def logits_differ(compiled: Tensor, eager: Tensor, key: Any, tolerance: float) -> str | None:
    """Why a compiled model step's logits are not the eager step's (beyond ``tolerance`` of the largest eager
    logit, :func:`step_tolerance`), or ``None``. One host sync."""
    compiled, eager = compiled.float(), eager.float()
    gap = torch.where(compiled == eager, 0.0, (compiled - eager).abs()).max()  # nan stays nan: differs
    scale = eager.abs().nan_to_num(0.0, 0.0, 0.0).max().clamp(min=1.0)
    if bool(gap <= tolerance * scale):
        return None
    return f"compiled step differs from eager: max |diff| {float(gap):.3g} of {float(scale):.3g}, shape {key}"


def outputs_differ(compiled: list[Tensor], eager: list[Tensor], key: Any, tolerance: float) -> str | None:
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


_COMPILE_PARAMS = frozenset(inspect.signature(torch.compile).parameters)


def compile_decode(decode: Any) -> Any:
    """CUDA graphs through ``torch.compile``: one graph per shape, replayed (static caches, ``models/capture.py``).
    Where torch offers it, the compiled entries are this call's own, so other instances' shapes do not count
    against its recompile limit."""
    isolate = {"isolate_recompiles": True} if "isolate_recompiles" in _COMPILE_PARAMS else {}
    return torch.compile(decode, mode="reduce-overhead", fullgraph=True, dynamic=False, **isolate)


def compile_search(step: SearchStep) -> SearchStep:
    """The static beam search's step (``search/static.py``) as CUDA graphs, compiled as :func:`compile_decode`
    compiles the model's: one graph per kept state's shape, its state's tensors static addresses (kept per shape)."""
    return compile_decode(step)


Differs = Callable[[Any, Any, Any], str | None]  # (compiled output, eager output, key) -> why they differ


class Guarded:
    """Functions compiled by ``compiler`` (each once; torch traces a graph per key) and called per key under the
    guards of the module docstring. ``differs``: the first-replay check (:func:`logits_differ`,
    :func:`outputs_differ`, with their tolerance). ``word``: what a compiled call counts as in ``steps``.
    ``skip_for_good``: inductor skipping CUDA graphs turns every call eager (else only the key's). ``cap``: keys
    beyond ``max_shapes`` run eagerly (``capped`` says one did; else torch's recompile limit, at ``max_shapes``,
    stops compiled calls for good). ``clock``: what times ``compile_seconds`` (which ``Amortized`` weighs; the
    tests pass a fake one, so that no decision of theirs depends on the machine's load)."""

    def __init__(
        self,
        compiler: Callable[[Any], Any],
        max_shapes: int,
        differs: Differs,
        word: str = "compiled",
        skip_for_good: bool = False,
        cap: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        from torch._dynamo.utils import counters

        self.compiler, self.max_shapes, self.differs, self.clock = compiler, max_shapes, differs, clock
        self.word, self.skip_for_good, self.cap = word, skip_for_good, cap
        self.capped = False  # a key beyond max_shapes ran eagerly (cap)
        # each function's compiled one; None after a failure: eager for good
        self.compiled: dict[Callable[..., Any], Callable[..., Any]] | None = {}
        self.calls: Counter[Any] = Counter()  # compiled calls per key
        self.keys: set[Any] = set()  # keys running compiled (a compiled call returned, checked)
        self.oom_keys: set[Any] = set()  # out of memory while compiling or recording: eager
        self.skipped_keys: set[Any] = set()  # inductor ran them without CUDA graphs: eager
        self.failure: str | None = None  # why compiled calls stopped
        self.steps = Counter({word: 0, "eager": 0})
        self.compile_seconds = 0.0  # host seconds in each key's compile + warm-up and recording calls
        self.recorded: Counter[Any] = Counter()  # CUDA graphs recorded per key (graphs_recorded)
        self._counters = counters  # torch's: counters["inductor"]["cudagraph_skips"]

    @classmethod
    def for_decode(cls, compiler: Callable[[Any], Any], max_shapes: int, dtype: torch.dtype) -> Guarded:
        """The model step's guard (``models/capture.py``): logits checked within :func:`step_tolerance`, steps
        counted ``captured``, keys past ``max_shapes`` eager, a key inductor skipped eager."""
        differs = partial(logits_differ, tolerance=step_tolerance(dtype))
        return cls(compiler, max_shapes, differs, word="captured", cap=True)

    @classmethod
    def for_search(cls, compiler: Callable[[Any], Any], max_shapes: int, dtype: torch.dtype) -> Guarded:
        """The static search's step's guard (``search/static.py``): outputs checked (scores within
        :func:`step_tolerance`), steps counted ``compiled``, inductor skipping a key: every call eager."""
        differs = partial(outputs_differ, tolerance=step_tolerance(dtype))
        return cls(compiler, max_shapes, differs, skip_for_good=True)

    def eager_for_good(self, key: Any) -> bool:
        """Whether ``key``'s calls run eagerly whatever comes: after a failure, a key that ran out of memory while
        compiling or recording, or that inductor skipped; under ``cap``, a new key once ``max_shapes`` run
        compiled (noted)."""
        if self.compiled is None or key in self.oom_keys or key in self.skipped_keys:
            return True
        if self.cap and key not in self.keys and len(self.keys) >= self.max_shapes:
            self.capped = True
            return True
        return False

    def eager(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run eagerly (counted)."""
        self.steps["eager"] += 1
        return fn(*args)

    def __call__(self, key: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` compiled, for ``key``, guarded: eager where it must be (the module docstring). The first
        two calls of a key count as compile seconds, failed or not."""
        if self.eager_for_good(key):
            return self.eager(fn, *args)
        table: dict[Callable[..., Any], Callable[..., Any]] = self.compiled  # type: ignore[assignment]: not None
        compiled = table.get(fn) or table.setdefault(fn, self.compiler(fn))
        call = self.calls[key]
        self.calls[key] += 1
        settling = call < SETTLING_CALLS - 1  # compile + warm-up, or recording
        skips, recorded, t0 = self._skips(), graphs_recorded(), self.clock()
        failure: str | None = None
        try:
            out = call_under_limit(self.max_shapes, compiled, *args, settled=call >= SETTLING_CALLS)
        except Exception as err:  # noqa: BLE001 - any compile/capture failure: eager, with the reason
            if is_oom(err):
                if settling:
                    self.oom_keys.add(key)
                    self.keys.discard(key)
                raise
            failure = f"{type(err).__name__}: {first_line(err)}"
        finally:
            self.recorded[key] += graphs_recorded() - recorded
            if settling:
                self.compile_seconds += self.clock() - t0
        if failure is not None:
            return self._fall_back(failure, fn, *args)
        if self._skips() > skips:  # inductor ran this key without CUDA graphs (and goes on so)
            if self.skip_for_good:
                return self._fall_back(SKIPPED, fn, *args)
            self.skipped_keys.add(key)  # this key eager from now on, the others as they were
            self.keys.discard(key)
            return self.eager(fn, *args)
        if call == SETTLING_CALLS - 1:  # the key's first replay: checked once against the eager call
            eager = fn(*args)  # idempotent: the same inputs, the same writes
            failure = self.differs(out, eager, key)
            if failure is not None:
                self.compiled, self.failure = None, failure
                self.steps["eager"] += 1
                return eager
        self.keys.add(key)
        self.steps[self.word] += 1
        return out

    def _skips(self) -> int:
        return self._counters["inductor"]["cudagraph_skips"]

    def _fall_back(self, reason: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Eager for good from this call on, with the reason (the failed call reruns eagerly)."""
        self.compiled, self.failure = None, reason
        return self.eager(fn, *args)

    @property
    def path(self) -> str:
        return self.word if self.failure is None else f"eager ({self.failure})"

    def notes(self) -> list[str]:
        """What runs eagerly while the other keys run compiled: keys past the cap, keys inductor skipped, keys that
        ran out of memory while compiling."""
        notes = [f"{self.max_shapes} shapes; eager beyond"] if self.capped else []
        if self.skipped_keys:
            notes.append(f"{len(self.skipped_keys)} eager: inductor skipped CUDA graphs")
        if self.oom_keys:
            notes.append(f"{len(self.oom_keys)} eager: out of memory while compiling")
        return notes

    def counts(self, prefix: str = "") -> dict[str, Any]:
        """For ``--stats``: compile seconds, steps run compiled and eagerly (``prefix`` before each name)."""
        steps = {f"{prefix}{word}_steps": n for word, n in self.steps.items()}
        return {f"{prefix}compile_seconds": round(self.compile_seconds, 1), **steps}

    def recordings(self, prefix: str, name: Callable[[Any], str]) -> Counter[str]:
        """CUDA graphs recorded per key, by ``prefix`` and ``name(key)``."""
        return Counter({prefix + name(key): n for key, n in self.recorded.items()})
