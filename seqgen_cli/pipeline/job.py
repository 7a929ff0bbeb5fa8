"""One ``seqgen generate`` job: its options, checked (:mod:`~.paths`), then its run into the output (fresh or
resumed, :mod:`~.resume`), its stats and scoring. What it tells the user at the end: :mod:`~.messages`."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

from seqgen_cli.errors import SeqgenError, WriteError
from seqgen_cli.generator import Generator, GeneratorSpec
from seqgen_cli.grammars import GrammarSpec, grammar_spec
from seqgen_cli.pipeline import paths, resume
from seqgen_cli.pipeline.formats import IndexEntry, InputDigest, load_journal, parts_dir, remove_parts
from seqgen_cli.pipeline.messages import aborted
from seqgen_cli.pipeline.process import sigterm_as_interrupt
from seqgen_cli.pipeline.progress import Progress, bar_wanted
from seqgen_cli.pipeline.records import Record, check_inputs, is_regular, read_records
from seqgen_cli.pipeline.run import RunOptions, run
from seqgen_cli.pipeline.shards import ShardRange, parse_shard, select_shard
from seqgen_cli.pipeline.sinks import FileSink, Sink, is_stream, open_stream
from seqgen_cli.pipeline.stats import Summary
from seqgen_cli.prompts import PromptSettings, read_template_option, read_text_option
from seqgen_cli.rules import GENERATION_KEYS
from seqgen_cli.whole import write_whole


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
    chat: bool = False  # --chat: a JSONL object's "messages" is a conversation (records.read_records)


def job_options(
    flags: Mapping[str, Any], output: str, *, shard_spec: str | None, verify: int | None, verify_strict: bool
) -> JobOptions:
    """``seqgen generate``'s flags as a job's options: ``--shard I/N`` parsed (``auto``: from ``RANK`` and
    ``WORLD_SIZE``), a progress bar unless ``--quiet`` or the outputs go to the terminal that would show it."""
    return JobOptions(
        batch_size=flags["batch_size"],
        batch_tokens=flags["batch_tokens"],
        sort_window=flags["sort_window"],
        output_format=flags["output_format"],
        output_field=flags["output_field"],
        on_error=flags["on_error"],
        scores=bool(flags.get("scores")) or flags.get("logprobs") is not None,  # --logprobs: the scores too
        structured=grammar_flags(flags) is not None,
        logprobs=flags.get("logprobs") is not None,
        input_format=flags["input_format"],
        input_field=flags["input_field"],
        resume=flags["resume"],
        progress=not flags["quiet"] and bar_wanted(output),  # not over outputs written to the same terminal
        stats=flags["stats_path"],
        reference=flags["reference"],
        metrics=flags["metrics"],
        shard=parse_shard(shard_spec, os.environ) if shard_spec is not None else None,
        verify=verify,
        verify_strict=verify_strict,
        chat=prompt_settings(flags).chat,
    )


def prompt_settings(flags: Mapping[str, Any]) -> PromptSettings:
    """``seqgen generate``'s prompt flags (``@FILE`` values read; ``--chat-template`` a file or the text)."""
    kwargs = flags.get("chat_template_kwargs")
    try:
        kwargs = json.loads(kwargs) if kwargs is not None else {}
    except ValueError as err:
        raise SeqgenError(f"--chat-template-kwargs: not JSON: {err}") from None
    if not isinstance(kwargs, dict):
        raise SeqgenError('--chat-template-kwargs takes a JSON object, e.g. \'{"enable_thinking": false}\'')
    return PromptSettings(
        prefix=flags.get("prefix"),
        template=read_text_option(flags.get("prompt_template"), "--prompt-template"),
        chat=bool(flags.get("chat")),
        system_prompt=read_text_option(flags.get("system_prompt"), "--system-prompt"),
        chat_template=read_template_option(flags.get("chat_template")),
        chat_template_kwargs=kwargs,
    )


def generator_spec(model: str, flags: Mapping[str, Any]) -> GeneratorSpec:
    """``seqgen generate``'s flags that build the model (with ``--refill``, ``--batch-size`` is the lanes and
    ``--batch-tokens`` their token budget)."""
    return GeneratorSpec(
        model=model,
        backend=flags["backend"],
        device=flags["device"],
        dtype=flags["dtype"],
        capture=flags["capture"],
        refill=flags["refill"],
        lanes=flags["batch_size"],
        lane_tokens=flags["batch_tokens"],
        preset=flags["preset"],
        prompt=prompt_settings(flags),
        max_source_length=flags["max_source_length"],
        seed=flags["seed"],
        target_lang=flags["target_lang"],
        stop=tuple(flags.get("stop") or ()),
        keep_stop=bool(flags.get("keep_stop")),
        reasoning=reasoning_flag(flags),
        scores=bool(flags.get("scores")),
        grammar=grammar_flags(flags),
        generation={k: flags[k] for k in GENERATION_KEYS if k in flags},
    )


def reasoning_flag(flags: Mapping[str, Any]) -> str:
    """``--reasoning`` (``outputs.py``); ``field`` writes a JSONL field, so it needs JSONL output."""
    reasoning = flags.get("reasoning") or "keep"
    if reasoning == "field" and flags.get("output_format") != "jsonl":
        raise SeqgenError("--reasoning field writes each output's reasoning in a JSONL field: add --output-format jsonl")
    return reasoning


def grammar_flags(flags: Mapping[str, Any]) -> GrammarSpec | None:
    """The structured-output flags' grammar (``--json-schema``, ``--regex``, ``--grammar``, ``--choice``), checked."""
    return grammar_spec(flags.get("json_schema"), flags.get("regex"), flags.get("grammar"), flags.get("choice") or ())


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
        shard = self.shard.settings() if self.shard is not None else {}
        return {**resume.fingerprint(gen, self.opts), **shard}


def check_job(inputs: Sequence[str], output: str, opts: JobOptions, model: str | None = None) -> Job:
    """Fail before the (slow) model load on what cannot work: missing files or folders, an output that
    cannot be written or that another run is writing, clashing options, an input file whose first line holds a
    field the output would overwrite (:func:`~.records.check_inputs`); the job, checked (with ``--shard``,
    its range). ``model``: the checkpoint, refused first where it needs its own code (``paths.model_files``)."""
    model_files = paths.model_files(model)
    paths.check_output(output, opts.resume)
    if opts.stats and opts.stats != "-":
        paths.check_writable(opts.stats, "--stats")
    if opts.metrics and not opts.reference:
        raise SeqgenError("--metrics needs --reference FILE")
    reserved = opts.fields()
    check_inputs(inputs, opts.input_format, opts.input_field, reserved, on_error=opts.on_error, chat=opts.chat)
    part = opts.shard is not None
    paths.check_distinct(
        paths.job_roles(inputs, output, stats=opts.stats, reference=opts.reference, part=part, model=model_files)
    )
    shard = select_shard(list(inputs), opts.shard) if opts.shard is not None else None
    if opts.reference:
        paths.check_reference(inputs, opts.reference, shard)
    return Job(list(inputs) or ["-"], output, opts, shard)


def first_prompt(gen: Generator, job: Job) -> str:
    """``--show-prompt``: the first input's prompt as the model gets it (its tokens decoded, special tokens kept)
    and a last line with its token count; a bad first input is its one-line error."""
    opts = job.opts
    records = read_records(job.paths, opts.input_format, opts.input_field, "fail", select=job.select, chat=opts.chat)
    record = next((r for r in records if r.text.strip()), None)
    if record is None:
        raise SeqgenError("--show-prompt: the input holds no line to prompt with")
    encoded = gen.encode([record.text], [record.fields])[0]
    if encoded.error is not None:
        raise SeqgenError(f"{record.where}: {encoded.error}")
    cut = f", truncated to {gen.limit_said}" if encoded.truncated else ""
    text = gen.tokenizer.decode(encoded.ids, skip_special_tokens=False)
    return f"{text}\n-- {record.where}: {len(encoded.ids)} prompt tokens{cut}"


def generate_job(gen: Generator, job: Job) -> Summary:
    """Run the job; the summary says whether it was interrupted or failed (after writing what it could)."""
    from seqgen_cli.verify import self_check  # transformers' generate(): imported with the model, not before

    opts = job.opts
    reserved = opts.fields()
    records = read_records(
        job.paths,
        opts.input_format,
        opts.input_field,
        opts.on_error,
        select=job.select,
        reserved=reserved,
        chat=opts.chat,
    )
    records, agreement = self_check(gen, records, opts.verify, opts.verify_strict)
    streaming = any(not is_regular(p) for p in job.paths)  # stdin or a named pipe: hand lines on at once
    progress = Progress(opts.progress, job.paths, total=job.shard.size if job.shard is not None else None)
    with progress.notes():  # a shape compiling pauses the bar: the engine says so above it
        summary = write_records(
            gen,
            records,
            job.output,
            opts,
            progress=progress,
            streaming=streaming,
            settings=job.settings(gen),
            part=job.shard is not None,
        )
    summary.verify = agreement
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
    reuse = resume.JournalReuse()
    sink, state = open_sink(output, settings, opts, part=part)
    try:
        if state is not None:
            start = state.done
            records = resume.skip_done(records, state, digest)  # raises where the inputs done differ
            journaled, discarded = load_journal(output, state.done)  # entries whose digest holds
            reuse = resume.JournalReuse(journaled)
            if discarded:
                progress.warn(discarded)
    except BaseException:
        sink.close(complete=False)  # index and journal stay; the file (and its lock) is let go
        raise
    keep: list[str] | None = [] if opts.reference and is_stream(output) else None  # cannot be read back
    progress.start_at(start)
    with guarded(output, sink):
        summary = run(
            gen,
            records,
            sink,
            opts,
            start=start,
            digest=digest,
            progress=progress,
            keep=keep,
            streaming=streaming,
            reuse=reuse,
        )
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


def write_stats(path: str, summary: Summary) -> None:
    """``--stats FILE``: the summary as JSON (``-``: standard output)."""
    text = json.dumps(summary.as_dict(), indent=2) + "\n"
    if path != "-":
        return write_whole(path, text)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as err:
        raise WriteError.of(err, path) from err


def score(output: str, keep: list[str] | None, opts: JobOptions, n: int) -> dict:
    """Score the first of the ``n`` outputs of every input against ``--reference`` (``seqgen eval``)."""
    from seqgen_cli import metrics as m

    hyps = keep if keep is not None else read_hypotheses(output, opts, n)
    return m.score(hyps, m.read_lines(opts.reference), m.parse_metrics(opts.metrics))


def read_hypotheses(output: str, opts: RunOptions, n: int) -> list[str]:
    """The first output of every input, read back from the output file (a text line's text: after its scores)."""
    from seqgen_cli import metrics as m

    lines = m.read_lines(output)
    if opts.output_format == "jsonl":
        outs = [json.loads(line)[opts.output_field] for line in lines]
        return [o[0] if isinstance(o, list) else o for o in outs]
    first = lines[::n]  # text: n consecutive lines per input
    return [line.split("\t", 2)[-1] for line in first] if opts.scores else first
