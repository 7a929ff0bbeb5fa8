"""The ``seqgen`` command line: click commands only; the work happens in the modules they call."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import click

from seqgen_cli import __version__
from seqgen_cli.batching import DEFAULT_BATCH_SIZE
from seqgen_cli.errors import SeqgenError, one_line
from seqgen_cli.openmp import choose_wait
from seqgen_cli.pipeline import process

EARLY_STOPPING = {"true": True, "false": False, "never": "never"}

F = TypeVar("F", bound=Callable[..., Any])


def _early_stopping(ctx: click.Context, param: click.Parameter, value: str | None) -> bool | str | None:
    """``--early-stopping true|false|never`` as transformers takes it: True, False or "never"."""
    return None if value is None else EARLY_STOPPING[value]


class _Flag(NamedTuple):
    """One generation flag: its help and ``click.option`` keywords; the flag is its key with dashes."""

    help: str
    kwargs: dict[str, Any]


def _flag(type: Any, help: str, **kwargs: Any) -> _Flag:  # noqa: A002 - click's own name for it
    return _Flag(help, {"type": type, **kwargs})


def _flag_decl(name: str, flag: _Flag) -> str:
    """``--max-new-tokens`` for ``max_new_tokens``; a boolean flag also has its ``--no-`` form."""
    decl = "--" + name.replace("_", "-")
    return f"{decl}/--no-{decl[2:]}" if flag.kwargs["type"] is bool else decl


def _given_ids(ctx: click.Context, param: click.Parameter, value: tuple[int, ...]) -> list[int] | None:
    """A repeatable id flag's values; ``None`` when not given (as every other generation flag)."""
    return list(value) or None


# The generation flags, keyed by transformers' names: the keys of seqgen_cli.config.GENERATION_KEYS (not
# imported here: it loads transformers, and `seqgen --help` should not; tests/cli/test_cli.py checks the two
# agree). Every value reaches Generator(**flags) unchanged, --early-stopping through its callback; their
# ranges are checked there (config.RULES), as a preset's and a checkpoint's are, not by click.
GENERATION_OPTIONS: dict[str, _Flag] = {
    "num_beams": _flag(int, "Beam size (1 = greedy or sampling)."),
    "max_new_tokens": _flag(int, "Most tokens to generate (excludes the prompt)."),
    "min_new_tokens": _flag(int, "Fewest tokens to generate before EOS is allowed."),
    "max_length": _flag(
        int, "Most tokens in total, as transformers counts them (decoder start token / prompt included)."
    ),
    "min_length": _flag(int, "Fewest tokens in total, as transformers counts them."),
    "length_penalty": _flag(float, "Beam scores are divided by length**penalty (>1 favours longer outputs)."),
    "early_stopping": _flag(
        click.Choice(list(EARLY_STOPPING)),
        "Beam search stop rule, as in transformers.",
        callback=_early_stopping,
    ),
    "no_repeat_ngram_size": _flag(int, "Never repeat an n-gram of this size (0 = off)."),
    "num_return_sequences": _flag(
        int, "Outputs per input: N consecutive lines (text) or a list (JSONL), best first."
    ),
    "do_sample": _flag(bool, "Sample instead of searching.", default=None),
    "temperature": _flag(float, "Sampling temperature (> 0); 0: greedy search, as vLLM and llama.cpp read it."),
    "top_k": _flag(int, "Sample among the k most likely tokens (0 = all)."),
    "top_p": _flag(float, "Sample within the top-p probability mass (0 < p <= 1)."),
    "min_p": _flag(float, "Sample among tokens at least this fraction of the best one's probability (0-1)."),
    "typical_p": _flag(float, "Typical sampling: the tokens nearest the entropy, up to this mass (0 < p <= 1)."),
    "epsilon_cutoff": _flag(float, "Epsilon sampling: drop tokens of probability below this (0-1; 0 = off)."),
    "eta_cutoff": _flag(float, "Eta sampling: an entropy-scaled epsilon cutoff (0-1; 0 = off)."),
    "repetition_penalty": _flag(float, "Penalise tokens already in the output (1.0 = off; > 0)."),
    "forced_bos_token_id": _flag(
        int, "Token id forced as the first generated token (mBART-50, M2M-100, NLLB: the target language)."
    ),
    "forced_eos_token_id": _flag(int, "Token id forced as the last token at the maximum length."),
    "logprobs": _flag(
        int,
        "JSONL output: each token's log-prob under the model (before any processor) and the N most likely "
        "tokens of its step (0-20), as vLLM gives them; implies --scores (greedy search and sampling).",
    ),
    "stop_token_id": _flag(
        int,
        "End an output at this token id too, beside the model's EOS ids (repeatable; vLLM's stop_token_ids): "
        "kept in the output unless a special token, as EOS is.",
        multiple=True,
        callback=_given_ids,
    ),
}
BENCH_REPORTS = ("bench.json", "bench.md", "bench.png")  # what `seqgen bench` writes into --out
# Not bench flags: --num-beams is bench's own comma-separated list; bench times one searched output per input.
_BENCH_EXCLUDES = ("num_beams", "num_return_sequences", "logprobs")


def generation_options(exclude: Collection[str] = ()) -> Callable[[F], F]:
    """Add the generation flags (all but ``exclude``) in table order."""
    unknown = set(exclude) - set(GENERATION_OPTIONS)
    if unknown:
        raise ValueError(f"no generation flag {', '.join(sorted(unknown))}")

    def decorate(f: F) -> F:
        for name, flag in reversed(GENERATION_OPTIONS.items()):
            if name not in exclude:
                f = click.option(_flag_decl(name, flag), name, help=flag.help, **flag.kwargs)(f)
        return f

    return decorate


def _parse_verify(value: str | None) -> tuple[int | None, bool]:
    """``--verify``: (inputs, strict); ``(None, False)``: the device's default."""
    if value is None:
        return None, False
    if value == "strict":
        from seqgen_cli.verify import VERIFY_INPUTS  # (torch, transformers: only when asked)

        return VERIFY_INPUTS, True
    if not value.isdigit():
        raise click.BadParameter(f"{value!r}: give a number of inputs or strict", param_hint="'--verify'")
    return int(value), False


def _pop_generation(opts: dict[str, Any], exclude: Collection[str] = ()) -> dict[str, Any]:
    """Take the generation flags (``GENERATION_KEYS`` but ``exclude``) out of a command's options."""
    from seqgen_cli.config import GENERATION_KEYS

    return {k: opts.pop(k) for k in GENERATION_KEYS if k not in exclude and k in opts}


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
    "Input and output": ("output", "input_format", "input_field", "output_format", "output_field", "scores",
                         "max_source_length"),
    "Prompt": ("prefix", "prompt_template", "chat", "system_prompt", "chat_template", "chat_template_kwargs",
               "show_prompt"),
    "Model and device": ("model", "preset", "backend", "device", "dtype", "capture", "verify_spec"),
    "Generation": (*GENERATION_OPTIONS, "stop", "seed", "target_lang", "forced_bos_token_id", "forced_eos_token_id"),
    "Batching": ("batch_size", "batch_tokens", "sort_window", "refill"),
    "Resume and errors": ("resume", "on_error"),
    "Reports": ("stats_path", "reference", "metrics", "quiet"),
    "Many processes": ("workers", "address", "gpus_per_worker", "cpus_per_worker", "shard_size", "shard_spec"),
}  # fmt: skip


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
@click.option("--preset", help="Task preset name (see `seqgen presets`) or a .toml file.")
@click.option(
    "--backend",
    type=click.Choice(["auto", "fast", "hf"]),
    default="auto",
    show_default=True,
    help="fast: seqgen's engine; hf: transformers generate(); auto: fast where supported.",
)
@click.option(
    "--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto (first GPU if any)."
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "float16", "bfloat16", "int8"]),
    default="auto",
    show_default=True,
    help="auto: float32 on CPU, bfloat16 (else float16) on GPU. int8 (CPU only): float32 weights, linear "
    "layers in int8 (dynamic quantization; not exact).",
)
@click.option(
    "--capture/--no-capture",
    default=None,
    help="On CUDA, replay the fast engine's decode step as CUDA graphs (torch.compile reduce-overhead, one "
    "graph per batch shape and attended span). Default: a shape is compiled once the steps it ran eagerly "
    "would have saved what compiling it costs (~14 s a graph; until then its batches run as with "
    "--no-capture), so short runs compile little; --capture compiles every shape at once, --no-capture never. "
    "The closing line and --stats name the step path.",
)
@click.option(
    "--verify",
    "verify_spec",
    metavar="N|strict",
    callback=lambda ctx, param, value: _parse_verify(value),
    help="Before the run, generate the first N inputs with seqgen and with transformers generate() on the "
    "same device and dtype and report the token-identical share (near-ties named) in the closing line and "
    "--stats; strict: 8 inputs, and stop before writing when they differ beyond near-ties. 0: off. "
    "Default: 8 on CUDA, off on the CPU.",
)
@click.option(
    "--refill/--no-refill",
    default=False,
    show_default=True,
    help="Run the fast engine over fixed input lanes: an input that finishes hands its lane to a waiting one "
    "(same outputs; every family with a fast decoder: seqgen models). --stats gives lanes, occupancy, joins and steps.",
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
@click.option("--prefix", help="Text prepended to every input, e.g. 'summarize: ' for T5.")
@click.option(
    "--chat", is_flag=True, help="Each input is the user message of the tokenizer's chat template, the assistant's "
    "turn opened (as apply_chat_template(add_generation_prompt=True)); a JSONL object's \"messages\" list is the "
    "conversation as given (its \"tools\" too), one ending in an assistant message continued from it. The output "
    "is the assistant's text.",
)  # fmt: skip
@click.option(
    "--system-prompt", metavar="TEXT|@FILE", help="The system message (implies --chat); a \"messages\" "
    "conversation with a system message of its own keeps that one.",
)  # fmt: skip
@click.option(
    "--chat-template", metavar="FILE|@FILE|TEXT", help="A Jinja chat template (a file, or the template's text), "
    "for a tokenizer without one or to replace its own (implies --chat).",
)  # fmt: skip
@click.option(
    "--chat-template-kwargs", metavar="JSON", help='Switches of the chat template, e.g. \'{"enable_thinking": false}\'.'
)
@click.option(
    "--prompt-template", metavar="TEXT|@FILE", help="The prompt with {input} where the input goes and, for JSONL "
    "input, {field} for a field of its object (other braces stay as written); with --chat, the user message. "
    "--max-source-length shortens the input inside it, never the template.",
)  # fmt: skip
@click.option(
    "--show-prompt", is_flag=True, help="Print the first input's prompt as the model gets it, and its token count; "
    "generate nothing.",
)  # fmt: skip
@click.option(
    "--stop", "stop", multiple=True, metavar="STRING", help="End an output where its text reaches STRING (kept in "
    "the output), as generate(stop_strings=...); repeatable, beside the checkpoint's stop_strings (greedy and "
    "sampling on seqgen's engine; beam search on generate()). In text output a newline inside an output is written "
    "as a space.",
)  # fmt: skip
@click.option(
    "--json-schema",
    metavar="FILE|@FILE|JSON",
    help="Structured output: every output a JSON value of this JSON schema (a file, or the schema itself), on one "
    "line as json.dumps writes it; an output cut short by --max-new-tokens is counted at the end and, in JSONL output, "
    'marked "complete": false. Also --regex, --grammar, --choice (one of the four).',
)
@click.option(
    "--regex", metavar="PATTERN", help="Structured output: every output a match of PATTERN (Rust regex syntax)."
)
@click.option(
    "--grammar",
    metavar="FILE|@FILE",
    help="Structured output: every output a sentence of this GBNF (llama.cpp) or Lark grammar file.",
)
@click.option(
    "--choice",
    "choice",
    multiple=True,
    metavar="TEXT",
    help="Structured output: every output one of these texts (repeat: --choice positive --choice negative).",
)
@click.option(
    "--input-format",
    type=click.Choice(["auto", "text", "jsonl"]),
    default="auto",
    show_default=True,
    help="auto: by extension (.jsonl/.json: JSONL; .txt, .src, ...: text), else JSONL when the first line is "
    "a JSON object (stdin, other extensions).",
)
@click.option(
    "--input-field",
    help="JSONL field holding the input (default: text, src, source or input); an error for text input.",
)
@click.option(
    "--output-format",
    type=click.Choice(["text", "jsonl"]),
    default="text",
    show_default=True,
    help="text: one line per output; jsonl: the input object plus the output field.",
)
@click.option(
    "--output-field", default="output", show_default=True, help="JSONL field the output is written to."
)
@click.option(
    "--scores", is_flag=True, help="Give each output its score and the summed log-probability of its tokens "
    "(generate()'s sequences_scores for beam search, length-penalised; greedy and sampling: the log-probability): "
    "JSONL output gets \"score\", \"log_prob\" and \"token_log_probs\" (each token's) fields, text output lines "
    "begin SCORE<TAB>LOG_PROB<TAB> (cut -f3- gives the text).",
)  # fmt: skip
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
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="Run on N Ray workers (each loads the model once and takes shards of the input as it frees up); "
    "the output is the same as one process writes. Needs the ray extra.",
)
@click.option(
    "--address", help="With --workers: the Ray cluster to join (auto, or HOST:PORT); default: a local one."
)
@click.option(
    "--gpus-per-worker", type=click.FloatRange(min=0), help="With --workers: GPUs per worker (default 0)."
)
@click.option(
    "--cpus-per-worker",
    type=click.FloatRange(min=0, min_open=True),
    help="With --workers: CPUs per worker (default 1; also its torch threads on CPU).",
)
@click.option(
    "--shard-size",
    type=click.IntRange(min=1),
    help="With --workers: inputs per shard, the unit a worker takes, retries and the driver merges "
    "(default: 4096, fewer for small inputs).",
)
@click.option(
    "--shard",
    "shard_spec",
    metavar="I/N|auto",
    help="Run only shard I (from 0) of N contiguous shards of the input, for other launchers (SLURM "
    "arrays, torchrun); auto: I/N from RANK/WORLD_SIZE. Join the outputs with `seqgen merge`.",
)
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
        from seqgen_cli.pipeline.job import check_job, generate_job, generator_spec, job_options
        from seqgen_cli.pipeline.messages import closing_lines, closing_message

    quiet = opts["quiet"]
    cluster_flags = {k: opts.pop(k) for k in ("address", "gpus_per_worker", "cpus_per_worker", "shard_size")}
    workers, shard_spec = opts.pop("workers"), opts.pop("shard_spec")
    verify_inputs, verify_strict = opts.pop("verify_spec")
    if workers is not None and verify_inputs:
        raise SeqgenError("--verify runs in one process: not with --workers")
    if workers is None and any(v is not None for v in cluster_flags.values()):
        given = next(k for k, v in cluster_flags.items() if v is not None)
        raise SeqgenError(f"--{given.replace('_', '-')} needs --workers N")
    show_prompt = opts.pop("show_prompt")
    job = job_options(opts, output, shard_spec=shard_spec, verify=verify_inputs, verify_strict=verify_strict)
    checked = check_job(inputs, output, job, model)  # before the (slow) model load and any input read
    spec = generator_spec(model, opts)
    if show_prompt:  # the first input's prompt, as the model gets it
        from seqgen_cli.pipeline.job import first_prompt

        click.echo(first_prompt(spec.build(), checked))
        return
    if workers is not None:  # Ray is imported only here
        from seqgen_cli.pipeline.cluster import ClusterOptions
        from seqgen_cli.pipeline.driver import generate_distributed

        flags = {k: v for k, v in cluster_flags.items() if v is not None}
        summary = generate_distributed(spec, checked, ClusterOptions(workers, **flags))
        max_source_length = (summary.distributed or {}).get("max_source_length")
    else:
        from seqgen_cli.digests import prefetch

        prefetch(model)  # the checkpoint's file digests (the run's identity), hashed while it loads
        gen = spec.build()
        from seqgen_cli.generator import startup_notes

        for note in [] if quiet else startup_notes(gen, spec.generation):
            click.echo(one_line(f"seqgen: note: {note}"), err=True)
        if spec.refill and not gen.refill and not quiet:
            from seqgen_cli.pipeline.messages import no_refill

            click.echo(one_line(no_refill(gen)), err=True)
        summary = generate_job(gen, checked)
        max_source_length = gen.max_source_length
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
    "-i", "--input", "hypotheses", type=click.Path(dir_okay=False, allow_dash=True),
    help="The hypotheses, as sacrebleu takes them: then every FILE is a reference (`seqgen eval REF... -i HYP`).",
)  # fmt: skip
@click.option(
    "--metrics", default=None, help="Comma-separated: rouge, bleu, chrf, chrf++, ter (default: rouge,bleu,chrf)."
)
@click.option("--tokenize", "-tok", help="BLEU's tokenizer, as sacrebleu's (13a, intl, zh, char, none, flores200, ...).")
@click.option("--lowercase", "-lc", is_flag=True, help="BLEU and chrF case-insensitive (TER always is, as TERCOM).")
@click.option("--chrf-word-order", type=click.IntRange(0, 6), default=0, show_default=True, help="2: chrF++.")
@click.option("--force", is_flag=True, help="Score tokenised hypotheses without sacrebleu's warning.")
@click.option(
    "--confidence", type=click.IntRange(min=0), default=0, metavar="N",
    help="Bootstrap N resamples for a 95 % interval of each sacrebleu metric (sacrebleu --confidence-n; 0: off).",
)  # fmt: skip
@click.option(
    "--sentence-scores", type=click.Path(dir_okay=False, allow_dash=True), metavar="FILE",
    help="Write each line's scores as JSONL ({\"line\": 1, \"bleu\": ..., ...}; sentence BLEU with effective "
    "order, as sacrebleu --sentence-level).",
)  # fmt: skip
@click.option(
    "--paired-bs", "baseline", type=click.Path(dir_okay=False, allow_dash=True), metavar="BASELINE",
    help="Test the hypotheses against a baseline system's line-aligned outputs: sacrebleu's paired bootstrap "
    "resampling (1000 resamples), each sacrebleu metric's p-value of the difference (< 0.05 marked *).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of a table.")
def eval_(files: tuple[str, ...], hypotheses: str | None, metrics: str | None, as_json: bool, **settings) -> None:
    """Score hypotheses against one or more line-aligned references (text files; - is stdin):
    `seqgen eval HYP REF [REF...]`, or in sacrebleu's order `seqgen eval REF [REF...] -i HYP`.

    ROUGE-1/2/L/Lsum F1 (rouge-score, Porter stemming; the best reference per line), BLEU, chrF, chrF++ and TER
    (sacrebleu, with its signature; the numbers of its own command line).

    Texts are compared as written, with no Unicode normalisation (neither library offers one): the same
    text in NFC and in NFD (e.g. "é" as one character, or "e" plus a combining accent) scores as different,
    under every metric. Normalise both files the same way first, e.g. with Python's
    unicodedata.normalize("NFC", line).
    """
    from seqgen_cli import metrics as m
    from seqgen_cli.pipeline.evaluate import EvalFiles, evaluate

    more = {"baseline": settings.pop("baseline"), "sentence_scores": settings.pop("sentence_scores")}
    names = m.parse_metrics(metrics)
    result, sentences = evaluate(EvalFiles.of(files, hypotheses, **more), names, m.Options(**settings))
    if sentences is not None:
        click.echo(sentences, nl=False)
    if metrics is None:  # every metric, whatever the task: say so, and how to choose
        click.echo(f"seqgen: scoring {', '.join(names)} (choose with --metrics)", err=True)
    click.echo(json.dumps(result, indent=2) if as_json else m.format_table(result))


@main.command()
def models() -> None:
    """List the model types (config.json's model_type) seqgen runs on its fast decoders, and those it hands to
    transformers generate(); any other model transformers loads runs on the generic backend (exact, slower)."""
    from seqgen_cli.models import family_rows

    rows = family_rows()
    width = max(len(name) for name, _ in rows)
    for name, what in rows:
        click.echo(f"{name:<{width}}  {what}")
    click.echo(f"{'(other)':<{width}}  the generic backend: transformers' forward under seqgen's search")


@main.command()
def presets() -> None:
    """List the task presets (configs/*.toml) and their settings."""
    from seqgen_cli.config import list_presets

    for p in list_presets():
        settings = ", ".join(f"{k}={v}" for k, v in p.generation.items())
        extra = "".join(
            f", {k}={v!r}" for k, v in (("prefix", p.prefix), ("max_source_length", p.max_source_length)) if v
        )
        click.echo(f"{p.name:<14} {p.description}\n{'':<14} {settings}{extra}")


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        items = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not items or min(items) < 1:
        raise click.BadParameter("give positive integers, e.g. 1,8,32")
    return items


def _name_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


@main.command()
@click.argument("input", type=click.Path(exists=True, dir_okay=False))
@click.option("-m", "--model", required=True, help="Checkpoint folder.")
@click.option(
    "--n", "n", type=click.IntRange(min=1), default=32, show_default=True, help="Inputs (first N lines)."
)
@click.option(
    "--batch-sizes", default="1,8,32", show_default=True, callback=_int_list, help="Comma-separated."
)
@click.option("--num-beams", default="1,4", show_default=True, callback=_int_list, help="Comma-separated.")
@click.option(
    "--compare",
    default="hf,ct2",
    show_default=True,
    callback=_name_list,
    help="Systems besides seqgen: hf (transformers generate()), ct2 (CTranslate2, skipped if not installed).",
)
@click.option(
    "--mode",
    "modes",
    default="decode",
    show_default=True,
    callback=_name_list,
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
    "--backend", type=click.Choice(["auto", "fast", "hf"]), default="auto", show_default=True,
    help="seqgen's backend: fast (its engine), hf (generate() inside seqgen's pipeline), auto.",
)  # fmt: skip
@click.option(
    "--target-lang", metavar="CODE", help="As seqgen generate takes it; every system decodes into that language "
    "(generate(): forced_bos_token_id; CTranslate2: the target prefix).",
)  # fmt: skip
@click.option("--seed", type=int, help="Random seed for seqgen's sampling (--do-sample).")
@generation_options(exclude=_BENCH_EXCLUDES)
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

    paths.check_reports(input, opts["out"], BENCH_REPORTS)  # before the (slow) model load
    paths.model_files(model)  # a checkpoint that needs its own code: refused before any baseline loads it
    from seqgen_cli.bench.run import run_bench
    from seqgen_cli.bench.settings import BenchSettings

    generation = _pop_generation(opts, exclude=_BENCH_EXCLUDES)
    settings = BenchSettings(model=model, input=input, generation=generation, **opts)
    command = "seqgen bench " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else ""
    report = run_bench(settings, command=command)
    click.echo(report["table"])
    click.echo(f"seqgen bench: wrote {Path(settings.out) / 'bench.json'}, bench.md, bench.png", err=True)
