"""Issue 24: nothing lost, nothing mixed. Same-file checks by inode, write failures (disk full), journal
entries checked against their input, `seqgen merge` manifests, streams and closed standard streams."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from seqgen_cli.cli import main

REPO = Path(__file__).resolve().parent.parent


def seqgen(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def one_line_error(res, *needles: str) -> str:
    """The stderr of a failed run: exactly one line, starting `seqgen: error:`, holding ``needles``."""
    lines = res.stderr.strip().splitlines()
    assert res.exit_code != 0 and len(lines) == 1 and lines[0].startswith("seqgen: error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run_seqgen(*args: str, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "seqgen_cli", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, timeout=300, **kw)


# -- 1. an input that is the output under another name ------------------------------------------------


@pytest.mark.parametrize("alias", ["hard link", "symlink", "relative path"])
def test_input_that_is_the_output_under_another_name_is_refused(tmp_path: Path, monkeypatch, alias) -> None:
    src = tmp_path / "in1.txt"
    src.write_text("keep me\nand me\n", encoding="utf-8")
    other = tmp_path / "in1_other.txt"
    if alias == "hard link":
        os.link(src, other)
    elif alias == "symlink":
        other.symlink_to(src)
    else:
        monkeypatch.chdir(tmp_path)
        other = Path("sub/../in1.txt")
        (tmp_path / "sub").mkdir()
    # The model is never loaded: the check comes first.
    res = seqgen("generate", "-m", str(tmp_path / "no-model"), str(other), "-o", str(src))
    one_line_error(res, str(src), "input")
    assert src.read_text(encoding="utf-8") == "keep me\nand me\n"
    assert not Path(f"{src}.seqgen-index").exists()


def test_stdin_that_is_the_output_file_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("keep me\n", encoding="utf-8")
    with open(src, "rb") as stdin:
        res = run_seqgen("generate", "-m", str(tmp_path / "no-model"), "-o", str(src), stdin=stdin)
    err = res.stderr.decode().strip()
    assert res.returncode == 2 and err.startswith("seqgen: error: standard input is the output"), err
    assert len(err.splitlines()) == 1 and src.read_text(encoding="utf-8") == "keep me\n"


def test_merge_refuses_an_output_that_is_a_part_under_another_name(tmp_path: Path) -> None:
    part = tmp_path / "part0.txt"
    part.write_text("x\n", encoding="utf-8")
    os.link(part, tmp_path / "out.txt")
    res = seqgen("merge", str(part), "-o", str(tmp_path / "out.txt"))
    one_line_error(res, "part")
    assert part.read_text(encoding="utf-8") == "x\n"
