"""Packaging guards: every subpackage ships, presets ship with it, the CLI entry point exists."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "seqgen_cli").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_console_script_points_at_cli_run() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["seqgen"] == "seqgen_cli.cli:run"
    from seqgen_cli.cli import run

    assert callable(run)
