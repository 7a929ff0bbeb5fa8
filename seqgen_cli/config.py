"""Generation settings: presets, and how they resolve against a checkpoint's ``generation_config.json``.

Resolution order is transformers' own, with one layer added: the checkpoint's generation config, then
the preset (``--preset``), then explicit flags. A later ``max_new_tokens`` replaces an earlier
``max_length`` (and vice versa), likewise ``min_new_tokens``/``min_length``, so a preset written in
one unit can be overridden in the other.
"""

from __future__ import annotations

import copy
import math
import tomllib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from seqgen_cli.checkpoint import read_json
from seqgen_cli.digests import checkpoint_folder
from seqgen_cli.errors import SeqgenError
from seqgen_cli.languages import resolve_target_lang
from seqgen_cli.search.settings import check_return_sequences, rows_per_input, setting

# The generate() settings seqgen exposes as flags, with transformers' names.
GENERATION_KEYS = (
    "num_beams",
    "max_new_tokens",
    "min_new_tokens",
    "max_length",
    "min_length",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
    "num_return_sequences",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "logprobs",  # seqgen's own (vLLM's name): each token's raw log-prob and the N best (greedy, sampling)
    "stop_token_id",  # seqgen's own (vLLM's stop_token_ids): ids that end an output, beside the EOS ids
)
_DEFAULT_CONFIG = GenerationConfig()
FLAG = "flag"  # the source of a setting given on the command line (or to Generator(...))
CHECKPOINT = "the model's generation_config.json"


@dataclass(frozen=True)
class Rule:
    """What values a generation setting takes: a number of ``kind`` (``bool``: true/false) within bounds."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is not allowed
    also: tuple[Any, ...] = ()  # further values allowed as they are (early_stopping's "never")
    lists: bool = False  # a non-empty list of such values is allowed too (forced_eos_token_id, as generate())

    def problem(self, value: Any) -> str | None:
        """Why ``value`` breaks the rule (None: it does not)."""
        if self.lists:
            values = value if isinstance(value, list | tuple) else [value]
            if values and not any(self._problem(v) for v in values):
                return None
            return f"{self._problem(None)}, or a list of them"
        return self._problem(value)

    def _problem(self, value: Any) -> str | None:
        if isinstance(value, str) and value in self.also:
            return None
        if self.kind is bool:
            return (
                None
                if isinstance(value, bool)
                else "must be true or false" + "".join(f" or {a}" for a in self.also)
            )
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        whole = isinstance(value, int)
        too_low = (
            number and self.low is not None and (value < self.low or (self.low_open and value == self.low))
        )
        too_high = number and self.high is not None and value > self.high
        if not number or (self.kind is int and not whole) or too_low or too_high:
            return f"must be a {'whole' if self.kind is int else 'finite'} number{self._bounds()}"
        return None

    def _bounds(self) -> str:
        low = "" if self.low is None else f"{'>' if self.low_open else '>='} {_number(self.low)}"
        high = "" if self.high is None else f"<= {_number(self.high)}"
        return "" if not (low or high) else " " + " and ".join(x for x in (low, high) if x)


def _number(x: float) -> str:
    """A bound as written: whole numbers in full (2147483647, not 2.14748e+09)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# The most any count or token id may be, from any source. Python, click and TOML integers have no bound; torch's
# sizes are int64: past it torch dies converting a size (c10::ValueError with a C++ frame dump), and below it the
# engine's products of these counts (rows x positions x heads x head size x 4 bytes: one input's caches) overflow
# the storage size. int32's largest is far past any real run (2**31 beams, or tokens of one output) and is what
# CUDA kernels index with; one input's rows x length keeps within it too (_check_rows). Once the model is loaded,
# beams are held to its vocabulary (_check_beams) and lengths to a learned-position table (_check_positions).
MOST = 2**31 - 1
MOST_LOGPROBS = 20  # --logprobs: the best tokens listed per step (vLLM's default bound)

# Every setting of GENERATION_KEYS and its rule: flags, preset files and the checkpoint's generation_config.json
# all go through check_setting.
RULES: dict[str, Rule] = {
    "num_beams": Rule(int, 1, MOST),
    "max_new_tokens": Rule(int, 1, MOST),
    "min_new_tokens": Rule(int, 0, MOST),
    "max_length": Rule(int, 1, MOST),
    "min_length": Rule(int, 0, MOST),
    "length_penalty": Rule(float),
    "early_stopping": Rule(bool, also=("never",)),
    "no_repeat_ngram_size": Rule(int, 0, MOST),
    "num_return_sequences": Rule(int, 1, MOST),
    "do_sample": Rule(bool),
    "temperature": Rule(float, 0, low_open=True),
    "top_k": Rule(int, 0, MOST),
    "top_p": Rule(float, 0, 1, low_open=True),
    "min_p": Rule(float, 0, 1),
    "typical_p": Rule(float, 0, 1, low_open=True),  # 1: off
    "epsilon_cutoff": Rule(float, 0, 1),  # 0 or 1: off
    "eta_cutoff": Rule(float, 0, 1),
    "repetition_penalty": Rule(float, 0, low_open=True),
    # the target language of mBART-50, M2M-100, NLLB (--target-lang)
    "forced_bos_token_id": Rule(int, 0, MOST),
    "forced_eos_token_id": Rule(int, 0, MOST, lists=True),
    "logprobs": Rule(int, 0, MOST_LOGPROBS),
    "stop_token_id": Rule(int, 0, MOST, lists=True),
}
# token ids: below the model's vocabulary
FORCED_TOKEN_KEYS = ("forced_bos_token_id", "forced_eos_token_id", "stop_token_id")
SAMPLING_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
)  # used (so checked in a checkpoint's config) only when sampling


def describe(key: str, value: Any, source: str) -> str:
    """How an error names a setting: ``--num-beams 0`` for a flag, ``my.toml: num_beams = 0`` otherwise."""
    if source == FLAG:
        return f"--{key.replace('_', '-')} {value}"
    return f"{source}: {key} = {value!r}"


def check_setting(key: str, value: Any, source: str) -> None:
    """One-line :class:`SeqgenError` naming the source when ``value`` breaks ``key``'s rule."""
    rule = RULES.get(key)
    problem = rule.problem(value) if rule is not None else None
    if problem is not None:
        raise SeqgenError(f"{describe(key, value, source)}: {problem}")


# Pairs that say the same thing in two units: the later layer's choice wins.
_SAME_LIMIT = {
    "max_new_tokens": "max_length",
    "max_length": "max_new_tokens",
    "min_new_tokens": "min_length",
    "min_length": "min_new_tokens",
}


@dataclass(frozen=True)
class Preset:
    """A task preset: generation settings plus input handling (``configs/NAME.toml``)."""

    name: str
    description: str = ""
    generation: dict[str, Any] = field(default_factory=dict)
    prefix: str | None = None
    max_source_length: int | None = None
    source: str = "preset"  # how errors name it: "preset PATH"


def preset_dirs() -> list[Path]:
    """Where presets live: the installed package's copy, then the source tree's ``configs/``."""
    here = Path(__file__).resolve().parent
    return [d for d in (here / "configs", here.parent / "configs") if d.is_dir()]


def list_presets() -> list[Preset]:
    """All presets, by name (the first directory that defines a name wins)."""
    found: dict[str, Preset] = {}
    for d in preset_dirs():
        for path in sorted(d.glob("*.toml")):
            found.setdefault(path.stem, _read_preset(path))
    return [found[k] for k in sorted(found)]


def load_preset(name: str) -> Preset:
    """A preset by name, or from a ``.toml`` file path."""
    path = Path(name)
    if path.suffix == ".toml":
        if not path.is_file():
            raise SeqgenError(f"preset file {name} does not exist")
        return _read_preset(path)
    for preset in list_presets():
        if preset.name == name:
            return preset
    names = ", ".join(p.name for p in list_presets()) or "none found"
    raise SeqgenError(f"unknown preset {name!r} (available: {names}; or pass a path to a .toml file)")


def _read_preset(path: Path) -> Preset:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise SeqgenError(f"{path}: cannot read preset: {err}") from None
    where = f"preset {path}"
    generation = data.pop("generation", {})
    if not isinstance(generation, dict):
        raise SeqgenError(f"{where}: [generation] must be a table of settings")
    unknown = sorted(set(generation) - set(GENERATION_KEYS))
    if unknown:
        raise SeqgenError(f"{where}: unknown generation setting(s) {', '.join(unknown)}")
    extra = sorted(set(data) - {"description", "prefix", "max_source_length"})
    if extra:
        raise SeqgenError(f"{where}: unknown preset key(s) {', '.join(extra)}")
    for key, value in generation.items():
        check_setting(key, value, where)
    for key in ("description", "prefix"):
        if not isinstance(data.get(key, ""), str):
            raise SeqgenError(f"{describe(key, data[key], where)}: must be a string")
    limit = data.get("max_source_length")
    if limit is not None and Rule(int, 1).problem(limit):
        raise SeqgenError(f"{describe('max_source_length', limit, where)}: {Rule(int, 1).problem(limit)}")
    return Preset(
        name=path.stem,
        description=data.get("description", ""),
        generation=generation,
        prefix=data.get("prefix"),
        max_source_length=limit,
        source=where,
    )


def resolve_generation_config(
    base: GenerationConfig,
    preset: Preset | None = None,
    flags: dict[str, Any] | None = None,
    is_encoder_decoder: bool | None = None,
    vocab_size: int | None = None,
    positions: tuple[str, int] | None = None,
) -> GenerationConfig:
    """Checkpoint config, then preset, then explicit settings.

    The one merge of generation settings: the app, the tests and the scripts all use it. ``flags``: the
    settings given, any ``GenerationConfig`` field (the CLI exposes :data:`GENERATION_KEYS`); user input,
    where ``None`` means "not given", goes through :func:`check_flags` first. A layer that gives both units
    of a limit keeps both, and ``max_new_tokens``/``min_new_tokens`` win, as in ``generate()``. Raises
    ``SeqgenError`` for settings transformers rejects, and (``vocab_size``: the model's) for a forced token id
    of a flag or preset that is not a token of the model or more beams than its tokens, and (``positions``:
    :func:`~seqgen_cli.models.families.decoder_table`) for a length past a learned-position model's positions.
    """
    config = copy.deepcopy(base)
    source = {k: CHECKPOINT for k in RULES if getattr(base, k, None) is not None}
    given: set[str] = set()
    layers = ((preset.generation, preset.source) if preset else ({}, ""), (flags or {}, FLAG))
    for layer, where in layers:
        for key, value in layer.items():
            other = _SAME_LIMIT.get(key)
            if other is not None and other not in layer:
                setattr(config, other, getattr(_DEFAULT_CONFIG, other))
                given.discard(other)
                source.pop(other, None)
            setattr(config, key, value)
            given.add(key)
            source[key] = where
    if config.early_stopping is not None and config.num_beams in (None, 1):
        config.early_stopping = None  # a beam-only setting from a checkpoint/preset; harmless for greedy
        source.pop("early_stopping", None)
    for key, where in source.items():  # flags and presets were checked as they came; the checkpoint's now
        if where == CHECKPOINT and (key not in SAMPLING_KEYS or config.do_sample):
            check_setting(key, getattr(config, key), where)
    _check_lengths(config, source, is_encoder_decoder)
    if vocab_size is not None:
        _check_token_ids(config, source, vocab_size)
        _check_beams(config, source, vocab_size)
    if positions is not None and is_encoder_decoder is not None:
        _check_positions(config, source, is_encoder_decoder, positions)
    _check_rows(config, source)
    _validate(config, given)
    return config


def _check_rows(config: GenerationConfig, source: dict[str, str]) -> None:
    """One input's rows (beams, or sampled sequences) x its length limit within :data:`MOST`: each may be within
    it alone while their product, which sizes the input's caches (x heads x head size x 4 bytes), overflows torch's
    storage size ("Storage size calculation overflowed")."""
    rows_key = "num_beams" if rows_per_input(config) == (config.num_beams or 1) else "num_return_sequences"
    length_key = "max_new_tokens" if config.max_new_tokens is not None else "max_length"
    rows, length = getattr(config, rows_key), getattr(config, length_key)
    if isinstance(rows, int) and isinstance(length, int) and rows * length > MOST:
        raise SeqgenError(
            f"{describe(rows_key, rows, source.get(rows_key, CHECKPOINT))} with "
            f"{describe(length_key, length, source.get(length_key, CHECKPOINT))}: one input would run "
            f"{rows * length} tokens (rows x length), more than {MOST}"
        )


def _check_beams(config: GenerationConfig, source: dict[str, str], vocab_size: int) -> None:
    """At most as many beams as the model has tokens, from any source: beam search keeps ``num_beams`` different
    continuations, and after the first step there are only ``vocab_size`` of them (the rest would run on as
    impossible, -inf scored rows, each a full row of the model's work)."""
    num_beams = config.num_beams
    if isinstance(num_beams, int) and num_beams > vocab_size:
        raise SeqgenError(
            f"{describe('num_beams', num_beams, source.get('num_beams', CHECKPOINT))}: must be <= {vocab_size}, "
            "the model's vocabulary (beam search keeps that many different continuations at most)"
        )


def _check_positions(
    config: GenerationConfig, source: dict[str, str], is_encoder_decoder: bool, positions: tuple[str, int]
) -> None:
    """The length limit in force (``max_new_tokens``, else ``max_length``), from any source, within the positions
    of a model that looks them up in a table of ``positions = (config field, size)``: past it the model dies with
    ``IndexError: index out of range in self``. The model runs on the decoder start token (encoder-decoder) or the
    prompt (decoder-only, at least one token: :func:`~seqgen_cli.loading.source_limit` cuts it to make room) and
    every new token but the last, so ``size`` new tokens fit, and ``size + 1`` tokens counted as ``max_length``
    counts them."""
    field, size = positions
    key = "max_new_tokens" if config.max_new_tokens is not None else "max_length"
    value = getattr(config, key)
    most = size if key == "max_new_tokens" else size + 1
    if isinstance(value, int) and value > most:
        model = f"the model has {size} {'decoder ' if is_encoder_decoder else ''}positions"
        runs = "the start token" if is_encoder_decoder else "the prompt"
        raise SeqgenError(
            f"{describe(key, value, source.get(key, CHECKPOINT))}: must be <= {most}: {model} ({field} in its "
            f"config.json) and runs on {runs} and every new token but the last"
        )


def _check_token_ids(config: GenerationConfig, source: dict[str, str], vocab_size: int) -> None:
    """A forced token id given by a flag or preset must be a token of the model (``generate()`` fails with an
    index error at the step that forces it; a checkpoint's own value is left as it runs)."""
    for key in FORCED_TOKEN_KEYS:
        value, where = getattr(config, key, None), source.get(key)
        ids = value if isinstance(value, list | tuple) else [value]
        if where not in (None, CHECKPOINT) and any(isinstance(i, int) and i >= vocab_size for i in ids):
            raise SeqgenError(
                f"{describe(key, value, where)}: not a token of the model (its vocabulary has {vocab_size} tokens)"
            )


def _check_lengths(config: GenerationConfig, source: dict[str, str], is_encoder_decoder: bool | None) -> None:
    """A fewest-tokens flag (or a preset's, beside its own most-tokens setting) that the most-tokens setting
    leaves no room for (others, e.g. a preset's minimum under a --max-new-tokens flag, run as ``generate()``
    runs them: every output at the maximum). ``*_length`` counts the decoder start token of an
    encoder-decoder model and the prompt of a decoder-only one, so across units only the former compares."""

    def limit(kind: str) -> tuple[str, int, bool] | None:  # (key, value, counted in new tokens)
        key = f"{kind}_new_tokens"
        if getattr(config, key) is None:
            key = f"{kind}_length"
        value = getattr(config, key)
        return None if value is None else (key, value, key.endswith("new_tokens"))

    most, fewest = limit("max"), limit("min")
    if most is None or fewest is None:
        return
    chosen = source.get(fewest[0])  # a flag, or a preset's minimum beside its own maximum
    if chosen != FLAG and (chosen in (None, CHECKPOINT) or chosen != source.get(most[0])):
        return
    (high_key, high, high_new), (low_key, low, low_new) = most, fewest
    if high_new != low_new:
        if not is_encoder_decoder:
            return
        high, low = (high, low - 1) if high_new else (high - 1, low)
    if low > high:
        raise SeqgenError(
            f"{describe(low_key, getattr(config, low_key), source[low_key])} cannot be reached under "
            f"{describe(high_key, getattr(config, high_key), source.get(high_key, CHECKPOINT))}: "
            "lower the one or raise the other"
        )


def settings_for_model(
    model: Any, tokenizer: Any, preset: Preset | None, flags: dict[str, Any], target_lang: str | None = None
) -> GenerationConfig:
    """A loaded model's settings: its ``generation_config``, then ``preset``, then ``flags`` (checked by
    :func:`check_flags`), ``target_lang`` resolved through ``tokenizer`` over any ``forced_bos_token_id``; forced
    ids and beams checked against the rows of the model's lm head, lengths against its position table (if any)."""
    from seqgen_cli.models.families import decoder_table

    if target_lang is not None:  # a flag: over the checkpoint's and the preset's forced_bos_token_id
        flags = {**flags, "forced_bos_token_id": resolve_target_lang(tokenizer, target_lang)}
    head = model.get_output_embeddings()  # the ids the model can score: its lm head's rows
    vocab_size = getattr(head, "out_features", None) or getattr(model.config, "vocab_size", None)
    config = resolve_generation_config(
        model.generation_config, preset, flags, model.config.is_encoder_decoder, vocab_size=vocab_size,
        positions=decoder_table(model.config),
    )  # fmt: skip
    return with_stop_tokens(config)


def with_stop_tokens(config: GenerationConfig) -> GenerationConfig:
    """``stop_token_id`` (``--stop-token-id``, a preset's) added to the EOS ids, so that every engine, and
    ``generate()``, ends an output there: ``generate(eos_token_id=[...])``'s outputs."""
    extra = getattr(config, "stop_token_id", None)
    if not extra:
        return config
    eos = config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    config.eos_token_id = ids + [i for i in ([extra] if isinstance(extra, int) else extra) if i not in ids]
    return config


def default_length(config: GenerationConfig) -> int | None:
    """The new tokens of transformers' model-agnostic default (20) where it is the limit in force: neither the
    checkpoint's generation_config.json, a preset nor a flag set ``max_length`` or ``max_new_tokens``; else
    ``None``. Outputs that stop there were cut short without the user choosing it (``generate()`` warns; seqgen
    says so at the end, naming the flag)."""
    if config.max_length is None and config.max_new_tokens is None:
        return int(setting(config, "max_length"))
    return None


# transformers' StopStringCriteria builds tables over the whole vocabulary for each stop string: about 55 ms a
# string on GPT-2's 50k tokens, so 1000 strings take a minute before the first input. More than any stop list
# in use needs.
MOST_STOPS = 64


def check_stop_strings(value: Any, source: str) -> list[str]:
    """``stop_strings`` (a string or a list of strings, as ``generate()`` takes them) as a list; one line naming
    the source for anything else: an empty string (it would stop nothing), a dict, a number, a nested list, more
    than :data:`MOST_STOPS`."""
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise SeqgenError(f"{describe('stop_strings', value, source)}: must be a string or a list of strings")
    if any(v == "" for v in values):
        what = "--stop ''" if source == FLAG else describe("stop_strings", value, source)
        raise SeqgenError(f"{what}: an empty stop string stops nothing: drop it")
    if len(values) > MOST_STOPS:
        raise SeqgenError(f"{len(values)} stop strings: at most {MOST_STOPS} (each costs a pass over the vocabulary)")
    return values


def all_stops(own: Any, stop: Sequence[str]) -> list[str] | None:
    """The checkpoint's ``stop_strings``, then ``--stop``'s (None: none)."""
    return check_stop_strings([*check_stop_strings(own, CHECKPOINT), *stop], FLAG) or None


def check_checkpoint(model: str, preset: Preset | None, flags: dict[str, Any], stop: Sequence[str] = ()) -> None:
    """``--stop`` (``stop``), and the checkpoint's ``generation_config.json`` settings the run uses (those no preset
    or flag replaces), checked before its weights are read, each error naming the file: what
    :func:`resolve_generation_config` checks after the load, plus ``stop_strings``."""
    check_stop_strings(list(stop), FLAG)
    folder = checkpoint_folder(model)
    path = folder / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return
    data = read_json(path, model)
    if not isinstance(data, dict):
        raise SeqgenError(f"{path}: not a JSON object of generation settings")
    given = {*(preset.generation if preset else {}), *flags}
    given |= {_SAME_LIMIT[k] for k in given if k in _SAME_LIMIT}  # a limit in one unit replaces the other
    merged = {**data, **(preset.generation if preset else {}), **flags}
    for key, value in data.items():
        if key in given or key not in RULES or value is None:
            continue
        if (key in SAMPLING_KEYS and not merged.get("do_sample")) or (key == "early_stopping" and merged.get("num_beams", 1) == 1):
            continue  # unused (resolve_generation_config drops them too)
        check_setting(key, value, str(path))
    check_stop_strings(data.get("stop_strings"), str(path))


def check_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """The settings a user gave (values not ``None``), checked before the (slow) model load: unknown names
    and two units of one limit are errors."""
    flags = {k: v for k, v in flags.items() if v is not None}
    unknown = sorted(k for k in flags if k not in GENERATION_KEYS and not hasattr(_DEFAULT_CONFIG, k))
    if unknown:
        raise SeqgenError(f"unknown generation setting(s) {', '.join(unknown)}")
    for a, b in (("max_new_tokens", "max_length"), ("min_new_tokens", "min_length")):
        if a in flags and b in flags:
            raise SeqgenError(f"--{a.replace('_', '-')} and --{b.replace('_', '-')} contradict; give one")
    if flags.get("temperature") == 0:  # greedy search, as vLLM and llama.cpp read it (generate() refuses it)
        if flags.get("do_sample"):
            raise SeqgenError("--temperature 0 is greedy search and --do-sample samples: give one")
        flags = {**{k: v for k, v in flags.items() if k != "temperature"}, "do_sample": False}
    for key, value in flags.items():
        check_setting(key, value, FLAG)
    return flags


def _validate(config: GenerationConfig, given: set[str]) -> None:
    """Turn transformers' validation of the settings the user gave into one-line errors."""
    check_return_sequences(config)  # before transformers' own check, for the flags' names in the message
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config.validate(strict=True, user_set_attributes=given)
        except ValueError as err:
            lines = [ln.strip("- ").strip() for ln in str(err).splitlines()]
            problems = [ln for ln in lines if ln.startswith("`")]
            raise SeqgenError("invalid generation settings: " + "; ".join(problems or lines[:1])) from None
