"""Reader stage: two background threads read records and tokenise them ahead of the model.

Thread 1 pulls records from the input (files or stdin) into a bounded queue; thread 2 tokenises
whatever is ready, in chunks, into a second bounded queue. Memory is bounded by the two queue sizes,
never by the input's length. A reading error travels down the queue in its place, so everything
before the bad line is still generated and written.

Chunks of a regular file are cut by count only; a pipe's (``streaming``) also when nothing more has arrived
(``Chunk.starved``), so that a slow producer sees its outputs early. That cut depends on timing, so a pipe's
batches do; its outputs' bytes do not on the CPU (``batching``'s module docstring).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from seqgen_cli.batching import CHUNK_SIZE, Chunk, Encode, Item, tokenise
from seqgen_cli.pipeline.queues import put_unless
from seqgen_cli.pipeline.records import BadLine, Record

MAX_CHUNKS = 8  # chunks each queue holds: read and tokenised ahead of the model


class _End:
    pass


@dataclass
class _Failure:
    error: BaseException


class ReaderStage:
    """Reads and tokenises in the background; iterate :meth:`chunks` for the results, in order."""

    def __init__(
        self,
        records: Iterator[Record],
        encode: Encode,
        *,
        chunk_size: int = CHUNK_SIZE,
        streaming: bool = False,
        on_error: str = "fail",
    ) -> None:
        self._records = records
        self._encode = encode
        # an input the model cannot take ends the input there, as a bad line does
        self._stop_at_bad = on_error != "skip"
        self._chunk_size = chunk_size
        self._streaming = streaming  # hand on every record at once (a pipe: lines arrive slowly)
        self._raw: queue.Queue = queue.Queue(maxsize=MAX_CHUNKS * (chunk_size if streaming else 1))
        self._out: queue.Queue = queue.Queue(maxsize=MAX_CHUNKS)
        self._stop = threading.Event()
        self.read_seconds = 0.0
        self.tokenise_seconds = 0.0
        self.truncated = 0
        self._threads = [
            threading.Thread(target=self._read_loop, name="seqgen-read", daemon=True),
            threading.Thread(target=self._tokenise_loop, name="seqgen-tokenise", daemon=True),
        ]

    def start(self) -> ReaderStage:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop reading (the threads exit at their next queue operation)."""
        self._stop.set()

    def _put(self, q: queue.Queue, obj: object) -> bool:
        return put_unless(q, obj, self._stop.is_set)

    def _read_loop(self) -> None:
        group: list[Record] = []
        try:
            t0 = time.perf_counter()
            for record in self._records:
                group.append(record)
                if self._streaming or len(group) >= self._chunk_size:
                    self.read_seconds += time.perf_counter() - t0
                    if not self._put(self._raw, group):
                        return
                    group = []
                    t0 = time.perf_counter()
                if self._stop.is_set():
                    return
            self.read_seconds += time.perf_counter() - t0
            if group and not self._put(self._raw, group):
                return
            self._put(self._raw, _End())
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            if group:
                self._put(self._raw, group)
            self._put(self._raw, _Failure(err))

    def _tokenise_loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    got = self._raw.get(timeout=0.1)
                except queue.Empty:
                    continue
                records: list[Record] = []
                tail = None
                while True:
                    if isinstance(got, list):
                        records.extend(got)
                    else:
                        tail = got
                        break
                    if len(records) >= self._chunk_size:
                        break
                    try:
                        got = self._raw.get_nowait()
                    except queue.Empty:
                        break
                if records:  # starved: a pipe with nothing more yet (a file's batches never depend on timing)
                    starved = self._streaming and tail is None and self._raw.empty()
                    items = self._tokenise(records)
                    bad = next((it for it in items if it.error is not None), None)
                    bad = bad if self._stop_at_bad else None
                    if bad is not None:  # the inputs before it are generated and written, then the run stops
                        items = [it for it in items if it.index < bad.index]
                        tail = _Failure(BadLine(bad.error or ""))
                    self.truncated += sum(it.truncated for it in items)
                    if not self._put(self._out, Chunk(items, starved)):
                        return
                if tail is not None:
                    self._put(self._out, tail)
                    return
        except BaseException as err:  # noqa: BLE001
            self._put(self._out, _Failure(err))

    def _tokenise(self, records: list[Record]) -> list[Item]:
        t0 = time.perf_counter()
        items = tokenise(records, self._encode)  # a bad line's record has no text: nothing to generate
        self.tokenise_seconds += time.perf_counter() - t0
        return items

    def chunks(self) -> Iterator[Chunk]:
        """Tokenised chunks in input order; a reading error is raised after the chunks before it."""
        while True:
            try:
                got = self._out.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if isinstance(got, _End):
                return
            if isinstance(got, _Failure):
                raise got.error
            yield got
