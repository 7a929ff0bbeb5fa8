"""Click option declarations that ``cli.py``'s commands share or that would crowd it: the generation flags'
table (``generate`` and ``bench``), their callbacks, and ``generate``'s groups of options. Click only, as
``cli.py``."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple, TypeVar

import click

from seqgen_cli.rules import GENERATION_KEYS

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


# The generation flags, keyed by transformers' names: the keys of seqgen_cli.rules.GENERATION_KEYS, in its
# order (tests/cli/test_cli.py checks the two agree). Every value reaches Generator(**flags) unchanged,
# --early-stopping through its callback; their ranges are checked there (seqgen_cli.rules), as a preset's and
# a checkpoint's are, not by click.
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
    "temperature": _flag(
        float, "Sampling temperature (> 0); 0: greedy search, as vLLM and llama.cpp read it."
    ),
    "top_k": _flag(int, "Sample among the k most likely tokens (0 = all)."),
    "top_p": _flag(float, "Sample within the top-p probability mass (0 < p <= 1)."),
    "min_p": _flag(float, "Sample among tokens at least this fraction of the best one's probability (0-1)."),
    "typical_p": _flag(
        float, "Typical sampling: the tokens nearest the entropy, up to this mass (0 < p <= 1)."
    ),
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
        "tokens of its step (0-20), as vLLM gives them; implies --scores.",
    ),
    "stop_token_id": _flag(
        int,
        "End an output at this token id too, beside the model's EOS ids (repeatable; vLLM's stop_token_ids): "
        "kept in the output unless a special token, as EOS is.",
        multiple=True,
        callback=_given_ids,
    ),
}
# Not bench flags: --num-beams is bench's own comma-separated list; bench times one searched output per input.
BENCH_EXCLUDES = ("num_beams", "num_return_sequences", "logprobs")


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


def pop_generation(opts: dict[str, Any], exclude: Collection[str] = ()) -> dict[str, Any]:
    """Take the generation flags (``GENERATION_KEYS`` but ``exclude``) out of a command's options."""
    return {k: opts.pop(k) for k in GENERATION_KEYS if k not in exclude and k in opts}


def parse_verify(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int | None, bool]:
    """``--verify``: (inputs, strict); ``(None, False)``: the device's default."""
    if value is None:
        return None, False
    if value == "strict":
        from seqgen_cli.verify import VERIFY_INPUTS  # (torch, transformers: only when asked)

        return VERIFY_INPUTS, True
    if not value.isdigit():
        raise click.BadParameter(f"{value!r}: give a number of inputs or strict", param_hint="'--verify'")
    return int(value), False


def int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """``--batch-sizes 1,8,32``: positive integers."""
    try:
        items = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not items or min(items) < 1:
        raise click.BadParameter("give positive integers, e.g. 1,8,32")
    return items


def name_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """``--compare hf,ct2``: the names, blanks dropped."""
    return [x.strip() for x in value.split(",") if x.strip()]


def option_group(*options: Callable[[F], F]) -> Callable[[F], F]:
    """Several options as one decorator, listed (and shown in ``--help``) in the order given."""

    def decorate(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


# `seqgen generate`'s model and device: --preset, --backend, --device, --dtype, --capture, --verify.
MODEL_OPTIONS = option_group(
    click.option("--preset", help="Task preset name (see `seqgen presets`) or a .toml file."),
    click.option(
        "--backend",
        type=click.Choice(["auto", "fast", "hf"]),
        default="auto",
        show_default=True,
        help="fast: seqgen's engine; hf: transformers generate(); auto: fast where supported.",
    ),
    click.option(
        "--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto (first GPU if any)."
    ),
    click.option(
        "--dtype",
        type=click.Choice(["auto", "float32", "float16", "bfloat16", "int8"]),
        default="auto",
        show_default=True,
        help="auto: float32 on CPU, bfloat16 (else float16) on GPU. int8 (CPU only): float32 weights, linear "
        "layers in int8 (dynamic quantization; not exact).",
    ),
    click.option(
        "--capture/--no-capture",
        default=None,
        help="On CUDA, replay the fast engine's decode step as CUDA graphs (torch.compile reduce-overhead, "
        "one graph per batch shape and attended span). Default: a shape is compiled once the steps it ran "
        "eagerly would have saved what compiling it costs (~14 s a graph; until then its batches run as "
        "with --no-capture), so short runs compile little; --capture compiles every shape at once, "
        "--no-capture never. The closing line and --stats name the step path.",
    ),
    click.option(
        "--verify",
        "verify_spec",
        metavar="N|strict",
        callback=parse_verify,
        help="Before the run, generate the first N inputs with seqgen and with transformers generate() on "
        "the same device and dtype and report the token-identical share (near-ties named) in the closing "
        "line and --stats; strict: 8 inputs, and stop before writing when they differ beyond near-ties. 0: "
        "off. Default: 8 on CUDA, off on the CPU.",
    ),
)


# `seqgen generate`'s prompt: --prefix, --chat and its settings, --prompt-template, --show-prompt.
PROMPT_OPTIONS = option_group(
    click.option("--prefix", help="Text prepended to every input, e.g. 'summarize: ' for T5."),
    click.option(
        "--chat",
        is_flag=True,
        help="Each input is the user message of the tokenizer's chat template, the assistant's turn opened "
        '(as apply_chat_template(add_generation_prompt=True)); a JSONL object\'s "messages" list is the '
        'conversation as given (its "tools" too), one ending in an assistant message continued from it. The '
        "output is the assistant's text.",
    ),
    click.option(
        "--system-prompt",
        metavar="TEXT|@FILE",
        help='The system message (implies --chat); a "messages" '
        "conversation with a system message of its own keeps that one.",
    ),
    click.option(
        "--chat-template",
        metavar="FILE|@FILE|TEXT",
        help="A Jinja chat template (a file, or the template's text), "
        "for a tokenizer without one or to replace its own (implies --chat).",
    ),
    click.option(
        "--chat-template-kwargs",
        metavar="JSON",
        help="Switches of the chat template, e.g. '{\"enable_thinking\": false}'.",
    ),
    click.option(
        "--prompt-template",
        metavar="TEXT|@FILE",
        help="The prompt with {input} where the input goes and, for JSONL input, {field} for a field of its "
        "object (other braces stay as written); with --chat, the user message. --max-source-length shortens "
        "the input inside it, never the template.",
    ),
    click.option(
        "--show-prompt",
        is_flag=True,
        help="Print the first input's prompt as the model gets it, and its token count; generate nothing.",
    ),
)


# Where `seqgen generate`'s outputs end and what they may be: --stop, the structured-output grammars.
OUTPUT_RULE_OPTIONS = option_group(
    click.option(
        "--stop",
        "stop",
        multiple=True,
        metavar="STRING",
        help="End an output where its text reaches STRING, as generate(stop_strings=...); the text written "
        "ends before it (as vLLM and llama.cpp write it; --keep-stop keeps it). Repeatable, beside the "
        "checkpoint's stop_strings. In text output a newline inside an output is written as a space.",
    ),
    click.option(
        "--keep-stop",
        is_flag=True,
        help="Write the stop string that ended an output too (transformers' decoded text; vLLM's "
        "include_stop_str_in_output).",
    ),
    click.option(
        "--reasoning",
        type=click.Choice(["keep", "strip", "field"]),
        default="keep",
        show_default=True,
        help="A thinking model's <think>...</think> before its answer (Qwen3, QwQ, DeepSeek-R1): keep it in "
        'the output, strip it, or write it in a JSONL "reasoning" field (with --output-format jsonl).',
    ),
    click.option(
        "--json-schema",
        metavar="FILE|@FILE|JSON",
        help="Structured output: every output a JSON value of this JSON schema (a file, or the schema "
        "itself), on one line as json.dumps writes it; an output cut short by --max-new-tokens is counted "
        'at the end and, in JSONL output, marked "complete": false. Also --regex, --grammar, --choice (one '
        "of the four).",
    ),
    click.option(
        "--regex",
        metavar="PATTERN",
        help="Structured output: every output a match of PATTERN (Rust regex syntax).",
    ),
    click.option(
        "--grammar",
        metavar="FILE|@FILE",
        help="Structured output: every output a sentence of this GBNF (llama.cpp) or Lark grammar file.",
    ),
    click.option(
        "--choice",
        "choice",
        multiple=True,
        metavar="TEXT",
        help="Structured output: every output one of these texts (repeat: --choice positive --choice "
        "negative).",
    ),
)


# `seqgen generate`'s input and output formats: --input-format, --input-field, --output-format, ...
FORMAT_OPTIONS = option_group(
    click.option(
        "--input-format",
        type=click.Choice(["auto", "text", "jsonl"]),
        default="auto",
        show_default=True,
        help="auto: by extension (.jsonl/.json: JSONL; .txt, .src, ...: text), else JSONL when the first "
        "line is a JSON object (stdin, other extensions).",
    ),
    click.option(
        "--input-field",
        help="JSONL field holding the input (default: text, src, source or input); an error for text input.",
    ),
    click.option(
        "--output-format",
        type=click.Choice(["text", "jsonl"]),
        default="text",
        show_default=True,
        help="text: one line per output; jsonl: the input object plus the output field.",
    ),
    click.option(
        "--output-field", default="output", show_default=True, help="JSONL field the output is written to."
    ),
    click.option(
        "--scores",
        is_flag=True,
        help="Give each output its score and the summed log-probability of its tokens (generate()'s "
        "sequences_scores for beam search, length-penalised; greedy and sampling: the log-probability): "
        'JSONL output gets "score", "log_prob" and "token_log_probs" (each token\'s) fields, text '
        "output lines begin SCORE<TAB>LOG_PROB<TAB> (cut -f3- gives the text).",
    ),
)


# `seqgen generate` in many processes: --workers and its Ray cluster, --shard.
WORKERS_OPTIONS = option_group(
    click.option(
        "--workers",
        type=click.IntRange(min=1),
        help="Run on N Ray workers (each loads the model once and takes shards of the input as it frees up); "
        "the output is the same as one process writes. Needs the ray extra.",
    ),
    click.option(
        "--address",
        help="With --workers: the Ray cluster to join (auto, or HOST:PORT); default: a local one.",
    ),
    click.option(
        "--gpus-per-worker", type=click.FloatRange(min=0), help="With --workers: GPUs per worker (default 0)."
    ),
    click.option(
        "--cpus-per-worker",
        type=click.FloatRange(min=0, min_open=True),
        help="With --workers: CPUs per worker (default 1; also its torch threads on CPU).",
    ),
    click.option(
        "--shard-size",
        type=click.IntRange(min=1),
        help="With --workers: inputs per shard, the unit a worker takes, retries and the driver merges "
        "(default: 4096, fewer for small inputs).",
    ),
    click.option(
        "--shard",
        "shard_spec",
        metavar="I/N|auto",
        help="Run only shard I (from 0) of N contiguous shards of the input, for other launchers (SLURM "
        "arrays, torchrun); auto: I/N from RANK/WORLD_SIZE. Join the outputs with `seqgen merge`.",
    ),
)
