"""The generate loop: reader thread -> batcher -> model (this thread) -> writer thread.

The model runs in the calling thread (``Generator.generate_batches``, the one generate loop, with a resumed
run's journaled outputs and ``--on-error`` on top) while the reader tokenises ahead and the writer detokenises
and writes behind. A batch that runs out of memory is split in halves and retried, down to one input;
no input is ever dropped silently. Ctrl-C stops reading and writes what is done, in order.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from seqgen_cli import openmp
from seqgen_cli.batching import DEFAULT_BATCH_SIZE, Item, ItemBatch, Result
from seqgen_cli.errors import SeqgenError, WriteError
from seqgen_cli.generator import Generator
from seqgen_cli.pipeline.formats import InputDigest, input_key
from seqgen_cli.pipeline.progress import Progress
from seqgen_cli.pipeline.reader import ReaderStage
from seqgen_cli.pipeline.records import Record
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
    journaled: dict[int, tuple[str, str]] | None = None,
) -> Summary:
    """Generate for every record and write the outputs to ``sink`` in input order.

    Returns the summary; ``summary.interrupted`` after Ctrl-C, ``summary.error`` when an input failed
    with ``on_error="fail"`` (everything before it is written either way). ``streaming``: the input is a
    pipe, so lines are handed on as they arrive. ``journaled``: what a resumed run found in the journal,
    input index -> (input key, output): written, not generated again, where the input is unchanged.
    """
    t_start = time.perf_counter()
    summary = Summary(
        backend=gen.backend, resumed_from=start, output=sink.name, rss_at_start_mb=peak_rss_mb()
    )
    progress = progress or Progress(False)
    journaled = dict(journaled or {})
    reuse: dict[int, str] = {}  # journaled outputs checked against their input, for the writer to take
    reader = ReaderStage(iter(records), gen.encode, streaming=streaming).start()
    writer = OrderedWriter(
        sink, gen.decode, output_format=opts.output_format, output_field=opts.output_field,
        num_sequences=gen.num_return_sequences, start=start, digest=digest, keep=keep, journaled=reuse,
    ).start()  # fmt: skip

    def take_journaled(items: list[Item]) -> tuple[list[Item], list[Item]]:
        """Split ``items`` into those whose journaled output is for the same input (to reuse) and the rest
        (to generate: not journaled, or the input changed since)."""
        reused, todo = [], []
        for it in items:
            entry = journaled.pop(it.index, None)
            if entry is not None and entry[0] == input_key(it.record):
                reuse[it.index] = entry[1]
                reused.append(it)
            else:
                todo.append(it)
        return reused, todo

    def passthrough(items: list[Item]) -> None:
        take_journaled(items)
        for it in items:
            if it.record.error is not None:
                progress.warn(f"{it.record.error} (skipped: empty output)")
                summary.skipped += 1
        writer.put([Result(it, None, it.record.error) for it in items])
        progress.update(len(items), summary.generated_tokens / max(time.perf_counter() - t_start, 1e-9))

    early = isinstance(sink, StreamSink)  # stdout, a pipe: someone may read the first lines as they come
    batcher = gen.batcher(
        reader.chunks(), passthrough, opts.batch_size, opts.batch_tokens, opts.sort_window, early
    )
    fail: Result | None = None
    fail_window = -1

    def before_failure(batches: Iterable[ItemBatch]) -> Iterator[ItemBatch]:
        """``batches``; once an input failed (``on_error="fail"``), only its window's inputs before it."""
        for batch in batches:
            if fail is not None:
                if batch.window != fail_window:
                    return
                batch = ItemBatch([it for it in batch.items if it.index < fail.item.index], batch.window)
                if not batch.items:
                    continue
            yield batch

    finished = False  # the loop ended and every output reached the sink: no exception on the way
    try:
        try:
            for done in gen.generate_batches(before_failure(batcher), take_journaled):
                results = done.results
                summary.generate_seconds += done.seconds
                bad = [r for r in results if r.error is not None]
                if bad and opts.on_error == "fail":
                    first = min(bad, key=lambda r: r.item.index)
                    if fail is None or first.item.index < fail.item.index:
                        fail, fail_window = first, done.batch.window
                        batcher.stop()  # finish this window's inputs before the failure, read no further
                    results = [r for r in results if r.item.index < fail.item.index]
                for r in bad if opts.on_error == "skip" else ():
                    progress.warn(f"{r.error} (skipped: empty output)")
                    summary.skipped += 1
                summary.generated_tokens += sum(len(s) for r in results for s in r.sequences or ())
                results += [Result(it) for it in done.known if fail is None or it.index < fail.item.index]
                writer.put(results)
                elapsed = time.perf_counter() - t_start
                progress.update(len(done.batch.items), summary.generated_tokens / elapsed)
        except KeyboardInterrupt:
            summary.interrupted = True
        except WriteError:
            raise
        except SeqgenError as err:  # a bad input line (on_error="fail"): what came before it is written
            summary.error = str(err)
        finally:
            reader.stop()
            progress.close()
            writer.close()  # raises the writer's error (e.g. the disk is full)
        finished = True
    finally:
        # Anything but a finished run keeps index and journal (and cuts a torn tail): it can be resumed.
        sink.close(finished and not summary.interrupted and summary.error is None and fail is None)
    if fail is not None and summary.error is None:
        summary.error = fail.error
    summary.inputs = writer.next - start
    summary.journaled = writer.waiting if sink.journals else 0
    summary.truncated = reader.truncated
    summary.batches = batcher.batches
    summary.padding_ratio = batcher.padding_ratio
    summary.read_seconds = reader.read_seconds
    summary.tokenise_seconds = reader.tokenise_seconds
    summary.write_seconds = writer.seconds
    summary.seconds = time.perf_counter() - t_start
    summary.device = gen.device_stats()
    if (threads := openmp.governor_stats()) is not None:  # the thread count that followed the load
        summary.device["threads"] = threads
    return summary
