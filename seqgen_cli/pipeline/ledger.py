"""The shards of a ``--workers`` run between the cutter and the output: which goes out next, which results wait
for an earlier shard's, where a failing input stops the run.

Workers finish shards out of order, die and retry them, while the output takes them in input order: this keeps
that account apart from Ray (the driver, :mod:`~.driver`, talks to the workers), so the order rules read, and
test, on their own.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from seqgen_cli.pipeline.shards import Cutter, Shard

if TYPE_CHECKING:
    from seqgen_cli.pipeline.worker import ShardResult


class ShardLedger:
    """Shards cut and not merged yet: retries first, never more than ``ahead`` cut beyond the oldest unmerged
    one (bounds the driver's memory), none handed out past the shard with the first failing input."""

    def __init__(self, cutter: Cutter, ahead: int) -> None:
        self.cutter, self.ahead = cutter, ahead
        self.retry: list[Shard] = []  # a heap, by shard order
        self.cut: dict[int, Shard] = {}  # cut and not merged yet
        self.results: dict[int, ShardResult] = {}  # by shard order, not merged yet
        self.next_merge = 0  # the next shard to merge
        self.stop: int | None = None  # the shard with the first failing input

    @property
    def finished(self) -> bool:
        """Every shard cut and merged."""
        return self.cutter.finished and not self.cut

    @property
    def waiting_inputs(self) -> int:
        """Inputs done in shards whose results wait for an earlier one (for the progress bar)."""
        return sum(r.done for r in self.results.values())

    def next_shard(self) -> Shard | None:
        """The shard for an idle worker: a retry, else a newly cut one; None when none may go out now."""
        if self.retry and (self.stop is None or self.retry[0].seq < self.stop):
            return heapq.heappop(self.retry)
        if self.stop is not None or len(self.cut) >= self.ahead:
            return None
        shard = self.cutter.take()
        if shard is not None:
            self.cut[shard.seq] = shard
        return shard

    def done(self, shard: Shard, result: ShardResult) -> None:
        """A worker finished ``shard``: hold its result for merging in order (dropped past a failing input)."""
        if self.stop is not None and shard.seq > self.stop:
            return
        if result.error is not None:
            self.stop = shard.seq if self.stop is None else min(self.stop, shard.seq)
        self.results[shard.seq] = result

    def put_back(self, shard: Shard) -> None:
        """Its worker died: ``shard`` goes out again before any later one."""
        heapq.heappush(self.retry, shard)

    def take_next(self) -> tuple[Shard, ShardResult] | None:
        """The next shard in input order with its result, taken off the ledger; None until its result is in, and
        past the shard with the first failing input (the run ends there)."""
        seq = self.next_merge
        if seq not in self.results or (self.stop is not None and seq > self.stop):
            return None
        self.next_merge += 1
        return self.cut.pop(seq), self.results.pop(seq)
