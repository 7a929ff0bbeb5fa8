"""The ``--workers`` worker: a Ray actor that loads the model once, then runs shards through the ordinary
pipeline (:func:`~.job.write_records`), each into a part file ``OUTPUT.seqgen-parts/<start>-<count>-<digest>.part``
with its own index and journal, so a retried shard resumes its part. It returns the part's bytes; the driver
(:mod:`~.driver`) appends them to the output.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import Generator, GeneratorSpec
from seqgen_cli.pipeline.cluster import node_id
from seqgen_cli.pipeline.formats import DRIVER_MARK, LOCK_SUFFIX, index_path, read_index, remove_part
from seqgen_cli.pipeline.job import JobOptions, write_records
from seqgen_cli.pipeline.progress import CountingProgress
from seqgen_cli.pipeline.records import Record
from seqgen_cli.pipeline.resume import fingerprint


@dataclass
class ShardTask:
    """What the driver ships to a worker: one shard's inputs, indexed from 0 within the shard."""

    name: str  # the part file's name, in the parts folder
    records: list[Record]


@dataclass
class ShardResult:
    name: str
    data: bytes = b""  # the part's outputs: all of them, or those before the failing input
    done: int = 0  # inputs whose outputs are in ``data``
    error: str | None = None  # a bad input (--on-error fail); ``data`` stops before it
    fatal: str | None = None  # the shard cannot run (e.g. its part holds another run's settings)
    warnings: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # the worker's Summary for this shard
    pid: int = 0


class ShardWorker:
    """Loads the model once, then runs shards through the ordinary pipeline (wrapped by ``ray.remote``)."""

    def __init__(
        self, generator: GeneratorSpec, opts: JobOptions, parts: str, driver_node: str, threads: int | None
    ) -> None:
        self.pid = os.getpid()
        self.parts = Path(parts)
        self.opts = replace(opts, resume=True, progress=False, stats=None, reference=None, metrics=None)
        self.node = node_id()
        self.driver_node = driver_node
        self._progress = CountingProgress()
        self.gen: Generator | None = None
        self.error: str | None = None
        try:
            import torch

            if threads:
                torch.set_num_threads(threads)
            self.gen = generator.build()
        except SeqgenError as err:
            self.error = str(err)
        except Exception as err:  # noqa: BLE001 - e.g. a torn checkpoint: told to the driver, not retried
            self.error = f"{type(err).__name__}: {err}"

    def hello(self) -> dict[str, Any]:
        """Who this worker is and the settings it resolved (or why it could not load the model)."""
        info: dict[str, Any] = {"pid": self.pid, "node": self.node, "error": self.error}
        if self.gen is not None:
            info.update(
                settings=fingerprint(self.gen, self.opts),
                backend=self.gen.backend,
                max_source_length=self.gen.max_source_length,
                num_return_sequences=self.gen.num_return_sequences,
            )
        return info

    def progress(self) -> int:
        """Inputs done in the current shard (called concurrently with :meth:`run_shard`)."""
        return self._progress.done

    def run_shard(self, task: ShardTask) -> ShardResult:
        self.parts.mkdir(parents=True, exist_ok=True)
        part = self.parts / task.name
        self._progress = CountingProgress()
        result = ShardResult(task.name, pid=self.pid)
        lock = open(f"{part}{LOCK_SUFFIX}", "w")  # noqa: SIM115 - held until the part is written
        try:
            # An attempt the driver gave up on may still run (a node cut off, not dead): wait for it.
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if part.exists() and part.stat().st_size and not index_path(part).exists():
                result.data, result.done = part.read_bytes(), len(task.records)  # done before a driver loss
            else:
                self._write_part(task, part, result)
        except SeqgenError as err:
            result.fatal = str(err)
        finally:
            lock.close()
        if result.fatal is None and not self._shares_parts():  # the driver cannot delete it: it has the bytes
            remove_part(part)
        return result

    def _write_part(self, task: ShardTask, part: Path, result: ShardResult) -> None:
        """Generate the shard into ``part`` (resuming it) and put what it holds into ``result``."""
        if self.gen is None:
            raise SeqgenError(f"the worker could not load the model: {self.error}")
        progress = self._progress
        records = _raise_bad(task.records, self.opts.on_error)
        settings = fingerprint(self.gen, self.opts)
        summary = write_records(self.gen, records, str(part), self.opts, progress=progress, settings=settings)
        if summary.interrupted:
            raise SeqgenError(f"{task.name}: interrupted")
        done, size = len(task.records), part.stat().st_size
        if summary.error is not None:  # the part stops before the failing input: its index says where
            result.error = summary.error
            last = read_index(part)[1]
            done, size = last.done, last.offset
        with open(part, "rb") as fh:
            result.data = fh.read(size)
        result.done = done
        result.summary = summary.as_dict()
        result.warnings = progress.messages

    def _shares_parts(self) -> bool:
        """Whether the driver sees this parts folder (same machine, or a shared filesystem)."""
        try:
            return (self.parts / DRIVER_MARK).read_text(encoding="utf-8") == self.driver_node
        except OSError:
            return False


def _raise_bad(records: list[Record], on_error: str) -> Iterator[Record]:
    """The records; a bad line (read as an error record) raises here, in order, unless skipped."""
    for record in records:
        if record.error is not None and on_error != "skip":
            raise SeqgenError(record.error)
        yield record
