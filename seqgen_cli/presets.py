"""Task presets: generation settings plus input handling, one ``configs/NAME.toml`` each (``--preset``).

A preset's settings go through the rules a flag goes through (:mod:`seqgen_cli.rules`); how they merge with the
checkpoint's and the flags' is :func:`seqgen_cli.config.resolve_generation_config`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seqgen_cli.errors import SeqgenError
from seqgen_cli.rules import GENERATION_KEYS, Rule, check_setting, describe


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
    """The preset in ``path``, every setting checked (one line naming the file for any that is not allowed)."""
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
