"""The ``--workers`` driver's shard account (``pipeline/ledger.py``), without Ray: results merged in shard order
whatever order they come in, retries first, the read-ahead bound, nothing handed out or merged past a failing
input."""

from __future__ import annotations

from typing import Any, cast

from seqgen_cli.pipeline.formats import InputDigest
from seqgen_cli.pipeline.ledger import ShardLedger
from seqgen_cli.pipeline.shards import Cutter, Shard
from seqgen_cli.pipeline.worker import ShardResult


class FakeCutter:
    """``count`` shards of ``size`` inputs (no records: the ledger does not read them), taken in order."""

    def __init__(self, count: int, size: int = 10) -> None:
        self.shards = [Shard(i, i * size, [], f"part-{i}", InputDigest(), f"after-{i}") for i in range(count)]
        self.finished = False

    def take(self) -> Shard | None:
        if not self.shards:
            self.finished = True
            return None
        return self.shards.pop(0)


def ledger(count: int, ahead: int = 100) -> ShardLedger:
    return ShardLedger(cast(Cutter, FakeCutter(count)), ahead)


def result(shard: Shard, done: int = 10, error: str | None = None) -> ShardResult:
    return ShardResult(shard.name, done=done, error=error)


def merge_all(book: ShardLedger) -> list[int]:
    merged: list[int] = []
    while (got := book.take_next()) is not None:
        merged.append(got[0].seq)
    return merged


def hand_out(book: ShardLedger, n: int) -> list[Shard]:
    shards = [book.next_shard() for _ in range(n)]
    assert all(s is not None for s in shards)
    return cast(list[Shard], shards)


def test_results_out_of_order_merge_in_shard_order() -> None:
    book = ledger(3)
    a, b, c = hand_out(book, 3)
    book.done(c, result(c))
    book.done(b, result(b, done=7))
    assert merge_all(book) == [] and book.waiting_inputs == 17  # the first shard's result is not in yet
    book.done(a, result(a))
    assert merge_all(book) == [0, 1, 2] and book.waiting_inputs == 0
    assert book.next_shard() is None and book.finished


def test_a_put_back_shard_goes_out_before_new_ones() -> None:
    book = ledger(4)
    a, b = hand_out(book, 2)
    book.put_back(b)
    book.put_back(a)
    assert [s.seq for s in hand_out(book, 3)] == [0, 1, 2]


def test_no_more_than_ahead_shards_are_cut_beyond_the_oldest_unmerged() -> None:
    book = ledger(5, ahead=2)
    a, b = hand_out(book, 2)
    assert book.next_shard() is None  # two cut, none merged
    book.done(b, result(b))
    assert book.next_shard() is None and merge_all(book) == []
    book.done(a, result(a))
    assert merge_all(book) == [0, 1]
    assert [s.seq for s in hand_out(book, 2)] == [2, 3]


def test_nothing_goes_out_or_merges_past_a_failing_input() -> None:
    book = ledger(6)
    s0, s1, s2, s3 = hand_out(book, 4)
    book.put_back(s1)  # its worker died: retried, before the failing shard
    book.done(s3, result(s3))  # came in before the failure was known: waits, never merged
    book.done(s2, result(s2, done=4, error="line 25: bad"))
    assert book.stop == 2
    book.done(s3, result(s3))  # past the failing shard: dropped
    retried = book.next_shard()
    assert retried is s1 and book.next_shard() is None  # the retry still goes; no new shard
    book.done(s0, result(s0))
    book.done(s1, result(s1))
    got: list[tuple[int, Any]] = []
    while (pair := book.take_next()) is not None:
        got.append((pair[0].seq, pair[1].error))
    assert got == [(0, None), (1, None), (2, "line 25: bad")]  # the failing shard's outputs before its input


def test_an_earlier_failure_moves_the_stop_back() -> None:
    book = ledger(4)
    _, s1, s2 = hand_out(book, 3)
    book.done(s2, result(s2, error="bad"))
    book.done(s1, result(s1, error="bad too"))
    assert book.stop == 1
