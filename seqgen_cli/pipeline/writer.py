"""Writer stage: a background thread detokenises and writes outputs, strictly in input order.

Results arrive in any order (batches are sorted by length); a reassembly buffer writes each output as
soon as every earlier one is written, so a pipe shows results early and memory holds at most the
outputs of the batches in flight.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Sequence

from seqgen_cli.batching import Result
from seqgen_cli.pipeline.records import Record
from seqgen_cli.pipeline.resume import InputDigest
from seqgen_cli.pipeline.sinks import Sink

Decode = Callable[[Sequence[Sequence[int]]], list[str]]


def format_output(
    record: Record,
    outputs: list[str],
    output_format: str,
    output_field: str,
    error: str | None = None,
) -> str:
    """The output line(s) for one input, newline-terminated.

    Text: one line per returned sequence (``num_return_sequences`` consecutive lines, best first);
    newlines inside a generation become spaces so line alignment holds. JSONL: the input object
    (or ``{}`` for text input) with ``output_field`` set to the string, or to a list when more than one
    sequence is returned, and ``error`` set for an input that was skipped.
    """
    if output_format == "jsonl":
        obj = dict(record.fields) if record.fields is not None else {}
        obj[output_field] = outputs[0] if len(outputs) == 1 else outputs
        if error is not None:
            obj["error"] = error
        return json.dumps(obj, ensure_ascii=False) + "\n"
    return "".join(" ".join(o.splitlines()) + "\n" for o in outputs)


_CLOSE = object()


class OrderedWriter:
    """Background writer: :meth:`put` results in any order; they reach ``sink`` in input order."""

    def __init__(
        self,
        sink: Sink,
        decode: Decode,
        *,
        output_format: str = "text",
        output_field: str = "output",
        num_sequences: int = 1,
        start: int = 0,
        digest: InputDigest | None = None,
        keep: list[str] | None = None,
    ) -> None:
        self.sink = sink
        self._decode = decode
        self._format = output_format
        self._field = output_field
        self._n = num_sequences
        self.next = start  # index of the next input to write
        self.digest = digest or InputDigest()
        self.keep = keep  # when a list: the first output of every input is appended (for scoring)
        self._pending: dict[int, tuple[Record, list[str], str | None]] = {}
        self._q: queue.Queue = queue.Queue(maxsize=64)  # backpressure: a slow sink slows generation
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="seqgen-write", daemon=True)

    def start(self) -> OrderedWriter:
        self._thread.start()
        return self

    def put(self, results: list[Result]) -> None:
        while True:
            if self.error is not None:
                raise self.error
            try:
                self._q.put(results, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Write everything that can be written in order, commit, and stop the thread."""
        while self._thread.is_alive():
            try:
                self._q.put(_CLOSE, timeout=0.1)
                break
            except queue.Full:
                continue
        self._thread.join()
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        try:
            while True:
                try:
                    got = self._q.get(timeout=0.5)
                except queue.Empty:
                    self.sink.commit(self.digest.hexdigest())
                    continue
                if got is _CLOSE:
                    break
                t0 = time.perf_counter()
                self._take(got)
                if self._q.empty():
                    self.sink.commit(self.digest.hexdigest())
                self.seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            self.sink.commit(self.digest.hexdigest(), force=True)
            self.seconds += time.perf_counter() - t0
        except BaseException as err:  # noqa: BLE001 - e.g. BrokenPipeError: raised in the main thread
            self.error = err

    def _take(self, results: list[Result]) -> None:
        seqs = [s for r in results if r.sequences is not None for s in r.sequences]
        texts = iter(self._decode(seqs) if seqs else [])
        for r in results:
            outs = [next(texts) for _ in r.sequences] if r.sequences is not None else [""] * self._n
            self._pending[r.item.index] = (r.item.record, outs, r.error)
        while self.next in self._pending:
            record, outs, error = self._pending.pop(self.next)
            line = format_output(record, outs, self._format, self._field, error)
            self.sink.write(line.encode("utf-8", "surrogatepass"))
            self.digest.update(record)
            if self.keep is not None:
                self.keep.append(outs[0] if outs else "")
            self.next += 1
