"""The lane table both KV caches stand on (``models/kv_cache.py``): which position each lane's rows write, which
each row sees, and the host's side of a step. No keys or values: a table of steps, back-pointers and spans.

Lanes. ``L`` lanes of ``R`` rows (rows lane-major, ``row = l * R + k``: for a batch, an input is a lane, see
``seqgen_cli/search/protocol.py``), ``T = max_new_tokens`` positions per row. Where every lane is at one step (a
batch) one counter serves all (``steps`` [1]); the refill engine's lanes each have their own (``steps`` [L]).

Beams. Reordering moves only back-pointers (``ptr``): each query row scores against all its lane's keys and
:meth:`LaneTable.visible` keeps its own history (docs/EXPERIMENTS.md, "Self-attention cache: reorder strategies").

Spans. A batch's eager step attends the ``t + 1`` positions written so far (``span``, set by the host-side
:meth:`LaneTable.check`) and writes through a view at the host's ``t``; a static table (``make_static()``: capture,
lanes) reads the step it writes from device tensors and attends a span bucket (``shapes.span_bucket``), so no host
integer that changes per step reaches the tensor work. :func:`run_step` is the host's side of every fast step.

Queries (``span_t``, ``span_at``, ``visible``, ``visible_keys``, ``near``, ``near_keys``, ``near_columns``,
``lane_rows``, ``at_steps``, ``lane_count``) change nothing; updates are named: ``check``, ``claim``, ``advance``,
``join``, ``leave``, ``reorder``, ``reset``, ``make_static``, ``write``. Nothing here syncs with the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.shapes import span_bucket


def pointer_bytes(rows: int, max_len: int) -> int:
    """Bytes of the back-pointers (:attr:`LaneTable.ptr`) for ``rows`` rows and ``max_len`` positions (int64)."""
    return rows * max_len * 8


def check_position(t: int, max_len: int) -> None:
    """Host-side bounds check before step ``t``: ``ValueError`` past the ``max_len`` positions of ``start()``."""
    if t >= max_len:
        raise ValueError(f"step {t} beyond the {max_len} positions allocated by start()")


Decode = Callable[[Any, Tensor], Tensor]  # (backend state, tokens [N]) -> logits [N, V]


def run_step(decode: Decode, state: Any, tokens: Tensor) -> Tensor:
    """One decode step of a fast backend, a batch's or every lane's: ``decode`` (the tensor work, eager or
    compiled: ``models/capture.py``) between the host bookkeeping.

    ``state`` has ``t`` (host step counter) and ``cache`` (``check(t)``: bounds and the span this step attends;
    ``advance()``); tokens [N] -> logits [N, V]."""
    state.cache.check(state.t)
    logits = decode(state, tokens)
    state.t += 1
    state.cache.advance()
    return logits


def write_position(cache: Tensor, dim: int, new: Tensor, position: Tensor, at: int | None) -> None:
    """Store ``new`` (``cache`` without ``dim``) at position ``position`` ([1] int64, on the device) along ``dim``;
    ``at``: the same position as a host int off the static path, where the write is a plain view copy."""
    if at is None:
        cache.index_copy_(dim, position, new.unsqueeze(dim))
    else:
        cache.select(dim, at).copy_(new)


class LaneTable:
    """What both caches share: which position each lane's rows write and which each of them sees.

    ``steps`` ([1]: a batch, every lane at one step; [L]: lanes at their own steps, the refill engine's) is the
    position each lane writes, on the device; ``position`` ([1] or [N]) the one each row writes, what a backend
    reads for its position ids. ``ptr[n, s]``: the beam (``0..R-1``, same lane) whose position ``s`` is in row
    ``n``'s history. Lanes at their own steps: a stale position (a previous input's) is masked; an idle lane (no
    input) keeps stepping, its counter stops at ``T - 1`` and it always sees position 0, so its rows stay finite
    and its writes stay in its own rows. Their span is a bucket of the furthest live lane's step (``lane_t``, host),
    at least ``MIN_SPAN`` positions, so an input's sums run over the same span beside any neighbours wherever its
    own steps fit in ``MIN_SPAN`` (a sum over more masked positions can round differently)."""

    static: bool  # attend the t+1 positions written; a span bucket after make_static() (capture, lanes)
    max_len: int
    span: int  # positions this step attends (host int; a span bucket if static)
    r: int
    ptr: Tensor  # [N, T] int64
    steps: Tensor  # [1] or [L] int64: the position each lane writes
    position: Tensor  # [1] or [N] int64: the position each row writes
    own_steps: bool  # a step counter per lane (the refill engine's lanes), else one for all (a batch)
    lane_t: list[int | None]  # lanes at their own steps: each one's t (host; None: idle); a batch: none

    def __init__(
        self, lanes: int, rows_per_input: int, max_len: int, device: torch.device, own_steps: bool
    ) -> None:
        """``lanes`` lanes of ``rows_per_input`` rows and ``max_len`` positions; ``own_steps``: a step counter per lane
        (the refill engine's lanes), else one for all (a batch)."""
        self.r, self.max_len, self.static, self.span = rows_per_input, max_len, False, max_len
        self.ptr = torch.zeros(lanes * rows_per_input, max_len, dtype=torch.long, device=device)  # [N, T]
        self.beams = torch.arange(rows_per_input, device=device)  # [R]
        self.positions = torch.arange(max_len, device=device)  # [T]
        self.steps = torch.zeros(lanes if own_steps else 1, dtype=torch.long, device=device)  # [L] or [1]
        self.position = (
            torch.zeros(lanes * rows_per_input, dtype=torch.long, device=device) if own_steps else self.steps
        )
        self.own_steps = own_steps
        self.lane_t: list[int | None] = [None] * lanes if own_steps else []

    @property
    def lane_count(self) -> int:
        """The lanes (a batch's inputs) the table holds now."""
        return self.ptr.shape[0] // self.r

    def buffers(self) -> list[Tensor]:
        """The per-layer generated K/V tensors (a cache's): what :meth:`make_static` and :meth:`reset` zero."""
        return []

    def make_static(self) -> None:
        """Attend a span bucket of positions from now on (``shapes.span_bucket``: graph capture, before the first
        step): zero the unwritten."""
        if not self.static:
            for x in self.buffers():
                x.zero_()
            self.static = True

    def reset(self) -> None:
        """A kept static cache (``models/capture.py``) takes a new batch, as a new cache would start: every position
        unwritten (zeros), back-pointers cleared, the next step writes position 0. In place: nothing is allocated."""
        for x in self.buffers():
            x.zero_()
        self.ptr.zero_()
        self.steps.zero_()
        self.span = self.max_len

    def span_t(self, t: int) -> int:
        """The step that sizes step ``t``'s span: ``t`` itself for a batch; the furthest live lane's ``lane_t`` for
        lanes at their own steps (``t``, the steps run, is not it)."""
        if not self.own_steps:
            return t
        return max((a for a in self.lane_t if a is not None), default=0)

    def span_at(self, t: int) -> int:
        """The positions step ``t`` attends (what :meth:`check` sets): ``t + 1``, or its span bucket when static."""
        at = self.span_t(t)
        return span_bucket(at, self.max_len) if self.static else at + 1

    def check(self, t: int) -> None:
        """Host: step ``t`` is about to run (``ValueError`` past the allocated positions; lanes stay below ``T``: the
        engine stops an input at its last step); sets ``span``."""
        check_position(self.span_t(t), self.max_len)
        self.span = self.span_at(t)

    def advance(self) -> None:
        """A step is done: the next one writes the next position (queued on the device, no sync); a lane at its own
        step stops at the last one."""
        self.steps.add_(1)
        if self.own_steps:
            self.steps.clamp_(max=self.max_len - 1)
            self._row_steps()
            self.lane_t = [None if a is None else min(a + 1, self.max_len - 1) for a in self.lane_t]

    def join(self, lanes: list[int]) -> None:
        """Inputs join lanes ``lanes`` (lanes at their own steps): their counters restart at step 0 (stale keys are
        masked)."""
        assert self.own_steps
        self.steps.index_fill_(0, torch.tensor(lanes, dtype=torch.long, device=self.steps.device), 0)
        self._row_steps()
        for lane in lanes:
            self.lane_t[lane] = 0

    def leave(self, lanes: list[int]) -> None:
        """The inputs of ``lanes`` are done: they idle (their steps no longer size the span)."""
        assert self.own_steps
        for lane in lanes:
            self.lane_t[lane] = None

    def _row_steps(self) -> None:
        lanes, r = self.steps.shape[0], self.r
        self.position.view(lanes, r).copy_(self.steps[:, None])  # [L] -> [L, R]

    def claim(self) -> None:
        """A step starts (inside the decode step: on the device, captured with it): the position each row writes
        now holds its own beam's keys, in its back-pointers. Before :meth:`visible`."""
        if self.r > 1:
            n = self.ptr.shape[0]
            self.ptr.scatter_(1, self.position.expand(n)[:, None], self.beams.repeat(n // self.r)[:, None])

    def visible(self, span: int) -> Tensor:
        """Which of the first ``span`` positions each query row sees (its lane's step and before, its back-pointers;
        lanes at their own steps: position 0 always): bool [L, Rq, span, R]; with R = 1 [L|1, 1, span, 1]. A pure
        query: :meth:`claim` first."""
        pos, r = self.positions[:span], self.r
        upto = pos <= self.steps[:, None]  # [1|L, span]
        if self.own_steps:
            upto = upto | (pos == 0)
        upto = upto.view(-1, 1, span, 1)  # [1|L, 1, span, 1]
        if r == 1:
            return upto
        return (self.ptr[:, :span].view(-1, r, span, 1) == self.beams) & upto  # [L, Rq, span, R]

    def visible_keys(self) -> Tensor | None:
        """:meth:`visible` for this step's ``span``, as the ``span * R`` keys a query row scores (position-major:
        ``s * R + beam``): bool [B|L|1, Rq, span*R]; ``None`` where every row sees every position attended (a
        batch's eager step with one row per input). A pure query: :meth:`claim` first."""
        if not self.static and self.r == 1:
            return None
        span, r = self.span, self.r
        return self.visible(span).expand(-1, r, span, r).reshape(-1, r, span * r)  # [B|L|1, Rq, span*R]

    def near(self, window: int) -> Tensor:
        """Which of the first ``span`` positions are less than ``window`` before each lane's step: bool [1|L, span]."""
        return self.positions[: self.span] > self.steps[:, None] - window

    def near_columns(self, window: int, width: Tensor | int, columns: int) -> Tensor:
        """Which of ``columns`` prompt columns are less than ``window`` positions before each lane's step, the prompt
        left-padded in its first ``width`` (an int, or each lane's own [L]) and the generated positions after it, as
        transformers' masks count them (two real tokens are as far apart at any padding): bool [1|L, columns]."""
        width = width[:, None] if isinstance(width, Tensor) else width  # [L, 1] or an int
        cols = torch.arange(columns, device=self.steps.device)  # [columns]
        return cols > width + self.steps[:, None] - window  # [1|L, columns]

    def near_keys(self, window: int) -> Tensor:
        """:meth:`near` as the ``span * R`` keys a query row scores: bool [1|L, span*R]."""
        span, r = self.span, self.r
        return self.near(window)[:, :, None].expand(-1, span, r).reshape(-1, span * r)  # [1|L, span*R]

    def lane_rows(self, per_lane: int) -> Tensor | None:
        """Lanes at their own steps: where position 0 of each of a lane's ``per_lane`` rows lies in a cache tensor
        viewed as [L * per_lane * T, ...] (:meth:`write`), [L, per_lane]; a batch: ``None``."""
        if not self.own_steps:
            return None
        lanes = self.steps.shape[0]
        return (torch.arange(lanes * per_lane, device=self.steps.device) * self.max_len).view(lanes, per_lane)

    def write(self, cache: Tensor, dim: int, new: Tensor, where: Tensor | None) -> None:
        """Store ``new`` (``cache`` [L, ..., T, ...] without its positions ``dim``) at each lane's step: a batch's at
        its one position; lanes' through ``where`` (:meth:`lane_rows` plus the lanes' steps, [L * per_lane])."""
        if where is None:
            write_position(cache, dim, new, self.steps, None if self.static else self.span - 1)
        else:
            rows = cache.view(where.shape[0] * self.max_len, -1)  # [L, ..., T, ...] -> [L*per_lane*T, rest]
            new = new.reshape(where.shape[0], -1)  # [L, ..., rest] -> [L*per_lane, rest]
            rows.index_copy_(0, where, new)

    def at_steps(self, rows: Tensor | None) -> Tensor | None:
        """This step's write index from :meth:`lane_rows`: [L * per_lane], or ``None`` (a batch)."""
        return None if rows is None else (rows + self.steps[:, None]).view(-1)

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move, in place."""
        self.ptr.copy_(self.ptr.index_select(0, rows))
