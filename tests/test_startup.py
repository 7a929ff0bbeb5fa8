"""Start-up's import rules, each checked in a fresh interpreter: what loads no model imports neither torch nor
transformers (``seqgen --help``, every command's help, ``seqgen eval``), so it starts in a fraction of a second."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers")


def imported_after(argv: list[str], cwd: Path | None = None) -> set[str]:
    """The heavy modules in ``sys.modules`` once ``seqgen <argv>`` has run (exit 0) in a fresh interpreter."""
    code = (
        "import sys\n"
        "from seqgen_cli.cli import main\n"
        f"try: main({argv!r})\n"
        "except SystemExit as e: assert not e.code, e.code\n"
        f"print('imported:', *(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert res.returncode == 0, res.stderr
    last = res.stdout.splitlines()[-1]
    assert last.startswith("imported:"), res.stdout
    return set(last.split()[1:])


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["eval", "--help"], ["bench", "--help"]])
def test_help_imports_no_model_library(argv: list[str]) -> None:
    assert imported_after(argv) == set()


def test_eval_imports_no_model_library(tmp_path: Path) -> None:
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("the cat sat on the mat\na dog ran\n", encoding="utf-8")
    ref.write_text("the cat sat on a mat\na dog ran fast\n", encoding="utf-8")
    assert imported_after(["eval", str(hyp), str(ref), "--metrics", "bleu,chrf"]) == set()
