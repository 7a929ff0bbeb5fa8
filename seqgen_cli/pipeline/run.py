"""The generate loop: reader thread -> batcher -> model (this thread) -> writer thread.

The model runs in the calling thread (``Generator.generate_batches``, the one generate loop, with a resumed
run's journaled outputs, :class:`~.resume.JournalReuse`, and ``--on-error`` on top) while the reader tokenises
ahead and the writer detokenises and writes behind. A batch that runs out of memory is split in halves and
retried, down to one input; no input is ever dropped silently. Ctrl-C stops reading and writes what is done, in
order.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from seqgen_cli import openmp
from seqgen_cli.batching import DEFAULT_BATCH_SIZE, Item, ItemBatch, Result
from seqgen_cli.errors import SeqgenError, WriteError
from seqgen_cli.generator import BatchResults, Generator
from seqgen_cli.pipeline.formats import InputDigest
from seqgen_cli.pipeline.progress import Progress
from seqgen_cli.pipeline.reader import ReaderStage
from seqgen_cli.pipeline.records import Record, output_fields
from seqgen_cli.pipeline.resume import JournalReuse
from seqgen_cli.pipeline.sinks import Sink, StreamSink
from seqgen_cli.pipeline.stats import Summary, peak_rss_mb
from seqgen_cli.pipeline.writer import OrderedWriter


@dataclass
class RunOptions:
    batch_size: int = DEFAULT_BATCH_SIZE
    batch_tokens: int | None = None
    sort_window: int | None = None  # inputs looked ahead and sorted; None: auto; 0 or 1: no sorting
    output_format: str = "text"
    output_field: str = "output"
    on_error: str = "fail"
    scores: bool = False  # --scores: each output's score and log_prob in its line (the generator gives them)
    structured: bool = False  # a grammar (--json-schema, ...): JSONL output says whether each output completed it
    logprobs: bool = False  # --logprobs: each output's tokens' raw log-probs and the best of each step (JSONL)

    def fields(self) -> tuple[str, ...]:
        """The fields the output adds to each input object (:func:`~.records.output_fields`)."""
        return output_fields(
            self.output_format, self.output_field, self.on_error, self.scores, self.structured, self.logprobs
        )


def run(
    gen: Generator,
    records: Iterable[Record],
    sink: Sink,
    opts: RunOptions,
    *,
    start: int = 0,
    digest: InputDigest | None = None,
    progress: Progress | None = None,
    keep: list[str] | None = None,
    streaming: bool = False,
    reuse: JournalReuse | None = None,
) -> Summary:
    """Generate for every record and write the outputs to ``sink`` in input order.

    Returns the summary; ``summary.interrupted`` after Ctrl-C, ``summary.error`` when an input failed
    with ``on_error="fail"`` (everything before it is written either way). ``streaming``: the input is a
    pipe, so lines are handed on as they arrive. ``reuse``: what a resumed run found in the journal, written,
    not generated again, where the input is unchanged.
    """
    stages = _Run(
        gen, records, sink, opts, start, digest, progress or Progress(False), keep, streaming, reuse
    )
    stages.loop()
    return stages.report()


def whole_match(item: Item, sequence: Sequence[int]) -> bool | None:
    """Whether an output is a whole match of its input's grammar (its JSONL schema's, or the run's); ``None``: the
    input has none."""
    return None if item.grammar is None else item.grammar.complete(sequence)


class _Run:
    """One run's stages (reader, batcher, this thread's generate loop, writer), its summary as it goes and the
    first input that failed (``on_error="fail"``)."""

    def __init__(
        self,
        gen: Generator,
        records: Iterable[Record],
        sink: Sink,
        opts: RunOptions,
        start: int,
        digest: InputDigest | None,
        progress: Progress,
        keep: list[str] | None,
        streaming: bool,
        reuse: JournalReuse | None,
    ) -> None:
        self.t_start = time.perf_counter()
        self.gen, self.sink, self.opts, self.start, self.progress = gen, sink, opts, start, progress
        self.summary = Summary(
            backend=gen.backend, resumed_from=start, output=sink.name, rss_at_start_mb=peak_rss_mb()
        )
        self.reuse = reuse if reuse is not None else JournalReuse()
        self.reader = ReaderStage(
            iter(records), gen.encode, streaming=streaming, on_error=opts.on_error
        ).start()
        self.writer = OrderedWriter(
            sink,
            gen.texts,
            output_format=opts.output_format,
            output_field=opts.output_field,
            num_sequences=gen.num_return_sequences,
            start=start,
            digest=digest,
            keep=keep,
            reuse=self.reuse,
            scores=opts.scores,
            complete=whole_match,
            logprobs=opts.logprobs,
        ).start()
        early = isinstance(sink, StreamSink)  # stdout, a pipe: someone may read the first lines as they come
        sizes = (opts.batch_size, opts.batch_tokens, opts.sort_window)
        self.batcher = gen.batcher(self.reader.chunks(), self.passthrough, *sizes, early)
        self.fail: Result | None = None  # the first input that failed (on_error="fail")
        self.fail_window = -1  # its window: the inputs before it there still run

    def loop(self) -> None:
        """The generate loop over the batches (:meth:`before_failure`), each taken by :meth:`take`; then the
        stages are stopped and the sink closed, complete or (anything but a finished run) resumable."""
        finished = False  # the loop ended and every output reached the sink: no exception on the way
        try:
            try:
                for done in self.gen.generate_batches(self.before_failure(self.batcher), self.reuse.take):
                    self.take(done)
            except KeyboardInterrupt:
                self.summary.interrupted = True
            except WriteError:
                raise
            except SeqgenError as err:  # a bad input line (on_error="fail"): what came before it is written
                self.summary.error = str(err)
            finally:
                self.reader.stop()
                self.progress.close()
                self.writer.close()  # raises the writer's error (e.g. the disk is full)
            finished = True
        finally:
            # Anything but a finished run keeps index and journal (and cuts a torn tail): it can be resumed.
            summary = self.summary
            self.sink.close(
                finished and not summary.interrupted and summary.error is None and self.fail is None
            )

    def passthrough(self, items: list[Item]) -> None:
        """The batcher's inputs that need no model (empty or bad lines, tokens the model cannot take): straight to
        the writer."""
        self.reuse.take(items)
        errors = [it.error or it.record.error for it in items]  # a bad line's, or its tokens' (tokenise)
        for error in errors:
            if error is not None:
                self.progress.warn(f"{error} (skipped: empty output)")
                self.summary.skipped += 1
        self.writer.put([Result(it, None, error) for it, error in zip(items, errors, strict=True)])
        self.progress.update(len(items), self.summary.generated_tokens / max(self._elapsed(), 1e-9))

    def before_failure(self, batches: Iterable[ItemBatch]) -> Iterator[ItemBatch]:
        """``batches``; once an input failed (``on_error="fail"``), only its window's inputs before it."""
        for batch in batches:
            if self.fail is not None:
                if batch.window != self.fail_window:
                    return
                batch = ItemBatch([it for it in batch.items if it.index < self.fail.item.index], batch.window)
                if not batch.items:
                    continue
            yield batch

    def take(self, done: BatchResults) -> None:
        """One batch's results (and the inputs the journal answered) to the writer; a failed input (``on_error``:
        fail) stops reading and drops what comes after it, a skipped one is warned about."""
        results, summary, on_error = done.results, self.summary, self.opts.on_error
        summary.generate_seconds += done.seconds
        bad = [r for r in results if r.error is not None]
        if bad and on_error == "fail":
            first = min(bad, key=lambda r: r.item.index)
            if self.fail is None or first.item.index < self.fail.item.index:
                self.fail, self.fail_window = first, done.batch.window
                self.batcher.stop()  # finish this window's inputs before the failure, read no further
            results = [r for r in results if r.item.index < self.fail.item.index]
        for r in bad if on_error == "skip" else ():
            self.progress.warn(f"{r.error} (skipped: empty output)")
            summary.skipped += 1
        summary.generated_tokens += sum(len(s) for r in results for s in r.sequences or ())
        if self.gen.default_length is not None:  # cut short by a limit nobody set: said at the end
            limit = self.gen.new_token_limits
            summary.at_default_length += sum(
                len(r.sequences[0]) >= limit(self.gen.width(len(r.item.ids or ())))[0] for r in results if r.sequences
            )
        fail = self.fail
        results += [Result(it) for it in done.known if fail is None or it.index < fail.item.index]
        self.writer.put(results)
        self.progress.update(len(done.batch.items), summary.generated_tokens / self._elapsed())

    def report(self) -> Summary:
        """The summary, with what each stage counted."""
        summary, writer, reader, batcher = self.summary, self.writer, self.reader, self.batcher
        if self.fail is not None and summary.error is None:
            summary.error = self.fail.error
        summary.inputs = writer.next - self.start
        summary.journaled = writer.waiting if self.sink.journals else 0
        summary.truncated = reader.truncated
        summary.batches = batcher.batches
        summary.padding_ratio = batcher.padding_ratio
        summary.read_seconds = reader.read_seconds
        summary.tokenise_seconds = reader.tokenise_seconds
        summary.write_seconds = writer.seconds
        summary.incomplete = writer.incomplete
        summary.seconds = self._elapsed()
        summary.device = self.gen.device_stats()
        if (threads := openmp.governor_stats()) is not None:  # the thread count that followed the load
            summary.device["threads"] = threads
        return summary

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t_start
