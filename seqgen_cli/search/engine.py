"""The decode loop. Every way seqgen generates runs it: a batch (:func:`seqgen_cli.search.generate`), the refill
engine's lanes (``search/refill.py``), eager or through the capture wrapper (``models/capture.py``).

A backend state holds rows; cohorts of inputs (``search/cohort.py``: rows, a search, results) run on them in
lockstep. A *step* feeds the next tokens of every row to the backend's one ``step``, hands each cohort the logits
of its rows and takes its next tokens (``t`` counts them); every ``sync_every`` steps the host check lets done inputs
leave. Where a
cohort runs is its placement:

- **the whole state** (a batch: one cohort, ``physical`` ``None``): the cohort's rows are the state's rows. Its
  search reorders the backend itself (``Rows.reorder``); inputs that leave leave the state (``backend.keep``: it
  shrinks, or under capture idles them), and the search feeds the backend what it chose (``Rows.tokens``: the
  running rows' tokens, or a static layout's whole token buffer, ``search/static.py``).
- **lanes** (:class:`Lanes`, the refill engine): the state's rows are ``L`` fixed lanes of ``R`` rows; a cohort's
  rows are some of them (``physical``). Its tokens go into the lanes' token buffer, its beam reordering into one
  permutation of all rows for the backend, and inputs that leave free their lanes (``backend.leave``) for joiners.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from seqgen_cli import openmp
from seqgen_cli.search.cohort import Cohort
from seqgen_cli.search.protocol import ModelBackend, SearchOutput


@dataclass
class RefillStats:
    """What a refill run did (``--stats`` ``device.refill``): decode steps, rows run and rows of a live input, joins."""

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
            "occupancy": round(self.occupancy, 4),
            "joins": self.joins,
            "steps": self.steps,
            "row_steps": self.row_steps,
            "live_row_steps": self.live_row_steps,
        }

    def add(self, other: RefillStats) -> None:
        self.steps += other.steps
        self.row_steps += other.row_steps
        self.live_row_steps += other.live_row_steps
        self.joins += other.joins


class Reorders:
    """The backend a lane cohort's ``Rows`` sees: it records the cohort's beam reordering (cohort rows) for the
    lanes' permutation; inputs that leave idle in their lanes (no keep)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def reorder(self, state: Any, rows: torch.Tensor) -> None:
        self.rows = rows

    def keep(self, state: Any, keep: torch.Tensor, rows: torch.Tensor) -> None:
        pass


@dataclass
class Placed:
    """A running cohort and where its rows are: ``physical`` [N_c] int64 among the lanes' rows, ``reorders`` its
    ``Rows``' backend (``None`` both: the whole state's rows, the real backend)."""

    cohort: Cohort
    physical: torch.Tensor | None = None
    reorders: Reorders | None = None


class Lanes:
    """The state's rows as ``count`` fixed input lanes of ``r`` rows: which are free, which input holds each, the
    next tokens of every row (``tokens`` [L * R]; idle lanes keep stale ones) and the steps' statistics."""

    def __init__(
        self, backend: Any, state: Any, count: int, r: int, device: torch.device, stats: RefillStats
    ) -> None:
        self.backend, self.state, self.count, self.r, self.stats = backend, state, count, r, stats
        self.free = list(range(count))
        self.lane_of: dict[int, int] = {}  # input -> its lane
        self.tokens = torch.zeros(count * r, dtype=torch.long, device=device)  # [L * R]
        self.identity = torch.arange(count * r, device=device)  # [L * R]

    def take(self, inputs: list[int]) -> list[int]:
        """Free lanes for ``inputs`` (at most as many as are free), lowest first."""
        used, self.free = self.free[: len(inputs)], self.free[len(inputs) :]
        self.lane_of.update(zip(inputs, used, strict=True))
        return used

    def rows(self, lanes: torch.Tensor) -> torch.Tensor:
        """The rows of lanes ``lanes`` ([J] int64): [J * R], lane-major."""
        return (lanes[:, None] * self.r + torch.arange(self.r, device=lanes.device)).reshape(-1)

    def leave(self, inputs: list[int]) -> None:
        """``inputs`` are done: their lanes idle (the backend's ``leave``) and are free for the next join."""
        lanes = [self.lane_of.pop(b) for b in inputs]
        self.backend.leave(self.state, lanes)
        self.free = sorted(self.free + lanes)

    def place(self, run: Placed, tokens: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor | None:
        """A cohort's next tokens ([N_c]) into the token buffer; its beam reordering (if any) into ``perm``, the
        permutation of all rows this step (``None``: none yet)."""
        physical, reorders = run.physical, run.reorders
        assert physical is not None and reorders is not None
        if reorders.rows is not None:
            perm = self.identity.clone() if perm is None else perm
            perm.index_copy_(0, physical, physical.index_select(0, reorders.rows))
            reorders.rows = None
        self.tokens.index_copy_(0, physical, tokens)
        return perm

    def count_step(self, running: list[Placed]) -> None:
        self.stats.steps += 1
        self.stats.row_steps += self.count * self.r
        self.stats.live_row_steps += sum(run.physical.shape[0] for run in running if run.physical is not None)


class Engine:
    """The one decode loop over ``backend``'s ``state`` (see the module docstring): ``lanes`` for the refill
    engine, else a batch's one cohort on the whole state (:meth:`add` it after its first step)."""

    def __init__(
        self, backend: ModelBackend, state: Any, sync_every: int, lanes: Lanes | None = None
    ) -> None:
        self.backend, self.state, self.sync_every, self.lanes = backend, state, sync_every, lanes
        self.running: list[Placed] = []
        self.t = 0  # steps run (a batch's first, on its start logits, counts: its cohort has advanced)
        self._checked = 0  # the step of the last host check

    def add(self, run: Placed, t: int = 0) -> None:
        """A cohort starts running (``t``: 1 for a batch's first step, already taken on its start logits)."""
        self.running.append(run)
        self.t = max(self.t, t)

    def run(self, join: Callable[[], bool] | None = None) -> None:
        """Steps and checks until no cohort runs. ``join`` (lanes): fills free lanes before each step (new
        cohorts :meth:`add` themselves) and says whether inputs still wait."""
        while True:
            if self.t % self.sync_every == 0 and self.t != self._checked:
                self._checked = self.t
                self.check()
            waiting = join() if join is not None else False
            if not self.running:
                if waiting:
                    continue  # every joiner was done at its join
                return
            self.step()

    def step(self) -> None:
        """One step: the backend's over every row, then each cohort's search step on its rows' logits."""
        lanes = self.lanes
        tokens = self.running[0].cohort.rows.tokens if lanes is None else lanes.tokens
        logits = self.backend.step(self.state, tokens)  # [N, V] (lanes: [L * R, V])
        openmp.tick()  # the thread count may follow the load (the `seqgen` process)
        self.t += 1
        if lanes is not None:
            lanes.count_step(self.running)
        perm: torch.Tensor | None = None
        for run in list(self.running):
            rows = logits if run.physical is None else logits.index_select(0, run.physical)  # [N_c, V]
            nxt = run.cohort.advance(rows)
            if nxt is None:  # its last step: every input done, results collected
                self.running.remove(run)
                if lanes is not None:
                    lanes.leave(run.cohort.rows.inputs)
            elif lanes is not None:
                perm = lanes.place(run, nxt, perm)
        if perm is not None:
            self.backend.reorder(self.state, perm)

    def check(self) -> None:
        """The host check of every cohort: done inputs leave (their results collected; lanes freed)."""
        for run in list(self.running):
            leaving = run.cohort.check()
            if leaving is None:
                continue
            if self.lanes is not None:
                self.lanes.leave(leaving.inputs)
            if leaving.all_done:
                self.running.remove(run)
            elif run.physical is not None:
                run.physical = run.physical.index_select(0, leaving.kept_rows)


def run_batch(backend: ModelBackend, cohort: Cohort, logits: torch.Tensor, sync_every: int) -> SearchOutput:
    """A batch's decode: its cohort's first step on the start logits ([N, V]: the prefill's, or the decoder start
    token's step), then the loop over the whole state; every input's results."""
    engine = Engine(backend, cohort.rows.state, sync_every)
    if cohort.advance(logits) is not None:
        engine.add(Placed(cohort), t=1)
        engine.run()
    return cohort.results.output()
