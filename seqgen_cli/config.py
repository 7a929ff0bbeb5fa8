"""Generation settings: presets, and how they resolve against a checkpoint's ``generation_config.json``.

Resolution order is transformers' own, with one layer added: the checkpoint's generation config, then
the preset (``--preset``), then explicit flags. A later ``max_new_tokens`` replaces an earlier
``max_length`` (and vice versa), likewise ``min_new_tokens``/``min_length``, so a preset written in
one unit can be overridden in the other.
"""

from __future__ import annotations

import copy
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from seqgen_cli.errors import SeqgenError
from seqgen_cli.search.settings import check_return_sequences

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
    "repetition_penalty",
)
_DEFAULT_CONFIG = GenerationConfig()
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
    generation = data.pop("generation", {})
    unknown = sorted(set(generation) - set(GENERATION_KEYS))
    if unknown:
        raise SeqgenError(f"{path}: unknown generation setting(s) {', '.join(unknown)}")
    extra = sorted(set(data) - {"description", "prefix", "max_source_length"})
    if extra:
        raise SeqgenError(f"{path}: unknown preset key(s) {', '.join(extra)}")
    return Preset(
        name=path.stem,
        description=data.get("description", ""),
        generation=generation,
        prefix=data.get("prefix"),
        max_source_length=data.get("max_source_length"),
    )


def resolve_generation_config(
    base: GenerationConfig, preset: Preset | None = None, flags: dict[str, Any] | None = None
) -> GenerationConfig:
    """Checkpoint config, then preset, then explicit settings.

    The one merge of generation settings: the app, the tests and the scripts all use it. ``flags``: the
    settings given, any ``GenerationConfig`` field (the CLI exposes :data:`GENERATION_KEYS`); user input,
    where ``None`` means "not given", goes through :func:`check_flags` first. A layer that gives both units
    of a limit keeps both, and ``max_new_tokens``/``min_new_tokens`` win, as in ``generate()``. Raises
    ``SeqgenError`` for settings transformers rejects.
    """
    config = copy.deepcopy(base)
    given: set[str] = set()
    for layer in (preset.generation if preset else {}, flags or {}):
        for key, value in layer.items():
            other = _SAME_LIMIT.get(key)
            if other is not None and other not in layer:
                setattr(config, other, getattr(_DEFAULT_CONFIG, other))
                given.discard(other)
            setattr(config, key, value)
            given.add(key)
    if config.early_stopping is not None and config.num_beams in (None, 1):
        config.early_stopping = None  # a beam-only setting from a checkpoint/preset; harmless for greedy
    _validate(config, given)
    return config


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
