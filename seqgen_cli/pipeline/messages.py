"""What a job tells the user when it ends: the closing lines on stderr and, after a run that did not finish,
the one line that says what happened, what is kept and how to go on."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from seqgen_cli.errors import Aborted, SeqgenError
from seqgen_cli.pipeline.formats import index_path, journal_path
from seqgen_cli.pipeline.sinks import is_stream
from seqgen_cli.pipeline.stats import Summary, describe_inputs, plural

if TYPE_CHECKING:
    from seqgen_cli.generator import Generator


def closing_lines(
    summary: Summary, inputs: Sequence[str], max_source_length: int | None, *, quiet: bool
) -> list[str]:
    """The lines on stderr after ``seqgen generate``'s run, before :func:`closing_message`: inputs truncated or
    skipped, the summary line (unless ``quiet``), the scores of ``--reference``."""
    lines = []
    if summary.truncated:
        lines.append(
            f"seqgen: {summary.truncated} of {plural(summary.inputs, 'input')} truncated to "
            f"{max_source_length} tokens"
        )
    if summary.at_default_length and not quiet:  # part of the summary (-q: none)
        lines.append(
            f"seqgen: note: {summary.at_default_length} of {plural(summary.inputs, 'output')} stopped at transformers' "
            "default length limit of 20 new tokens (neither the checkpoint, a preset nor a flag sets one); set "
            "--max-new-tokens"
        )
    if summary.incomplete:
        lines.append(
            f"seqgen: {summary.incomplete} of {plural(summary.inputs, 'output')} ended before the grammar completed "
            '(JSONL output marks them "complete": false); raise --max-new-tokens'
        )
    if summary.skipped:
        lines.append(f"seqgen: {plural(summary.skipped, 'input')} skipped (empty outputs; see the warnings)")
    if not quiet:
        from seqgen_cli import STARTED

        lines.append(summary.line(describe_inputs(inputs), process_seconds=time.perf_counter() - STARTED))
    if summary.metrics is not None:
        from seqgen_cli.metrics import format_table

        lines.append(format_table(summary.metrics))
    return lines


def no_refill(gen: Generator) -> str:
    """Why ``--refill`` does not run for ``gen`` (it asked for it, ``gen.refill`` is false): the note above the
    run, as for ``--backend auto``'s fallback."""
    from seqgen_cli.models import backend_name

    if gen.backend != "fast":
        why = "transformers generate() runs this model"
    elif gen.loaded.int8:
        why = "--dtype int8 runs without lanes"
    else:
        why = f"the {backend_name(gen.model_backend())} backend has no lanes"
    return f"seqgen: note: --refill does not run here: {why}; batches run as with --no-refill (the same outputs)"


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
