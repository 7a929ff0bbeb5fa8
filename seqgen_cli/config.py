"""Generation settings resolved against a checkpoint: its ``generation_config.json``, then the preset, then the
flags, each checked by :mod:`seqgen_cli.rules` and the whole against the loaded model.

Resolution order is transformers' own, with one layer added: the checkpoint's generation config, then
the preset (``--preset``), then explicit flags. A later ``max_new_tokens`` replaces an earlier
``max_length`` (and vice versa), likewise ``min_new_tokens``/``min_length``, so a preset written in
one unit can be overridden in the other.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

from transformers import GenerationConfig

from seqgen_cli.checkpoint import read_json
from seqgen_cli.digests import checkpoint_folder
from seqgen_cli.errors import SeqgenError
from seqgen_cli.languages import resolve_target_lang
from seqgen_cli.loading import context_length
from seqgen_cli.models.families import decoder_table
from seqgen_cli.presets import Preset
from seqgen_cli.rules import (
    CHECKPOINT,
    FLAG,
    FORCED_TOKEN_KEYS,
    GENERATION_KEYS,
    MOST,
    RULES,
    SAME_LIMIT,
    SAMPLING_KEYS,
    check_setting,
    describe,
)
from seqgen_cli.search.settings import check_return_sequences, rows_per_input, setting
from seqgen_cli.stops import check_stop_strings, with_stop_tokens

_DEFAULT_CONFIG = GenerationConfig()


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
            other = SAME_LIMIT.get(key)
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
    if target_lang is not None:  # a flag: over the checkpoint's and the preset's forced_bos_token_id
        flags = {**flags, "forced_bos_token_id": resolve_target_lang(tokenizer, target_lang)}
    head = model.get_output_embeddings()  # the ids the model can score: its lm head's rows
    vocab_size = getattr(head, "out_features", None) or getattr(model.config, "vocab_size", None)
    config = resolve_generation_config(
        model.generation_config,
        preset,
        flags,
        model.config.is_encoder_decoder,
        vocab_size=vocab_size,
        positions=decoder_table(model.config),
    )
    return with_stop_tokens(config)


CHAT_NEW_TOKENS = 1024  # --chat's new-token limit where none is set (at most half the model's context)


def chat_length(config: GenerationConfig, model_config: Any, chat: bool) -> int | None:
    """``--chat``'s limit where none is set (:func:`default_length`: transformers' 20 cuts an LLM's answer short):
    :data:`CHAT_NEW_TOKENS` new tokens, at most half the model's context (the prompt keeps the rest), so that an
    answer ends at its end of turn; set as ``config.max_new_tokens`` and returned (``None``: no ``--chat``, or a
    limit set by the checkpoint, a preset or a flag)."""
    if not chat or default_length(config) is None:
        return None
    context = context_length(model_config)
    config.max_new_tokens = min(CHAT_NEW_TOKENS, context // 2) if context else CHAT_NEW_TOKENS
    return config.max_new_tokens


def default_length(config: GenerationConfig) -> int | None:
    """The new tokens of transformers' model-agnostic default (20) where it is the limit in force: neither the
    checkpoint's generation_config.json, a preset nor a flag set ``max_length`` or ``max_new_tokens``; else
    ``None``. Outputs that stop there were cut short without the user choosing it (``generate()`` warns; seqgen
    says so at the end, naming the flag)."""
    if config.max_length is None and config.max_new_tokens is None:
        return int(setting(config, "max_length"))
    return None


def check_checkpoint(
    model: str, preset: Preset | None, flags: dict[str, Any], stop: Sequence[str] = ()
) -> None:
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
    given |= {SAME_LIMIT[k] for k in given if k in SAME_LIMIT}  # a limit in one unit replaces the other
    merged = {**data, **(preset.generation if preset else {}), **flags}
    for key, value in data.items():
        if key in given or key not in RULES or value is None:
            continue
        if (key in SAMPLING_KEYS and not merged.get("do_sample")) or (
            key == "early_stopping" and merged.get("num_beams", 1) == 1
        ):
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
