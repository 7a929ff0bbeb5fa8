"""The lane table both KV caches stand on (``models/lane_table.py``), without a model: spans, back-pointers through
reorders, what each row sees, lanes joining and leaving at their own steps, the sliding window, where a step writes."""

from __future__ import annotations

import pytest
import torch

from seqgen_cli.models.lane_table import LaneTable
from seqgen_cli.shapes import span_bucket

CPU = torch.device("cpu")


def test_a_batch_attends_what_it_wrote_and_a_static_one_a_bucket() -> None:
    table = LaneTable(lanes=2, rows_per_input=1, max_len=100, device=CPU, own_steps=False)
    assert table.steps.shape == (1,) and table.position is table.steps  # one counter: every row at one step
    for t in range(3):
        table.check(t)
        assert table.span == t + 1
        table.advance()
    assert table.steps.tolist() == [3]
    table.make_static()
    assert table.span_at(3) == span_bucket(3, 100)  # a query: what check sets
    table.check(3)
    assert table.span == span_bucket(3, 100)
    with pytest.raises(ValueError, match="step 100 beyond the 100 positions"):
        table.check(100)


def test_back_pointers_keep_each_rows_own_history_through_reorders() -> None:
    """One lane of two beams: row 0 continues old row 1 after the first step; it then sees beam 1's position 0 and
    its own position 1, row 1 beam 1's both."""
    table = LaneTable(lanes=1, rows_per_input=2, max_len=4, device=CPU, own_steps=False)
    table.check(0)
    table.claim()
    first = table.visible(1)  # [L, Rq, span, R]
    assert first[0, :, 0].tolist() == [[True, False], [False, True]]  # each row its own beam
    table.advance()
    table.reorder(torch.tensor([1, 1]))
    table.check(1)
    table.claim()
    seen = table.visible(2)[0]  # [Rq, span, R]
    assert seen[0].tolist() == [[False, True], [True, False]]
    assert seen[1].tolist() == [[False, True], [False, True]]
    ptr = table.ptr.clone()
    assert torch.equal(table.visible(2)[0], seen) and torch.equal(table.ptr, ptr)  # a query: nothing written
    assert not table.visible(4)[0, :, 2:].any()  # positions not written yet: seen by none


def test_lanes_join_and_leave_at_their_own_steps() -> None:
    table = LaneTable(lanes=3, rows_per_input=2, max_len=8, device=CPU, own_steps=True)
    assert table.steps.shape == (3,) and table.position.shape == (6,)
    table.join([0, 2])
    for _ in range(3):
        table.advance()
    assert table.ages == [3, None, 3] and table.now(0) == 3
    table.leave([0])
    table.join([1])  # lane 1 starts at step 0 beside lane 2 at step 3
    assert table.ages == [None, 0, 3] and table.now(99) == 3  # the furthest live lane sizes the span, not t
    assert table.steps.tolist()[1:] == [0, 3] and table.position.tolist()[2:] == [0, 0, 3, 3]
    table.make_static()
    table.check(99)
    table.claim()
    seen = table.visible(table.span)  # [L, Rq, span, R]
    assert seen[1, 0, :, 0].tolist()[:4] == [True, False, False, False]  # lane 1: its one position, no stale keys
    assert seen[2, 0, :, 0].tolist()[:5] == [True, True, True, True, False]  # lane 2: positions 0..3
    for _ in range(10):  # an idle or finished lane keeps stepping, stopped at the last position
        table.advance()
    assert table.steps.tolist() == [7, 7, 7] and table.ages == [None, 7, 7]


def test_the_window_masks_keys_window_or_more_positions_back() -> None:
    table = LaneTable(lanes=1, rows_per_input=1, max_len=10, device=CPU, own_steps=False)
    for t in range(6):
        table.check(t)
        table.advance()
    table.check(6)
    assert table.near(3).tolist() == [[False] * 4 + [True] * 3]  # step 6 sees positions 4, 5, 6


def test_a_step_writes_at_each_lanes_own_position() -> None:
    """A batch writes its one position; lanes write each at their own step through ``lane_rows`` + ``at_steps``."""
    batch = LaneTable(lanes=2, rows_per_input=1, max_len=4, device=CPU, own_steps=False)
    cache = torch.zeros(2, 3, 4)  # [B, H, T]
    batch.check(0)
    batch.advance()
    batch.check(1)
    batch.write(cache, 2, torch.ones(2, 3), None)
    assert cache[:, :, 1].eq(1).all() and cache.sum() == 6
    lanes = LaneTable(lanes=2, rows_per_input=1, max_len=4, device=CPU, own_steps=True)
    lanes.make_static()
    lanes.join([0])
    lanes.advance()
    lanes.advance()
    lanes.join([1])  # lane 0 at step 2, lane 1 at step 0
    cache = torch.zeros(2, 3, 4)  # [L, H, T]
    lanes.write(cache, 2, torch.ones(2, 3), lanes.at_steps(lanes.lane_rows(3)))
    assert cache[0, :, 2].eq(1).all() and cache[1, :, 0].eq(1).all() and cache.sum() == 6
