"""The ``seqgen`` command line: click commands only; the work happens in the modules they call."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click

from seqgen_cli import __version__
from seqgen_cli.batching import DEFAULT_BATCH_SIZE
from seqgen_cli.cli_options import (
    BENCH_EXCLUDES,
    FORMAT_OPTIONS,
    GENERATION_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_RULE_OPTIONS,
    PROMPT_OPTIONS,
    WORKERS_OPTIONS,
    generation_options,
    int_list,
    name_list,
    pop_generation,
)
from seqgen_cli.errors import SeqgenError, one_line
from seqgen_cli.openmp import choose_wait
from seqgen_cli.pipeline import process


class _Group(click.Group):
    """Turns ``SeqgenError`` into one line on stderr and its exit code (2; 1 for a run stopped by a failed
    write or a bug); Ctrl-C into exit code 130."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            process.command_started()  # SIGTERM raises KeyboardInterrupt (before, it ends the process at once)
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.ClickException, click.exceptions.Abort):
            raise
        except SeqgenError as err:
            if os.environ.get("SEQGEN_DEBUG") and err.__cause__ is not None:
                import traceback

                traceback.print_exception(err.__cause__)
            click.echo(f"seqgen: error: {one_line(str(err))}", err=True)
            sys.exit(err.exit_code)
        except KeyboardInterrupt:
            click.echo("seqgen: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.stderr.close()  # the reader went away (e.g. `| head`): not an error
            sys.exit(0)
        except Exception as err:  # a bug: one line, the traceback on request
            if os.environ.get("SEQGEN_DEBUG"):
                raise
            click.echo(
                f"seqgen: internal error: {type(err).__name__}: {one_line(str(err))} (SEQGEN_DEBUG=1 shows the traceback)",
                err=True,
            )
            sys.exit(1)


def run(args: list[str] | None = None) -> None:
    """The ``seqgen`` process: :func:`main`, then an exit that skips the interpreter's teardown (its 0.7-1.5 s;
    :func:`~.pipeline.process.exit_now`) with :func:`main`'s exit status. An uncaught exception
    (``SEQGEN_DEBUG=1``) exits as usual.

    First, before torch is imported, the OpenMP setting (:func:`seqgen_cli.openmp.choose_wait`: idle threads
    that spin only briefly and a thread count that follows the cores other processes leave free, or, where
    others fill half the cores already, sleeping threads; a user's wait policy or ``OMP_NUM_THREADS`` is kept),
    and SIGTERM becomes Ctrl-C (what is done is written, exit 130), model loading included.
    """
    choose_wait(os.environ)
    process.install()  # a scheduler's stop, as Ctrl-C: from the start, loading too
    try:
        main(args)  # standalone click: always ends in SystemExit
        code: object = 0
    except SystemExit as done:
        code = done.code
    process.exit_now(code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="seqgen")
def main() -> None:
    """Fast, exact batch text generation (summarisation, translation, continuation) for Hugging Face
    checkpoints. Run `seqgen COMMAND --help` for each command."""


# `seqgen generate --help` in sections (each option under the first section that names it; the rest: "Other").
HELP_SECTIONS = {
    "Input and output": (
        "output",
        "input_format",
        "input_field",
        "output_format",
        "output_field",
        "scores",
        "max_source_length",
    ),
    "Prompt": (
        "prefix",
        "prompt_template",
        "chat",
        "system_prompt",
        "chat_template",
        "chat_template_kwargs",
        "show_prompt",
    ),
    "Model and device": ("model", "preset", "backend", "device", "dtype", "capture", "verify_spec"),
    "Generation": (
        *GENERATION_OPTIONS,
        "stop",
        "seed",
        "target_lang",
        "forced_bos_token_id",
        "forced_eos_token_id",
    ),
    "Batching": ("batch_size", "batch_tokens", "sort_window", "refill"),
    "Resume and errors": ("resume", "on_error"),
    "Reports": ("stats_path", "reference", "metrics", "quiet"),
    "Many processes": (
        "workers",
        "address",
        "gpus_per_worker",
        "cpus_per_worker",
        "shard_size",
        "shard_spec",
    ),
}


class _SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options in :data:`HELP_SECTIONS`."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = None if isinstance(param, click.Argument) else param.get_help_record(ctx)
            if record is None:
                continue
            section = next((s for s, names in HELP_SECTIONS.items() if param.name in names), "Other")
            rows.setdefault(section, []).append(record)
        for section in [*HELP_SECTIONS, "Other"]:
            if section in rows:
                with formatter.section(section):
                    formatter.write_dl(rows[section])


@main.command(cls=_SectionedCommand)
@click.argument("inputs", nargs=-1, type=click.Path(dir_okay=False, allow_dash=True))
@click.option(
    "-m", "--model", required=True, help="Checkpoint folder (or a hub id where the hub is reachable)."
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="-",
    show_default=True,
    help="Output file; - is stdout.",
)
@MODEL_OPTIONS
@click.option(
    "--refill/--no-refill",
    default=False,
    show_default=True,
    help="Run the fast engine over fixed input lanes: an input that finishes hands its lane to a waiting "
    "one (same outputs; every family with a fast decoder: seqgen models). --stats gives lanes, occupancy, "
    "joins and steps.",
)
@generation_options()
@click.option(
    "--target-lang",
    metavar="CODE",
    help="Translate into this language: its code in the model's tokenizer (mBART-50 de_DE, M2M-100 de, NLLB "
    "deu_Latn), or the language as you would write it (de, deu, de-AT: the model's code for it, where it has "
    "one), forced as the first generated token (--forced-bos-token-id); for a multi-target OPUS-MT model its "
    ">>code<< token before every input.",
)
@click.option("--seed", type=int, help="Random seed for sampling.")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=DEFAULT_BATCH_SIZE,
    show_default=True,
    help="Most inputs per batch (with --refill: the lanes).",
)
@click.option(
    "--batch-tokens", type=click.IntRange(min=1), help="Most padded source tokens x beams per batch."
)
@click.option(
    "--max-source-length",
    type=click.IntRange(min=1),
    help="Truncate inputs to this many tokens (default: the model's limit).",
)
@PROMPT_OPTIONS
@OUTPUT_RULE_OPTIONS
@FORMAT_OPTIONS
@click.option(
    "--sort-window",
    type=click.IntRange(min=0),
    help="Inputs read ahead and sorted by length to form batches (default: 16 x --batch-size, at "
    "least 2048; 0 = no sorting, batches in input order). Output order is always the input order.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted run into -o FILE (checked against FILE.seqgen-index); "
    "starts afresh when FILE does not exist.",
)
@click.option(
    "--on-error",
    type=click.Choice(["fail", "skip"]),
    default="fail",
    show_default=True,
    help="A bad input line, or one input that cannot run even alone (out of memory): fail = stop "
    "(after writing every output before it); skip = warn, write an empty line (JSONL: an error field).",
)
@click.option(
    "--stats",
    "stats_path",
    type=click.Path(dir_okay=False),
    help="Write the run's statistics here (JSON; - is stdout). Their seconds are the run's, without start-up "
    "and model load (the closing line gives both).",
)
@click.option(
    "--reference",
    type=click.Path(dir_okay=False, exists=True),
    help="Score the outputs against this file at the end (as `seqgen eval`).",
)
@click.option("--metrics", help="With --reference: comma-separated rouge, bleu, chrf (default: all).")
@WORKERS_OPTIONS
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary on stderr.")
def generate(inputs: tuple[str, ...], model: str, output: str, **opts) -> None:
    """Generate one output per input line, in input order.

    INPUTS are text files (one input per line) or JSONL files; none or - reads stdin. Settings
    resolve as in transformers: the checkpoint's generation_config.json, then --preset, then flags.

    Reading and tokenising run ahead of the model and writing behind it, in background threads.
    Output to a file is written in whole lines and indexed in FILE.seqgen-index as it goes, and
    outputs that wait for an earlier input are journaled, so an interrupted run (Ctrl-C, a crash,
    SIGKILL) continues with --resume and generates only what is missing. Ctrl-C writes what is done
    and exits with status 130.

    --workers N runs the job on N Ray workers (a local cluster, or --address); the output is the same
    file, in input order, and resumable the same way. --shard I/N runs one shard for other launchers.

    \b
    Examples:
      seqgen generate -m bart-large-cnn --preset cnndm-bart articles.txt -o summaries.txt
      seqgen generate -m opus-mt-en-de --preset wmt-marian news.en -o news.de --stats run.json
      seqgen generate -m mbart-large-50 --target-lang de_DE news.en -o news.de
      cat docs.jsonl | seqgen generate -m ckpt --input-field document --output-format jsonl > out.jsonl
      seqgen generate -m ckpt in.txt -o out.txt --resume          # after Ctrl-C or a crash
      seqgen generate -m ckpt in.txt -o out.txt --workers 4       # on a local Ray cluster
    """
    from seqgen_cli import startup

    startup.reset()
    startup.mark("generate command")
    with startup.stage("import the pipeline (torch, transformers)"):
        from seqgen_cli.pipeline.job import check_job, first_prompt, generator_spec, job_options
        from seqgen_cli.pipeline.launch import cluster_options, run_job
        from seqgen_cli.pipeline.messages import closing_lines, closing_message

    quiet, show_prompt, shard_spec = opts["quiet"], opts.pop("show_prompt"), opts.pop("shard_spec")
    cluster_flags = {k: opts.pop(k) for k in ("address", "gpus_per_worker", "cpus_per_worker", "shard_size")}
    verify_inputs, verify_strict = opts.pop("verify_spec")
    cluster = cluster_options(opts.pop("workers"), cluster_flags, verify=verify_inputs)
    job = job_options(opts, output, shard_spec=shard_spec, verify=verify_inputs, verify_strict=verify_strict)
    checked = check_job(inputs, output, job, model)  # before the (slow) model load and any input read
    spec = generator_spec(model, opts)
    if show_prompt:  # the first input's prompt, as the model gets it
        click.echo(first_prompt(spec.build(), checked))
        return
    summary, max_source_length = run_job(
        spec, checked, cluster, quiet=quiet, note=lambda line: click.echo(one_line(line), err=True)
    )
    # The closing lines on stderr; after a failure or Ctrl-C, what happened comes last (the line the user sees).
    for line in closing_lines(summary, inputs, max_source_length, quiet=quiet):
        click.echo(one_line(line), err=True)
    message = closing_message(summary, output)
    if summary.interrupted:
        click.echo(one_line(message), err=True)
        sys.exit(130)
    if message is not None:
        raise SeqgenError(message)


@main.command()
@click.argument("parts", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    required=True,
    help="The joined file; - is stdout.",
)
def merge(parts: tuple[str, ...], output: str) -> None:
    """Join the outputs of a `seqgen generate --shard I/N` run, given in shard order (0 to N-1), into
    the file one process would have written. Each part's manifest (PART.seqgen-part) is checked first:
    refuses parts out of order, missing or twice, of another job (input, settings, N), changed since,
    or not finished (PART.seqgen-index still there: rerun that shard with --resume)."""
    from seqgen_cli.pipeline.merge import merge_parts

    lines = merge_parts(parts, output)
    where = "stdout" if output == "-" else output
    click.echo(f"seqgen: merged {len(parts)} parts ({lines} lines) into {where}", err=True)


@main.command("eval")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False, allow_dash=True))
@click.option(
    "-i",
    "--input",
    "hypotheses",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="The hypotheses, as sacrebleu takes them: then every FILE is a reference (`seqgen eval REF... -i "
    "HYP`).",
)
@click.option(
    "--metrics",
    default=None,
    help="Comma-separated: rouge, bleu, chrf, chrf++, ter (default: rouge,bleu,chrf).",
)
@click.option(
    "--tokenize", "-tok", help="BLEU's tokenizer, as sacrebleu's (13a, intl, zh, char, none, flores200, ...)."
)
@click.option(
    "--lowercase", "-lc", is_flag=True, help="BLEU and chrF case-insensitive (TER always is, as TERCOM)."
)
@click.option("--chrf-word-order", type=click.IntRange(0, 6), default=0, show_default=True, help="2: chrF++.")
@click.option("--force", is_flag=True, help="Score tokenised hypotheses without sacrebleu's warning.")
@click.option(
    "--confidence",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Bootstrap N resamples for a 95 % interval of each sacrebleu metric (sacrebleu --confidence-n; 0: "
    "off).",
)
@click.option(
    "--sentence-scores",
    type=click.Path(dir_okay=False, allow_dash=True),
    metavar="FILE",
    help='Write each line\'s scores as JSONL ({"line": 1, "bleu": ..., ...}; sentence BLEU with effective '
    "order, as sacrebleu --sentence-level).",
)
@click.option(
    "--paired-bs",
    "baseline",
    type=click.Path(dir_okay=False, allow_dash=True),
    metavar="BASELINE",
    help="Test the hypotheses against a baseline system's line-aligned outputs: sacrebleu's paired bootstrap "
    "resampling (1000 resamples), each sacrebleu metric's p-value of the difference (< 0.05 marked *).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of a table.")
def eval_(
    files: tuple[str, ...], hypotheses: str | None, metrics: str | None, as_json: bool, **settings
) -> None:
    """Score hypotheses against one or more line-aligned references (text files; - is stdin):
    `seqgen eval HYP REF [REF...]`, or in sacrebleu's order `seqgen eval REF [REF...] -i HYP`.

    ROUGE-1/2/L/Lsum F1 (rouge-score, Porter stemming; the best reference per line), BLEU, chrF, chrF++ and TER
    (sacrebleu, with its signature; the numbers of its own command line).

    Texts are compared as written, with no Unicode normalisation (neither library offers one): the same
    text in NFC and in NFD (e.g. "é" as one character, or "e" plus a combining accent) scores as different,
    under every metric. Normalise both files the same way first, e.g. with Python's
    unicodedata.normalize("NFC", line).
    """
    from seqgen_cli.pipeline.evaluate import eval_report

    report = eval_report(files, hypotheses, metrics, as_json=as_json, **settings)
    if report.sentences is not None:
        click.echo(report.sentences, nl=False)
    if report.note is not None:  # every metric, whatever the task: say so, and how to choose
        click.echo(report.note, err=True)
    click.echo(report.text)


@main.command()
def models() -> None:
    """List the model types (config.json's model_type) seqgen runs on its fast decoders, and those it hands to
    transformers generate(); any other model transformers loads runs on the generic backend (exact, slower)."""
    from seqgen_cli.models import model_types

    rows = model_types()
    width = max(len(name) for name, _ in rows)
    for name, what in rows:
        click.echo(f"{name:<{width}}  {what}")
    click.echo(f"{'(other)':<{width}}  the generic backend: transformers' forward under seqgen's search")


@main.command()
def presets() -> None:
    """List the task presets (configs/*.toml) and their settings."""
    from seqgen_cli.presets import list_presets

    for p in list_presets():
        settings = ", ".join(f"{k}={v}" for k, v in p.generation.items())
        extra = "".join(
            f", {k}={v!r}" for k, v in (("prefix", p.prefix), ("max_source_length", p.max_source_length)) if v
        )
        click.echo(f"{p.name:<14} {p.description}\n{'':<14} {settings}{extra}")


@main.command()
@click.argument("input", type=click.Path(exists=True, dir_okay=False))
@click.option("-m", "--model", required=True, help="Checkpoint folder.")
@click.option(
    "--n", "n", type=click.IntRange(min=1), default=32, show_default=True, help="Inputs (first N lines)."
)
@click.option(
    "--batch-sizes", default="1,8,32", show_default=True, callback=int_list, help="Comma-separated."
)
@click.option("--num-beams", default="1,4", show_default=True, callback=int_list, help="Comma-separated.")
@click.option(
    "--compare",
    default="hf,ct2",
    show_default=True,
    callback=name_list,
    help="Systems besides seqgen: hf (transformers generate()), ct2 (CTranslate2, skipped if not installed).",
)
@click.option(
    "--mode",
    "modes",
    default="decode",
    show_default=True,
    callback=name_list,
    help="decode (generation only), e2e (whole process, files to files), or decode,e2e.",
)
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "float16", "bfloat16", "int8"]),
    default="auto",
    show_default=True,
    help="auto: float32 on CPU, bfloat16 (else float16) on GPU; CTranslate2 gets the same compute type. "
    "int8 (CPU): hf runs float32 generate() as the agreement reference.",
)
@click.option(
    "--fixed-new-tokens",
    type=click.IntRange(min=1),
    help="Force exactly N new tokens per output (min = max) so random-weight timings are comparable.",
)
@click.option(
    "--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Timed runs; median reported."
)
@click.option(
    "--warmup/--no-warmup", default=True, show_default=True, help="One untimed batch per system first."
)
@click.option(
    "--max-batches",
    type=click.IntRange(min=1),
    help="At most this many batches per cell (n = min(N, K x batch size)): keeps batch 1 affordable.",
)
@click.option(
    "--threads", type=click.IntRange(min=1), help="CPU threads for torch and CTranslate2 (default: torch's)."
)
@click.option("--out", default="bench-results", show_default=True, help="Folder for bench.json/.md/.png.")
@click.option(
    "--ct2-cache", help="Folder for converted CTranslate2 models (default ~/.cache/seqgen-bench/ct2)."
)
@click.option("--preset", help="Task preset name or .toml file.")
@click.option("--prefix", help="Text prepended to every input.")
@click.option("--max-source-length", type=click.IntRange(min=1), help="Truncate inputs to this many tokens.")
@click.option(
    "--backend",
    type=click.Choice(["auto", "fast", "hf"]),
    default="auto",
    show_default=True,
    help="seqgen's backend: fast (its engine), hf (generate() inside seqgen's pipeline), auto.",
)
@click.option(
    "--target-lang",
    metavar="CODE",
    help="As seqgen generate takes it; every system decodes into that language "
    "(generate(): forced_bos_token_id; CTranslate2: the target prefix).",
)
@click.option("--seed", type=int, help="Random seed for seqgen's sampling (--do-sample).")
@generation_options(exclude=BENCH_EXCLUDES)
def bench(input: str, model: str, **opts) -> None:
    """Speed and agreement of seqgen against transformers generate() and CTranslate2.

    For each (beams, batch size) every system generates for the same first N lines of INPUT, after a
    warm-up, interleaved (A B C A B C ...); medians of --repeats runs. Writes bench.json (every run),
    bench.md (table) and bench.png (samples/s vs batch size) into --out. "same as hf" is the share of outputs
    token-identical to generate()'s; in decode mode an output that differs is re-scored under transformers' model,
    and a system whose outputs differ beyond near-ties is flagged (its speed compares other outputs). Sampled
    outputs (--do-sample) are draws from each system's own random stream: not compared.
    """
    from seqgen_cli.pipeline import paths

    paths.check_bench(input, opts["out"], model)  # before the (slow) model load
    from seqgen_cli.bench.run import run_bench
    from seqgen_cli.bench.settings import BenchSettings

    generation = pop_generation(opts, exclude=BENCH_EXCLUDES)
    settings = BenchSettings(model=model, input=input, generation=generation, **opts)
    command = "seqgen bench " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else ""
    report = run_bench(settings, command=command)
    click.echo(report["table"])
    click.echo(f"seqgen bench: wrote {Path(settings.out) / 'bench.json'}, bench.md, bench.png", err=True)
