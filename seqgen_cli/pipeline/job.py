"""One ``seqgen generate`` job: inputs and output files, resume, the run, stats and scoring."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from seqgen_cli.config import GENERATION_KEYS
from seqgen_cli.errors import Aborted, SeqgenError, WriteError
from seqgen_cli.generator import Generator
from seqgen_cli.pipeline import paths, resume
from seqgen_cli.pipeline.formats import (
    IndexEntry,
    InputDigest,
    index_path,
    journal_path,
    load_journal,
    manifest_path,
    parts_dir,
    remove_parts,
)
from seqgen_cli.pipeline.progress import Progress
from seqgen_cli.pipeline.records import (
    Record,
    check_inputs,
    is_regular,
    output_fields,
    read_records,
)
from seqgen_cli.pipeline.run import RunOptions, run
from seqgen_cli.pipeline.shards import ShardRange, count_lines, select_shard
from seqgen_cli.pipeline.sinks import FileSink, Sink, check_not_busy, is_stream, open_stream
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
    verify: int | None = (
        None  # --verify N: inputs checked against generate() first; None: the device's default
    )
    verify_strict: bool = False  # stop before writing when they differ beyond near-ties


@dataclass(frozen=True)
class Job:
    """A job :func:`check_job` found possible: what to read, where to write, how; ``shard``: ``--shard I/N``'s
    range, resolved (the input counted and hashed once)."""

    paths: list[str]  # the input files; ["-"]: stdin
    output: str
    opts: JobOptions
    shard: ShardRange | None = None

    @property
    def select(self) -> tuple[int, int] | None:
        """The inputs ``[lo, hi)`` this job reads (``--shard``), or None: all of them."""
        return self.shard.select if self.shard is not None else None

    def settings(self, gen: Generator) -> dict[str, Any]:
        """What the output's bytes depend on (``--resume`` checks it): ``gen``'s settings and the shard's."""
        return {**fingerprint(gen, self.opts), **(self.shard.settings() if self.shard is not None else {})}


def check_job(inputs: Sequence[str], output: str, opts: JobOptions) -> Job:
    """Fail before the (slow) model load on what cannot work: missing files or folders, an output that
    cannot be written or that another run is writing, clashing options, an input file whose first line holds a
    field the output would overwrite (:func:`~.records.check_inputs`); the job, checked (with ``--shard``,
    its range)."""
    if output == "-" and sys.stdout is None:
        raise SeqgenError("standard output is closed: give -o FILE")
    if is_stream(output):
        if opts.resume:
            where = "output written to stdout" if output == "-" else f"{output} is not a regular file, so it"
            raise SeqgenError(f"--resume needs -o FILE: {where} cannot be resumed")
    else:
        check_writable(output, "output")
        check_not_busy(output)
    if opts.stats and opts.stats != "-":
        check_writable(opts.stats, "--stats")
    if opts.metrics and not opts.reference:
        raise SeqgenError("--metrics needs --reference FILE")
    reserved = output_fields(opts.output_format, opts.output_field, opts.on_error)
    check_inputs(inputs, opts.input_format, opts.input_field, reserved)
    paths.check_distinct(job_paths(inputs, output, opts))
    shard = select_shard(list(inputs), opts.shard) if opts.shard is not None else None
    if opts.reference:
        check_reference(inputs, opts.reference, shard)
    return Job(list(inputs) or ["-"], output, opts, shard)


def check_reference(inputs: Sequence[str], reference: str, shard: ShardRange | None) -> None:
    """``--reference`` has one line per input (per input of the shard, with ``--shard``; one per input too with
    ``--num-return-sequences``): checked now, when the input files and the reference are regular files, rather
    than found by the scoring after generating. Streams (stdin, pipes) are not read here."""
    refs = count_lines([reference])
    if refs is None:
        return
    if shard is not None:
        wanted, what = shard.size, f"shard {shard.index}/{shard.count} of the input has"
    else:
        counted = count_lines(list(inputs))
        if counted is None:
            return
        wanted, what = counted, "the input has"
    if refs != wanted:
        raise SeqgenError(
            f"--reference {reference} has {refs} {'line' if refs == 1 else 'lines'} but {what} "
            f"{wanted} {'input' if wanted == 1 else 'inputs'}: give one reference line per input"
        )


def job_paths(inputs: Sequence[str], output: str, opts: JobOptions) -> list[paths.Role]:
    """Every file the job reads or writes, with its role (for :func:`~.paths.check_distinct`)."""
    roles = [paths.read("input", p) for p in inputs or ["-"]]
    roles.append(paths.written("-o", output))
    if not is_stream(output):
        roles += [paths.written("the index", str(index_path(output))),
                  paths.written("the journal", str(journal_path(output)))]  # fmt: skip
        if opts.shard is not None:
            roles.append(paths.written("the part manifest", str(manifest_path(output))))
    if opts.stats:
        roles.append(paths.written("--stats", opts.stats))
    if opts.reference:
        roles.append(paths.read("--reference", opts.reference))
    return roles


def check_writable(path: str, what: str) -> None:
    """One line naming the folder or file when ``path`` cannot be written (as far as can be told now)."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise SeqgenError(f"{what} folder {parent} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SeqgenError(f"cannot write {path}: permission denied")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SeqgenError(f"cannot write into {parent}: permission denied")


def generate_job(gen: Generator, job: Job) -> Summary:
    """Run the job; the summary says whether it was interrupted or failed (after writing what it could)."""
    opts = job.opts
    reserved = output_fields(opts.output_format, opts.output_field, opts.on_error)
    records = read_records(
        job.paths, opts.input_format, opts.input_field, opts.on_error, select=job.select, reserved=reserved
    )
    records, agreement = self_check(gen, records, opts)
    streaming = any(not is_regular(p) for p in job.paths)  # stdin or a named pipe: hand lines on at once
    progress = Progress(opts.progress, job.paths, total=job.shard.size if job.shard is not None else None)
    with progress.notes():  # a shape compiling pauses the bar: the engine says so above it
        summary = write_records(
            gen, records, job.output, opts, progress=progress, streaming=streaming, settings=job.settings(gen),
            part=job.shard is not None,
        )  # fmt: skip
    summary.verify = agreement
    if opts.stats:
        write_stats(opts.stats, summary)
    return summary


def self_check(
    gen: Generator, records: Iterator[Record], opts: JobOptions
) -> tuple[Iterator[Record], dict[str, Any] | None]:
    """``--verify N``: the first N inputs through seqgen and through ``generate()`` (``seqgen_cli.verify``);
    returns the records, those read ahead put back, and the report for ``--stats`` (``None``: not checked).
    ``--verify strict`` raises when they differ beyond near-ties, before anything is written."""
    from seqgen_cli.verify import default_inputs, verify

    n = default_inputs(gen.loaded.device) if opts.verify is None else opts.verify
    if n <= 0:
        return records, None
    head: list[Record] = []
    try:
        for record in records:
            head.append(record)
            if len(head) == n:
                break
    except Exception as err:  # noqa: BLE001 - a bad line: check what came before it; the run raises there
        records = _replayed(head, err)
    else:
        records = itertools.chain(head, records)
    usable = [r for r in head if r.error is None and r.text.strip()]
    t0 = time.perf_counter()
    ids = [e.ids for e in gen.encode([r.text for r in usable])] if usable else []
    agreement = verify(gen, ids, names=[r.where for r in usable])
    if opts.verify_strict and agreement.mismatches:
        where = ", ".join(agreement.differing[:3]) + (", ..." if len(agreement.differing) > 3 else "")
        raise SeqgenError(
            f"--verify strict: seqgen and generate() differ beyond near-ties on {len(agreement.differing)} of "
            f"{len(usable)} inputs ({where}); nothing written"
        )
    return records, {**agreement.as_dict(), "line": agreement.line(), "seconds": time.perf_counter() - t0}


def _replayed(head: list[Record], err: Exception) -> Iterator[Record]:
    yield from head
    raise err


def write_records(
    gen: Generator,
    records: Iterator[Record],
    output: str,
    opts: JobOptions,
    *,
    progress: Progress,
    settings: dict[str, Any],
    streaming: bool = False,
    part: bool = False,
) -> Summary:
    """Generate for ``records`` into ``output`` (a file, resumable, or ``-``): the pipeline of one job.

    Also the unit of work of a Ray worker (one shard into one part file). ``settings``: what the output
    depends on (``--resume`` checks them; see :meth:`Job.settings`). ``part``: the output is a ``--shard``
    part; a complete one gets its manifest for ``seqgen merge``.
    """
    digest = InputDigest()
    start = 0
    journaled: dict[int, tuple[str, str]] = {}
    sink, state = open_sink(output, settings, opts, part=part)
    try:
        if state is not None:
            start = state.done
            records = resume.skip_done(records, state, digest)  # raises where the inputs done differ
            journaled, discarded = load_journal(output, state.done)  # entries whose digest holds
            if discarded:
                progress.warn(discarded)
    except BaseException:
        sink.close(complete=False)  # index and journal stay; the file (and its lock) is let go
        raise
    keep: list[str] | None = [] if opts.reference and is_stream(output) else None  # cannot be read back
    progress.start_at(start)
    with guarded(output, sink):
        summary = run(
            gen, records, sink, opts, start=start, digest=digest, progress=progress, keep=keep,
            streaming=streaming, journaled=journaled,
        )  # fmt: skip
    complete = summary.error is None and not summary.interrupted
    if complete and not is_stream(output) and not remove_parts(output):  # a --workers run's, finished here
        progress.warn(
            f"{parts_dir(output)} kept: it holds files seqgen did not write (or a part still locked)"
        )
    if opts.reference and complete:
        summary.metrics = score(output, keep, opts, gen.num_return_sequences)
    return summary


def open_sink(
    output: str, settings: dict[str, Any], opts: JobOptions, *, part: bool, stdout: BinaryIO | None = None
) -> tuple[Sink, IndexEntry | None]:
    """Where a job's outputs go: a stream (``-``: ``stdout``), or ``-o FILE`` fresh (refused over an interrupted
    run) or resumed (``--resume``: checked against ``settings``, the inputs and the bytes written; the last index
    entry comes back). ``part``: a ``--shard`` part."""
    if is_stream(output):
        return open_stream(output, stdout), None
    state = resume.load(output, settings) if opts.resume else resume.check_fresh(output)
    return FileSink(output, settings, resumed=state, part=part), state


@contextmanager
def guarded(output: str, sink: Sink) -> Iterator[None]:
    """Around a job's run (one process or the Ray driver): SIGTERM is Ctrl-C; anything but a closed stdout
    (``| head``: not an error) becomes the one line of :func:`aborted` (what happened, what is kept, how to go
    on)."""
    with sigterm_as_interrupt():
        try:
            yield
        except BrokenPipeError:
            raise
        except Exception as err:
            raise aborted(err, output, sink.kept()) from err


# Where each option of `seqgen generate` that changes the outputs shows in the fingerprint (the flags of
# cli.GENERATION_OPTIONS and --preset reach it through the resolved generation config; --shard through
# ShardRange.settings). Every other option is in OUTPUT_NEUTRAL; tests/test_nothing_lost.py holds the two
# to the command's options.
FINGERPRINTED = {
    "model": "model",
    "preset": "generation",
    "backend": "backend",
    "device": "device",
    "dtype": "dtype",
    "prefix": "prefix",
    "max_source_length": "max_source_length",
    "seed": "seed",
    "input_format": "input_format",
    "input_field": "input_field",
    "output_format": "output_format",
    "output_field": "output_field",
    "on_error": "on_error",
    "shard_spec": "shard",
    "target_lang": "generation",  # resolved into forced_bos_token_id
    **dict.fromkeys(GENERATION_KEYS, "generation"),
}
# How a run goes, not what it writes: batching and look-ahead, CUDA graphs and refill (the same outputs; on a
# GPU they may change rounding as batch composition does), where files and reports go, Ray's resources, checks.
OUTPUT_NEUTRAL = frozenset(
    {
        "inputs", "output", "batch_size", "batch_tokens", "sort_window", "capture", "refill", "resume",
        "stats_path", "reference", "metrics", "workers", "address", "gpus_per_worker", "cpus_per_worker",
        "shard_size", "verify_spec", "quiet",
    }
)  # fmt: skip


def fingerprint(gen: Generator, opts: JobOptions) -> dict[str, Any]:
    """What decides the output bytes, in a JSON-comparable form: the resolved settings (checkpoint, preset and
    flags merged), the model's identity, device kind, dtype and backend (``--resume``, the journal and
    ``seqgen merge`` compare it; :data:`FINGERPRINTED`)."""
    generation = {
        k: v
        for k, v in json.loads(gen.config.to_json_string(use_diff=False)).items()
        if not k.startswith("_") and k != "transformers_version"
    }
    loaded = gen.loaded
    settings = dict(
        model=model_identity(gen.model),
        backend=gen.backend,
        device=loaded.device.type,
        dtype=loaded.dtype_name,
        generation=generation,
        prefix=gen.prefix,
        max_source_length=gen.max_source_length,
        seed=gen.seed,
        input_format=opts.input_format,
        input_field=opts.input_field,
        output_format=opts.output_format,
        output_field=opts.output_field,
        on_error=opts.on_error,
    )
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def model_identity(model: Any) -> dict[str, Any]:
    """The checkpoint by content: the SHA-256 of each file of its folder that decides the outputs (weights,
    config, generation config, tokenizer files; :mod:`seqgen_cli.digests`, cached per file), so that a checkpoint
    saved anew, even at the same sizes, is another model and a moved or copied one the same. A model without a
    folder (built in memory) is its name."""
    from seqgen_cli.digests import checkpoint_folder, folder_digests

    name = str(getattr(model.config, "_name_or_path", ""))
    folder = checkpoint_folder(name) if name else None
    if folder is None:
        return {"name": name}
    return {"files": folder_digests(folder)}


def write_stats(path: str, summary: Summary) -> None:
    """``--stats FILE``: the summary as JSON (``-``: standard output)."""
    text = json.dumps(summary.as_dict(), indent=2) + "\n"
    try:
        if path == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            Path(path).write_text(text, encoding="utf-8")
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
    """What to tell the user after an interrupted or failed run (None after a complete one): what is kept
    (written, and journaled for ``--resume``) and a next step that works."""
    where = "stdout" if output == "-" else output
    done = summary.resumed_from + summary.inputs
    stream = is_stream(output)
    kept = f"the outputs for the first {done} inputs are in {where}"
    if summary.journaled:
        kept += f" and {summary.journaled} later ones are kept in {journal_path(output).name}"
    nothing = done == 0 and not summary.journaled
    if summary.interrupted:
        if nothing:
            return "seqgen: interrupted before any output was finished; nothing was written"
        if stream:
            return f"seqgen: interrupted: {kept}; writing to {where} cannot be resumed (use -o FILE and --resume)"
        return f"seqgen: interrupted: {kept}; rerun the same command with --resume to generate only the rest"
    if summary.error is not None:
        if nothing:
            return f"{summary.error} (nothing was written; fix it and rerun)"
        if stream:
            return f"{summary.error} ({kept})"
        return (
            f"{summary.error} ({kept}; fix the input and rerun with --resume to continue, or, to change "
            f"settings, delete {where} and {index_path(output).name} and rerun)"
        )
    return None
