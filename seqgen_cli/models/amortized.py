"""When a captured shape is worth compiling, by default (``--capture`` left unset): rent, then buy.

A graph costs seconds to compile (~14 s on empty caches on a GPU); a captured step saves a fraction of an eager
one. :class:`Amortized` compiles a shape once the steps it ran eagerly would, captured, have saved what compiling
it costs, so a run never pays much more than the better of "compile now" and "never compile" would have cost it.
``models/capture.py`` asks it at a batch's start (run the batch captured, or on the plain backend) and at a
captured batch's new shapes (span buckets, compactions).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

# A graph's compile and recording on empty caches (bart-large-cnn on the H200 of docs/BENCHMARKS.md, "GPU").
COMPILE_SECONDS = 14.0
# A captured step against the eager one (the same H200: fp16 3.75x BART, 4.41x GPT-2; float32 1.33x BART).
CAPTURED_SPEEDUP = {torch.float32: 1.33}  # half precision: HALF_SPEEDUP
HALF_SPEEDUP = 3.0


class Amortized:
    """When a shape is worth compiling (``--capture`` left to its default): once the steps it ran eagerly would,
    captured, have saved what compiling it costs. Rent, then buy: a run never pays for compiling much more than
    capture saves it (at most about twice the better of the two choices), and a short or varied run, whose shapes
    each see a few hundred steps, compiles little or nothing (docs/EXPERIMENTS.md, "Compile time on a real
    stream": ~14 s a graph, ~40 graphs for 2,000 CNN/DM inputs, against ~40 s that capturing them all saves).

    A step's time is the clock between two consecutive eager steps of a shape (model, search and host work; a
    batch's first step starts nothing), on the plain backend or a kept state; what capture would save of it is
    ``1 - 1 / speedup``; what compiling costs is the mean of this backend's shapes compiled so far, else
    ``compile_seconds``."""

    def __init__(
        self,
        compile_seconds: float = COMPILE_SECONDS,
        speedup: float = HALF_SPEEDUP,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.compile_seconds, self.saves, self.clock = compile_seconds, 1.0 - 1.0 / speedup, clock
        self.forgone: Counter[Any] = Counter()  # per shape: seconds capture would have saved it so far
        self._last: dict[Any, tuple[int, float]] = {}  # per shape: (step, clock) of its last eager step

    def charge(self, shape: Any, step: int) -> None:
        """``shape`` (or a batch standing in for it) is about to run step ``step`` eagerly: the interval since its
        step ``step - 1`` counts, what capture would have saved of it."""
        now = self.clock()
        last = self._last.get(shape)
        if last is not None and last[0] == step - 1:
            self.forgone[shape] += (now - last[1]) * self.saves
        self._last[shape] = (step, now)

    def paid(self, shape: Any, compiled: tuple[int, float]) -> bool:
        """Whether ``shape``'s forgone savings reach what compiling it costs; ``compiled``: (shapes compiled so
        far, their compile seconds)."""
        shapes, seconds = compiled
        return self.forgone[shape] >= (seconds / shapes if shapes else self.compile_seconds)

    def ready(self, shape: Any, step: int, compiled: tuple[int, float]) -> bool:
        """:meth:`charge` step ``step``, then whether ``shape`` should compile now (:meth:`paid`)."""
        self.charge(shape, step)
        return self.paid(shape, compiled)

    def waiting(self, compiled: Iterable[Any]) -> int:
        """Shapes that ran and are not compiled yet."""
        return len(set(self._last) - set(compiled))
