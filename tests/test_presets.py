"""Task presets (``presets.py``): the shipped ones pass the rules a flag does, a missing one names the choices, and a
preset file's errors name the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from seqgen_cli.errors import SeqgenError
from seqgen_cli.presets import list_presets, load_preset
from seqgen_cli.rules import RULES


def test_the_shipped_presets_load_by_name() -> None:
    presets = list_presets()
    assert [p.name for p in presets] == sorted(p.name for p in presets) and "cnndm-bart" in {
        p.name for p in presets
    }
    for preset in presets:
        assert load_preset(preset.name) == preset
        assert all(RULES[k].problem(v) is None for k, v in preset.generation.items()), preset.name


def test_an_unknown_preset_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(SeqgenError, match=r"unknown preset 'nope' \(available: .*cnndm-bart"):
        load_preset("nope")
    with pytest.raises(SeqgenError, match="preset file .*missing.toml does not exist"):
        load_preset(str(tmp_path / "missing.toml"))


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("generation = 3", "[generation] must be a table of settings"),
        ("[generation]\nnum_beemz = 2", "unknown generation setting(s) num_beemz"),
        ('colour = "red"', "unknown preset key(s) colour"),
        ("prefix = 3", "prefix = 3: must be a string"),
        ("[generation]\nnum_beams = 0", "num_beams = 0: must be a whole number >= 1"),
    ],
)
def test_a_preset_files_errors_name_it(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "task.toml"
    path.write_text(body + "\n", encoding="utf-8")
    with pytest.raises(SeqgenError) as err:
        load_preset(str(path))
    assert str(err.value).startswith(f"preset {path}: ") and needle in str(err.value)


def test_a_preset_file_that_is_not_toml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "task.toml"
    path.write_text("[generation\n", encoding="utf-8")
    with pytest.raises(SeqgenError, match="cannot read preset"):
        load_preset(str(path))
