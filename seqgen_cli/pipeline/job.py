"""One ``seqgen generate`` job: inputs and output files, resume, the run, stats and scoring."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seqgen_cli.errors import Aborted, SeqgenError, WriteError
from seqgen_cli.generator import Generator
from seqgen_cli.pipeline import resume
from seqgen_cli.pipeline.progress import Progress, count_lines
from seqgen_cli.pipeline.records import (
    Record,
    check_inputs,
    check_not_output,
    is_regular,
    read_records,
    scan_inputs,
    shard_range,
)
from seqgen_cli.pipeline.run import RunOptions, run
from seqgen_cli.pipeline.sinks import FileSink, Sink, is_stream, open_stream
from seqgen_cli.pipeline.stats import Summary


@dataclass
class JobOptions(RunOptions):
    input_format: str = "auto"
    input_field: str | None = None
    resume: bool = False
    progress: bool = False
    stats: str | None = None
    reference: str | None = None
    metrics: str | None = None
    shard: tuple[int, int] | None = None  # --shard I/N: only shard I (from 0) of N contiguous ones


def check_job(inputs: Sequence[str], output: str, opts: JobOptions) -> None:
    """Fail before the (slow) model load on what cannot work: missing files or folders, an output that
    cannot be written, clashing options."""
    if output == "-" and sys.stdout is None:
        raise SeqgenError("standard output is closed: give -o FILE")
    if is_stream(output):
        if opts.resume:
            where = "output written to stdout" if output == "-" else f"{output} is not a regular file, so it"
            raise SeqgenError(f"--resume needs -o FILE: {where} cannot be resumed")
    else:
        check_writable(output, "output")
    if opts.stats:
        check_writable(opts.stats, "--stats")
    if opts.metrics and not opts.reference:
        raise SeqgenError("--metrics needs --reference FILE")
    check_inputs(inputs)
    check_not_output(inputs, output)
    if opts.shard is not None and count_lines(list(inputs)) is None:
        raise SeqgenError(
            "--shard needs input files (each shard counts the lines to find its range), not stdin"
        )


def check_writable(path: str, what: str) -> None:
    """One line naming the folder or file when ``path`` cannot be written (as far as can be told now)."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise SeqgenError(f"{what} folder {parent} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SeqgenError(f"cannot write {path}: permission denied")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SeqgenError(f"cannot write into {parent}: permission denied")


def generate_job(gen: Generator, inputs: Sequence[str], output: str, opts: JobOptions) -> Summary:
    """Run the job; the summary says whether it was interrupted or failed (after writing what it could)."""
    paths = list(inputs) or ["-"]
    check_job(inputs, output, opts)
    select, total, extra = None, None, None
    if opts.shard is not None:
        select, extra = shard_settings(paths, opts.shard)
        total = select[1] - select[0]
    records = read_records(paths, opts.input_format, opts.input_field, opts.on_error, select=select)
    streaming = any(not is_regular(p) for p in paths)  # stdin or a named pipe: hand lines on at once
    progress = Progress(opts.progress, paths, total=total)
    summary = write_records(
        gen,
        records,
        output,
        opts,
        progress=progress,
        streaming=streaming,
        extra=extra,
        part=extra is not None,
    )
    if opts.stats:
        write_stats(opts.stats, summary)
    return summary


def write_records(
    gen: Generator,
    records: Iterator[Record],
    output: str,
    opts: JobOptions,
    *,
    progress: Progress,
    streaming: bool = False,
    extra: dict[str, Any] | None = None,
    part: bool = False,
) -> Summary:
    """Generate for ``records`` into ``output`` (a file, resumable, or ``-``): the pipeline of one job.

    Also the unit of work of a Ray worker (one shard into one part file). ``extra``: settings besides
    the generator's that the output depends on (``--resume`` checks them). ``part``: the output is a
    ``--shard`` part; a complete one gets its manifest for ``seqgen merge``.
    """
    digest = resume.InputDigest()
    start = 0
    journaled: dict[int, tuple[str, str]] = {}
    sink: Sink
    if is_stream(output):
        sink = open_stream(output)
    else:
        settings = {**resume.fingerprint(gen, opts), **(extra or {})}
        state = resume.load(output, settings) if opts.resume else resume.check_fresh(output)
        if state is not None:
            start = state.done
            records = resume.skip_done(records, state, digest)
            journaled = resume.load_journal(output, state.done)
            sink = FileSink(output, settings, done=state.done, offset=state.offset, part=part)
        else:
            sink = FileSink(output, settings, part=part)
    keep: list[str] | None = [] if opts.reference and is_stream(output) else None  # cannot be read back
    progress.start_at(start)
    with sigterm_as_interrupt():
        try:
            summary = run(
                gen, records, sink, opts, start=start, digest=digest, progress=progress, keep=keep,
                streaming=streaming, journaled=journaled,
            )  # fmt: skip
        except BrokenPipeError:  # the reader of stdout went away (e.g. `| head`): not an error
            raise
        except Exception as err:
            raise aborted(err, output, sink.kept()) from err
    if opts.reference and summary.error is None and not summary.interrupted:
        summary.metrics = score(output, keep, opts, gen.num_return_sequences)
    return summary


def shard_settings(paths: Sequence[str], shard: tuple[int, int]) -> tuple[tuple[int, int], dict[str, Any]]:
    """``--shard I/N``: this shard's inputs ``[lo, hi)``, and the settings its part depends on besides the
    generator's: the shard and the whole input's line count and SHA-256 (``--resume`` and ``seqgen merge``
    check them: a changed input moves the shards' bounds)."""
    lines, sha256 = scan_inputs(paths)
    return shard_range(lines, *shard), {"shard": list(shard), "input": {"lines": lines, "sha256": sha256}}


def write_stats(path: str, summary: Summary) -> None:
    """``--stats FILE``: the summary as JSON."""
    try:
        Path(path).write_text(json.dumps(summary.as_dict(), indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise WriteError.of(err, path) from err


def score(output: str, keep: list[str] | None, opts: JobOptions, n: int) -> dict:
    """Score the first of the ``n`` outputs of every input against ``--reference`` (``seqgen eval``)."""
    from seqgen_cli import metrics as m

    hyps = keep if keep is not None else _read_hypotheses(output, opts.output_format, opts.output_field, n)
    return m.score(hyps, m.read_lines(opts.reference), m.parse_metrics(opts.metrics))


def _read_hypotheses(output: str, output_format: str, output_field: str, n: int) -> list[str]:
    """The first output of every input, read back from the output file."""
    from seqgen_cli import metrics as m

    lines = m.read_lines(output)
    if output_format == "jsonl":
        outs = [json.loads(line)[output_field] for line in lines]
        return [o[0] if isinstance(o, list) else o for o in outs]
    return lines[::n]  # text: n consecutive lines per input


class sigterm_as_interrupt:
    """SIGTERM (a job scheduler's stop) is handled like Ctrl-C: write what is done, then exit 130."""

    def __enter__(self) -> None:
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def aborted(err: Exception, output: str, done: int) -> Aborted:
    """The one line for a run that stopped on something other than its input (a failed write, memory, a
    bug): what happened, where the outputs are, how to go on."""
    if isinstance(err, SeqgenError):
        what = str(err)
    elif isinstance(err, MemoryError):
        what = "out of memory"
    else:
        what = f"internal error: {type(err).__name__}: {err} (SEQGEN_DEBUG=1 shows the traceback)"
    if is_stream(output):
        where = "stdout" if output == "-" else output
        return Aborted(f"{what}; the outputs for the first {done} inputs were written to {where}")
    return Aborted(
        f"{what}; the outputs for the first {done} inputs are in {output}; "
        "rerun the same command with --resume to continue"
    )


def closing_message(summary: Summary, output: str) -> str | None:
    """What to tell the user after an interrupted or failed run (None after a complete one)."""
    where = "stdout" if output == "-" else output
    done = summary.resumed_from + summary.inputs
    if summary.interrupted:
        tail = (
            "rerun the same command with --resume to continue"
            if not is_stream(output)
            else f"writing to {where} cannot be resumed (use -o FILE and --resume)"
        )
        return f"seqgen: interrupted: the outputs for the first {done} inputs are in {where}; {tail}"
    if summary.error is not None:
        tail = "; fix it and rerun with --resume to continue" if not is_stream(output) else ""
        return f"{summary.error} (the outputs for the {done} inputs before it are in {where}{tail})"
    return None
