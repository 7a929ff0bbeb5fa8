"""Resolve a merged ``transformers.GenerationConfig`` into the plain settings the search loops run on.

The merge (checkpoint config, preset, user settings) is :func:`seqgen_cli.config.resolve_generation_config`.
:func:`resolve_settings` then does what ``GenerationMixin.generate()`` does next: global defaults for
``None`` fields, special tokens (``_prepare_special_tokens``), ``max_length``/``min_length``
(:func:`length_limits`, as ``_prepare_generated_length``) and the generation mode. Anything seqgen does not
implement raises :class:`SeqgenError`, so the caller can fall back to ``model.generate()``. It runs per
batch, because lengths depend on the batch's prompt width.

This module is the one home of these rules; the rest of the package asks it: rows per input
(:func:`rows_per_input`), outputs per input (:func:`num_return_sequences`), the new-token limits
(:func:`new_token_limits`) and the return-sequences rule (:func:`check_return_sequences`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import GenerationConfig

from seqgen_cli.errors import SeqgenError

Mode = Literal["greedy", "beam", "sample"]

# transformers' GenerationConfig._get_default_generation_params(), for the fields we use.
_DEFAULTS: dict[str, Any] = {
    "max_length": 20,
    "min_length": 0,
    "do_sample": False,
    "early_stopping": False,
    "num_beams": 1,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "num_return_sequences": 1,
}

# Fields whose non-default value selects something seqgen does not implement: name -> "is unsupported" test.
_UNSUPPORTED: dict[str, Any] = {
    "constraints": lambda v: v is not None,
    "force_words_ids": lambda v: v is not None,
    "num_beam_groups": lambda v: v is not None and v > 1,
    "diversity_penalty": lambda v: v is not None and v != 0.0,
    "penalty_alpha": lambda v: v is not None and v > 0,
    "sequence_bias": lambda v: v is not None,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "guidance_scale": lambda v: v is not None and v != 1,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "remove_invalid_values": lambda v: bool(v),
    "watermarking_config": lambda v: v is not None,
    "max_time": lambda v: v is not None,
    "top_h": lambda v: v is not None,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "assistant_early_exit": lambda v: v is not None,
    "use_mtp": lambda v: bool(v),
    "token_healing": lambda v: bool(v),
    "low_memory": lambda v: bool(v),
    "prefill_chunk_size": lambda v: v is not None,
}


@dataclass(frozen=True)
class SearchSettings:
    """Everything a search loop needs, in transformers' conventions.

    Lengths count decoder positions like transformers' ``cur_len``: the prompt (decoder-only, padded width)
    or the decoder start token (encoder-decoder) included.
    """

    mode: Mode
    num_beams: int
    num_return_sequences: int
    prompt_len: int  # decoder positions before the first generated token (1 for encoder-decoder)
    max_length: int  # generation stops when cur_len reaches this
    min_length: int  # EOS is masked while cur_len < min_length
    eos: tuple[int, ...]
    pad: int | None
    decoder_start: int | None
    forced_bos: int | None
    forced_eos: tuple[int, ...]
    bad_words: tuple[tuple[int, ...], ...]
    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    begin_index: int  # cur_len at which begin_suppress_tokens apply
    repetition_penalty: float
    renormalize_logits: bool  # log_softmax after every processor (transformers' LogitNormalization)
    no_repeat_ngram_size: int
    length_penalty: float
    early_stopping: bool | str
    temperature: float
    top_k: int
    top_p: float
    min_p: float | None = None  # sampling's later warpers, as transformers orders them (None / 1 / 0: off)
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    scores: bool = False  # greedy and sampling sum each row's log-probs (``output_scores``; beam search always)
    logprobs: int | None = None  # each token's raw log-prob and the N best ones (--logprobs N)

    @property
    def max_new_tokens(self) -> int:
        return self.max_length - self.prompt_len


def setting(config: GenerationConfig, name: str) -> Any:
    """``config``'s value of ``name``, or ``generate()``'s default where it is unset."""
    value = getattr(config, name, None)
    return _DEFAULTS.get(name) if value is None else value


def _token_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _decoder_positions(is_encoder_decoder: bool, prompt_len: int) -> int:
    """Decoder positions before the first generated token: the decoder start token (encoder-decoder), or
    the prompt of ``prompt_len`` tokens (decoder-only)."""
    return 1 if is_encoder_decoder else prompt_len


def num_return_sequences(config: GenerationConfig) -> int:
    """Outputs per input."""
    return setting(config, "num_return_sequences")


def rows_per_input(config: GenerationConfig) -> int:
    """Rows the model runs per input: the beams, or the returned sequences when more (sampling)."""
    return max(setting(config, "num_beams"), num_return_sequences(config))


def check_return_sequences(config: GenerationConfig) -> None:
    """Without sampling, an input returns at most ``num_beams`` sequences (:class:`SeqgenError` otherwise)."""
    nrs, num_beams = num_return_sequences(config), setting(config, "num_beams")
    if nrs > num_beams and not setting(config, "do_sample"):
        raise SeqgenError(
            f"--num-return-sequences {nrs} needs at least as many beams (--num-beams is {num_beams})"
        )


def new_token_limits(
    config: GenerationConfig, is_encoder_decoder: bool, prompt_len: int = 0
) -> tuple[int, int]:
    """``(most, fewest)`` new tokens for a prompt of ``prompt_len`` tokens (ignored for encoder-decoder
    models), never negative: :func:`length_limits` less the decoder positions before the first new token."""
    positions = _decoder_positions(is_encoder_decoder, prompt_len)
    max_length, min_length = length_limits(config, positions)
    return max(0, max_length - positions), max(0, min_length - positions)


def length_limits(
    config: GenerationConfig, prompt_len: int, max_position_embeddings: int | None = None
) -> tuple[int, int]:
    """``(max_length, min_length)`` in decoder positions, as ``_prepare_generated_length`` resolves them.

    ``max_new_tokens`` wins over ``max_length``; an unset ``max_length`` means 20 new tokens (capped by the
    model's positions); ``min_new_tokens`` replaces ``min_length``, even one from the checkpoint's config.
    """
    if config.max_new_tokens is not None:
        max_length = config.max_new_tokens + prompt_len
    elif config.max_length is None:
        max_length = _DEFAULTS["max_length"] + prompt_len
        if max_position_embeddings is not None:
            max_length = min(max_length, max_position_embeddings)
    else:
        max_length = config.max_length
    min_length = setting(config, "min_length")
    if config.min_new_tokens is not None:
        min_length = config.min_new_tokens + prompt_len
    return max_length, min_length


def _no_room(max_length: int, positions: int, is_encoder_decoder: bool) -> None:
    """:class:`SeqgenError` where ``max_length`` leaves no new token after ``positions`` decoder positions (the
    prompt's padded width, or the decoder start token): ``generate()`` raises a ValueError there."""
    if max_length > positions:
        return
    what = f"this input's {positions} prompt positions (padded)"
    what = "the decoder start token" if is_encoder_decoder else what
    raise SeqgenError(
        f"max_length ({max_length}) leaves no room to generate after {what}: --max-length counts the prompt; "
        "--max-new-tokens counts new tokens only"
    )


def check_room(config: GenerationConfig, is_encoder_decoder: bool, prompt_len: int) -> None:
    """The length limits' check of :func:`resolve_settings` for ``generate()``'s own path (``--backend hf``), so
    that a ``max_length`` below a prompt is the same one line on every backend."""
    positions = _decoder_positions(is_encoder_decoder, prompt_len)
    _no_room(length_limits(config, positions)[0], positions, is_encoder_decoder)


def need_stop(config: GenerationConfig, stop: object) -> None:
    """``config``'s ``stop_strings`` need their check (built from the tokenizer): an error where none is given, so
    that no caller runs past a stop string unawares."""
    if config.stop_strings and stop is None:
        raise SeqgenError("stop_strings need the tokenizer's stop check (prompts.stop_check) passed as stop=")


def resolve_mode(config: GenerationConfig) -> Mode:
    """Greedy / beam / sample, or :class:`SeqgenError` for what seqgen leaves to transformers."""
    for name, unsupported in _UNSUPPORTED.items():
        if unsupported(getattr(config, name, None)):
            raise SeqgenError(
                f"generation option {name}={getattr(config, name)!r} is not supported by seqgen's engine"
            )
    num_beams, do_sample = setting(config, "num_beams"), bool(setting(config, "do_sample"))
    if num_beams > 1 and do_sample:
        raise SeqgenError("beam sampling (num_beams > 1 with do_sample) is not supported by seqgen's engine")
    check_return_sequences(config)
    if num_beams > 1:
        return "beam"
    return "sample" if do_sample else "greedy"


def _special_tokens(config: GenerationConfig, is_encoder_decoder: bool) -> tuple[tuple[int, ...], Any, Any]:
    """EOS ids, pad and decoder start token as ``_prepare_special_tokens`` resolves them."""
    eos = _token_list(config.eos_token_id)
    pad = config.pad_token_id
    if pad is None and eos:
        pad = eos[0]
    decoder_start = config.decoder_start_token_id
    if is_encoder_decoder and decoder_start is None:
        decoder_start = config.bos_token_id
    if is_encoder_decoder and decoder_start is None:
        raise SeqgenError(
            "decoder_start_token_id or bos_token_id has to be set for encoder-decoder generation"
        )
    if isinstance(decoder_start, (list, tuple)):
        raise SeqgenError("per-input decoder_start_token_id lists are not supported")
    return eos, pad, decoder_start


def resolve_settings(
    config: GenerationConfig,
    *,
    is_encoder_decoder: bool,
    prompt_len: int,
    max_position_embeddings: int | None = None,
) -> SearchSettings:
    """Resolve a merged config (:func:`seqgen_cli.config.resolve_generation_config`) for a batch whose prompts
    are ``prompt_len`` tokens wide, padded (decoder-only; encoder-decoder models start from the decoder start
    token, one position, whatever the source width)."""
    mode = resolve_mode(config)
    prompt_len = _decoder_positions(is_encoder_decoder, prompt_len)
    eos, pad, decoder_start = _special_tokens(config, is_encoder_decoder)
    max_length, min_length = length_limits(config, prompt_len, max_position_embeddings)
    _no_room(max_length, prompt_len, is_encoder_decoder)

    # Processors (_get_logits_processor); NoBadWords drops single-token entries that are an EOS token.
    bad_words = tuple(
        tuple(int(t) for t in seq)
        for seq in (config.bad_words_ids or [])
        if not (len(seq) == 1 and seq[0] in eos)
    )
    forced_bos = config.forced_bos_token_id
    forced_eos = _token_list(config.forced_eos_token_id)
    begin_index = prompt_len if (prompt_len > 1 or forced_bos is None) else prompt_len + 1
    early_stopping = setting(config, "early_stopping")
    if early_stopping not in (True, False, "never"):
        raise SeqgenError(f"early_stopping must be True, False or 'never', not {early_stopping!r}")
    top_k = setting(config, "top_k")

    return SearchSettings(
        mode=mode,
        num_beams=setting(config, "num_beams"),
        num_return_sequences=num_return_sequences(config),
        prompt_len=prompt_len,
        max_length=max_length,
        min_length=min_length if eos else 0,
        eos=eos,
        pad=pad,
        decoder_start=decoder_start,
        forced_bos=forced_bos,
        forced_eos=forced_eos,
        bad_words=bad_words,
        suppress_tokens=_token_list(config.suppress_tokens),
        begin_suppress_tokens=_token_list(config.begin_suppress_tokens),
        begin_index=begin_index,
        repetition_penalty=float(setting(config, "repetition_penalty")),
        renormalize_logits=bool(config.renormalize_logits),
        no_repeat_ngram_size=int(setting(config, "no_repeat_ngram_size")),
        length_penalty=float(setting(config, "length_penalty")),
        early_stopping=early_stopping,
        temperature=float(setting(config, "temperature")),
        top_k=int(top_k) if top_k else 0,
        top_p=float(setting(config, "top_p")),
        **_later_warpers(config),
        scores=bool(config.output_scores),
        logprobs=getattr(config, "logprobs", None),
    )


def _later_warpers(config: GenerationConfig) -> dict[str, Any]:
    """Sampling's warpers after top-p (min-p, typical, epsilon, eta), unset as transformers leaves them off."""
    return {
        "min_p": None if config.min_p is None else float(config.min_p),
        "typical_p": float(1.0 if config.typical_p is None else config.typical_p),
        "epsilon_cutoff": float(config.epsilon_cutoff or 0.0),
        "eta_cutoff": float(config.eta_cutoff or 0.0),
    }


def settings_for(backend: Any, batch: Any, config: GenerationConfig) -> SearchSettings:
    """Resolve ``config`` for a backend (``ModelBackend``) and a batch (``Batch``)."""
    return resolve_settings(
        config,
        is_encoder_decoder=backend.is_encoder_decoder,
        prompt_len=batch.input_ids.shape[1],
        max_position_embeddings=getattr(backend, "max_position_embeddings", None),
    )
