"""The input in shards: ``--shard I/N``'s contiguous range (from the input's line count) and the cutter that
cuts the input into the shards ``--workers`` hands out.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline.formats import InputDigest
from seqgen_cli.pipeline.queues import put_unless
from seqgen_cli.pipeline.records import Record, is_regular

# -- --shard I/N ------------------------------------------------------------------------------------------


def _all_regular(paths: Sequence[str]) -> bool:
    return bool(paths) and all(p != "-" and is_regular(p) for p in paths)


def _scan(paths: Sequence[str], h: Any = None) -> int:
    """Lines in ``paths`` (as :func:`~.records.read_records` counts them: a last line without a newline
    counts); ``h``: a hash fed each file's length, then its bytes."""
    total = 0
    for path in paths:
        with open(path, "rb") as fh:
            if h is not None:
                h.update(f"{os.fstat(fh.fileno()).st_size}\n".encode())
            last = b"\n"
            while block := fh.read(1 << 20):
                if h is not None:
                    h.update(block)
                total += block.count(b"\n")
                last = block[-1:]
        total += last != b"\n"
    return total


def count_lines(paths: Sequence[str]) -> int | None:
    """Lines in ``paths`` when all are regular files (a fast byte scan), else ``None``."""
    return _scan(paths) if _all_regular(paths) else None


def scan_inputs(paths: Sequence[str]) -> tuple[int, str]:
    """Lines in the input files and a SHA-256 of their bytes, files in order and each prefixed with its
    length (so a job's parts can be told from another's: not the names, which may differ between machines)."""
    h = hashlib.sha256()
    return _scan(paths, h), h.hexdigest()


def shard_range(total: int, shard: int, shards: int) -> tuple[int, int]:
    """Inputs ``[lo, hi)`` of shard ``shard`` (0-based) of ``shards`` contiguous, near-equal shards."""
    return total * shard // shards, total * (shard + 1) // shards


def parse_shard(spec: str, environ: Mapping[str, str]) -> tuple[int, int]:
    """``--shard I/N`` (0-based I, as ``RANK``), or ``auto``: ``RANK``/``WORLD_SIZE`` from ``environ``."""
    if spec == "auto":
        rank, world = environ.get("RANK"), environ.get("WORLD_SIZE")
        if rank is None or world is None:
            raise SeqgenError("--shard auto needs the RANK and WORLD_SIZE environment variables")
        spec, where = f"{rank}/{world}", f"RANK={rank}, WORLD_SIZE={world}"
    else:
        where = f"--shard {spec}"
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SeqgenError(f"{where}: expected I/N, e.g. 0/4 (shard I of N, I from 0)") from None
    if n < 1 or not 0 <= i < n:
        raise SeqgenError(f"{where}: need 0 <= I < N (shards are numbered from 0, as RANK)")
    return i, n


@dataclass(frozen=True)
class ShardRange:
    """``--shard I/N`` over a given input: its inputs ``[lo, hi)`` of the input's ``lines``."""

    index: int  # I
    count: int  # N
    lines: int
    sha256: str  # of the input files (see scan_inputs)

    @property
    def select(self) -> tuple[int, int]:
        """``(lo, hi)``, for :func:`~.records.read_records`."""
        return shard_range(self.lines, self.index, self.count)

    @property
    def size(self) -> int:
        lo, hi = self.select
        return hi - lo

    def settings(self) -> dict[str, Any]:
        """What the shard's output depends on besides the generator's settings: the shard and the whole
        input's line count and SHA-256 (``--resume`` and ``seqgen merge`` check them: a changed input moves
        the shards' bounds)."""
        return {"shard": [self.index, self.count], "input": {"lines": self.lines, "sha256": self.sha256}}


def select_shard(paths: Sequence[str], shard: tuple[int, int]) -> ShardRange:
    """``--shard I/N`` of the input files ``paths`` (one pass over them)."""
    if not _all_regular(paths):
        raise SeqgenError(
            "--shard needs input files (each shard counts the lines to find its range), not stdin"
        )
    lines, sha256 = scan_inputs(paths)
    return ShardRange(*shard, lines, sha256)


# -- --workers: the shard cutter ----------------------------------------------------------------------------


@dataclass
class Shard:
    """A contiguous run of inputs, the unit a worker takes, retries and the driver merges."""

    seq: int  # position in the run's shard sequence
    start: int  # index of its first input among all inputs
    records: list[Record]  # indexed from 0 within the shard
    name: str  # of its part file: <start>-<count>-<digest of its inputs>.part
    before: InputDigest  # digest of every input before this shard
    after: str  # ... and through its last input
    attempts: int = 0

    def __lt__(self, other: Shard) -> bool:
        return self.seq < other.seq

    @property
    def span(self) -> str:
        return f"inputs {self.start + 1}-{self.start + len(self.records)}"


class Cutter:
    """A thread that reads records and cuts them into shards of ``size`` inputs, aligned on multiples of it
    (bounded queue of ``ahead`` shards: the driver's read-ahead). ``digest``: of the inputs before ``start``."""

    def __init__(self, records: Iterator[Record], start: int, size: int, digest: InputDigest, ahead: int):
        self._records, self._start, self._size, self._digest = records, start, size, digest
        self.queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self.finished = False  # every shard has been taken from the queue
        threading.Thread(target=self._loop, name="seqgen-shards", daemon=True).start()

    def _put(self, obj: object) -> bool:
        return put_unless(self.queue, obj, self._stop.is_set)

    def _loop(self) -> None:
        try:
            seq, start, group = 0, self._start, []
            end = (start // self._size + 1) * self._size  # shards aligned on multiples of the size
            for record in self._records:
                group.append(replace(record, index=record.index - start))
                if start + len(group) == end:
                    if not self._put(self._cut(seq, start, group)):
                        return
                    seq, start, group, end = seq + 1, end, [], end + self._size
            if group and not self._put(self._cut(seq, start, group)):
                return
            self._put(None)
        except BaseException as err:  # noqa: BLE001 - raised in the driver
            self._put(err)

    def _cut(self, seq: int, start: int, records: list[Record]) -> Shard:
        own = InputDigest()
        before = self._digest.copy()
        for record in records:
            data = own.encode(record)
            own.update_encoded(data)
            self._digest.update_encoded(data)
        name = f"{start:012d}-{len(records)}-{own.hexdigest()[:16]}.part"
        return Shard(seq, start, records, name, before, self._digest.hexdigest())

    def take(self) -> Shard | None:
        """The next shard if one is ready (None: not yet, or no more: see ``finished``)."""
        if self.finished:
            return None
        try:
            got = self.queue.get_nowait()
        except queue.Empty:
            return None
        if got is None:
            self.finished = True
            return None
        if isinstance(got, BaseException):
            self.finished = True
            raise got
        return got

    def stop(self) -> None:
        self._stop.set()
