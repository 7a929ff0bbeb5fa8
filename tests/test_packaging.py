"""Packaging guards: every subpackage ships, presets ship with it, the CLI entry point exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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


def test_requires_python_matches_the_code() -> None:
    """The declared minimum Python runs the package (tomllib is 3.11+) and ruff targets that same version."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    minimum = re.fullmatch(r">=(\d+)\.(\d+)", pyproject["project"]["requires-python"])
    assert minimum is not None, "requires-python: one lower bound, >=X.Y"
    version = (int(minimum[1]), int(minimum[2]))
    assert pyproject["tool"]["ruff"]["target-version"] == f"py{version[0]}{version[1]}"
    sources = (p.read_text(encoding="utf-8") for p in (REPO / "seqgen_cli").rglob("*.py"))
    if any(re.search(r"^import tomllib$", text, re.M) for text in sources):
        assert version >= (3, 11), "tomllib needs Python 3.11"
