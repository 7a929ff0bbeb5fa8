"""docs/CLI.md is the command-line reference ``scripts/cli_reference.py`` writes from the click commands: an option,
default or help text changed in the code fails here until ``python scripts/cli_reference.py > docs/CLI.md`` is
rerun, so the reference cannot drift from ``--help``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import click
import pytest

from seqgen_cli.cli import main

REPO = Path(__file__).resolve().parents[1]
CLI_MD = REPO / "docs" / "CLI.md"


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_md_is_the_generated_reference(reference: ModuleType) -> None:
    written = CLI_MD.read_text(encoding="utf-8")
    assert written == reference.render(), f"docs/CLI.md is not the CLI's reference: run `{reference.COMMAND}`"


def test_the_reference_follows_the_code(reference: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A help text changed in the code changes the reference (so the file above would no longer equal it)."""
    option = next(p for p in main.commands["generate"].params if p.name == "resume")
    monkeypatch.setattr(option, "help", "A help text that is not in docs/CLI.md.")
    text = reference.render()
    assert text != CLI_MD.read_text(encoding="utf-8")
    assert "- `--resume` — A help text that is not in docs/CLI.md." in text


def test_every_command_and_option_is_in_the_reference(reference: ModuleType) -> None:
    text = reference.render()
    for name, command in main.commands.items():
        assert f"\n## `seqgen {name}`\n" in text, name
        section = text.split(f"\n## `seqgen {name}`\n", 1)[1].split("\n## ", 1)[0]
        for param in command.params:
            if isinstance(param, click.Option):
                assert f"- `{', '.join(param.opts)}" in section, (name, param.opts)
    assert text.count("### Input and output") == 1  # seqgen generate's options under their --help sections


def test_the_reference_does_not_depend_on_the_terminal(
    reference: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    widths = []
    for columns in ("40", "250"):
        monkeypatch.setenv("COLUMNS", columns)
        widths.append(reference.render())
    assert widths[0] == widths[1]
