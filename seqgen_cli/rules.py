"""What each generation setting may be, whatever its source: a flag, a preset file or the checkpoint's
``generation_config.json`` all go through :func:`check_setting`, and the one-line error names the source.

Plain data and checks, no transformers: ``seqgen --help`` and ``seqgen presets`` read them without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from seqgen_cli.errors import SeqgenError

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
    "logprobs",  # seqgen's own (vLLM's name): each token's raw log-prob and the N best
    "stop_token_id",  # seqgen's own (vLLM's stop_token_ids): ids that end an output, beside the EOS ids
)
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
# CUDA kernels index with; one input's rows x length keeps within it too (config._check_rows). Once the model is
# loaded, beams are held to its vocabulary (config._check_beams) and lengths to a learned-position table
# (config._check_positions).
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

# Pairs that say the same thing in two units: the later layer's choice wins.
SAME_LIMIT = {
    "max_new_tokens": "max_length",
    "max_length": "max_new_tokens",
    "min_new_tokens": "min_length",
    "min_length": "min_new_tokens",
}


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
