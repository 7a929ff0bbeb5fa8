"""The lane table both KV caches stand on (``models/lane_table.py``), without a model: spans, back-pointers through
reorders, what each row sees (as positions and as the keys a row scores), lanes joining and leaving at their own
steps, the sliding window, where a step writes; queries write nothing, only the named updates do."""

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
    assert table.lane_t == [3, None, 3] and table.span_t(0) == 3
    table.leave([0])
    table.join([1])  # lane 1 starts at step 0 beside lane 2 at step 3
    assert table.lane_t == [None, 0, 3] and table.span_t(99) == 3  # the furthest live lane sizes it, not t
    assert table.steps.tolist()[1:] == [0, 3] and table.position.tolist()[2:] == [0, 0, 3, 3]
    table.make_static()
    table.check(99)
    table.claim()
    seen = table.visible(table.span)  # [L, Rq, span, R]
    assert seen[1, 0, :4, 0].tolist() == [True, False, False, False]  # lane 1: its one position, none stale
    assert seen[2, 0, :, 0].tolist()[:5] == [True, True, True, True, False]  # lane 2: positions 0..3
    for _ in range(10):  # an idle or finished lane keeps stepping, stopped at the last position
        table.advance()
    assert table.steps.tolist() == [7, 7, 7] and table.lane_t == [None, 7, 7]


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


def test_what_a_row_sees_as_the_keys_it_scores() -> None:
    """``visible_keys`` lays ``visible`` out as the ``span * R`` keys a row scores (position-major, ``s * R + beam``);
    a batch's eager step with one row per input sees every position it attends (``None``: no mask)."""
    table = LaneTable(lanes=1, rows_per_input=2, max_len=4, device=CPU, own_steps=False)
    table.check(0)
    table.claim()
    table.advance()
    table.reorder(torch.tensor([1, 1]))
    table.check(1)
    table.claim()
    keys = table.visible_keys()  # [L, Rq, span*R]
    assert keys is not None and keys.shape == (1, 2, 4)
    assert keys[0].tolist() == [[False, True, True, False], [False, True, False, True]]
    assert torch.equal(keys.view(1, 2, 2, 2), table.visible(2))  # [L, Rq, span, R]
    one = LaneTable(lanes=3, rows_per_input=1, max_len=4, device=CPU, own_steps=False)
    one.check(0)
    assert one.visible_keys() is None  # eager, R = 1: all of the t + 1 positions
    one.make_static()
    one.check(0)
    assert one.visible_keys().tolist() == [[[True] + [False] * 3]]  # static: the bucket's unwritten masked


def test_the_window_as_the_keys_a_row_scores() -> None:
    table = LaneTable(lanes=2, rows_per_input=2, max_len=8, device=CPU, own_steps=True)
    table.make_static()
    table.join([0, 1])
    for _ in range(5):
        table.advance()
    table.join([1])
    table.check(0)
    near = table.near_keys(3)  # [L, span*R]
    assert near.shape == (2, table.span * 2)
    assert torch.equal(near.view(2, -1, 2), table.near(3)[:, :, None].expand(-1, -1, 2))
    assert near[0, :8].tolist() == [False] * 6 + [True] * 2  # lane 0 at step 5: position 3 in, 0-2 out


def test_queries_write_nothing() -> None:
    """Only the named updates change the table: every query leaves the back-pointers, steps and span as they were."""
    table = LaneTable(lanes=2, rows_per_input=2, max_len=6, device=CPU, own_steps=True)
    table.make_static()
    table.join([0, 1])
    table.advance()
    table.check(0)
    table.claim()
    tensors = (table.ptr.clone(), table.steps.clone(), table.position.clone())
    hosts = (table.span, list(table.lane_t))
    _ = [table.visible(table.span), table.visible_keys(), table.near(2), table.near_keys(2), table.span_t(7)]
    _ = [table.span_at(7), table.lane_rows(3), table.at_steps(table.lane_rows(3)), table.lane_count]
    assert all(map(torch.equal, tensors, (table.ptr, table.steps, table.position)))
    assert hosts == (table.span, table.lane_t)
    table.advance()
    table.claim()  # the update that writes the back-pointers: this step's position holds each row's own beam
    assert table.ptr[:, 2].tolist() == [0, 1, 0, 1] and torch.equal(table.ptr[:, :2], tensors[0][:, :2])


def test_a_batch_and_lanes_count_their_lanes_and_steps() -> None:
    batch = LaneTable(lanes=3, rows_per_input=2, max_len=5, device=CPU, own_steps=False)
    assert batch.lane_count == 3 and not batch.own_steps and batch.lane_t == [] and batch.span_t(4) == 4
    assert batch.lane_rows(2) is None and batch.at_steps(None) is None  # a batch writes through a view
    lanes = LaneTable(lanes=3, rows_per_input=2, max_len=5, device=CPU, own_steps=True)
    assert lanes.lane_count == 3 and lanes.own_steps and lanes.lane_t == [None] * 3 and lanes.span_t(4) == 0
    assert lanes.lane_rows(2).tolist() == [[0, 5], [10, 15], [20, 25]]  # [L, per_lane]: position 0's row


def test_reset_restarts_the_table_in_place() -> None:
    table = LaneTable(lanes=1, rows_per_input=2, max_len=4, device=CPU, own_steps=False)
    table.make_static()
    ptr = table.ptr
    for t in range(3):
        table.check(t)
        table.claim()
        table.advance()
        table.reorder(torch.tensor([1, 1]))
    assert table.ptr.any()
    table.reset()
    assert table.ptr is ptr and not ptr.any() and table.steps.tolist() == [0] and table.span == table.max_len
