"""No file a command writes is a file it reads or writes otherwise (``pipeline/paths.py``): every path of a run
(inputs, -o, --stats, --reference, the index and journal) against every other by file identity, before
anything is opened for writing. The model is never loaded: the check comes first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline import paths
from tests.helpers import one_line_error, seqgen

KEEP = "keep me\nand me\n"


def _generate(tmp_path: Path, *args: str):
    return seqgen("generate", "-m", str(tmp_path / "no-model"), *args)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    names = ("in.txt", "out.txt", "ref.txt")
    paths = {n: tmp_path / n for n in names}
    for p in paths.values():
        p.write_text(KEEP, encoding="utf-8")
    return paths


def _untouched(files: dict[str, Path]) -> None:
    for p in files.values():
        assert p.read_text(encoding="utf-8") == KEEP, p
    assert not list(p.parent.glob("*.seqgen-*"))


@pytest.mark.parametrize("alias", ["same path", "symlink", "hard link"])
def test_stats_that_is_the_output_is_refused(tmp_path: Path, files, alias: str) -> None:
    stats = files["out.txt"]
    if alias == "symlink":
        stats = tmp_path / "stats.json"
        stats.symlink_to(files["out.txt"])
    elif alias == "hard link":
        stats = tmp_path / "stats.json"
        os.link(files["out.txt"], stats)
    res = _generate(tmp_path, str(files["in.txt"]), "-o", str(files["out.txt"]), "--stats", str(stats))
    one_line_error(res, "--stats", "-o", "same file")
    assert res.exit_code == 2
    _untouched(files)


def test_stats_that_is_an_input_is_refused(tmp_path: Path, files) -> None:
    res = _generate(
        tmp_path, str(files["in.txt"]), "-o", str(files["out.txt"]), "--stats", str(files["in.txt"])
    )
    one_line_error(res, "input", "--stats", "destroy the input")
    _untouched(files)


def test_output_that_is_the_reference_is_refused(tmp_path: Path, files) -> None:
    res = _generate(
        tmp_path, str(files["in.txt"]), "-o", str(files["ref.txt"]), "--reference", str(files["ref.txt"])
    )
    one_line_error(res, "--reference", "destroy the --reference")
    _untouched(files)


def test_stats_that_is_the_index_is_refused(tmp_path: Path, files) -> None:
    index = f"{files['out.txt']}.seqgen-index"
    res = _generate(tmp_path, str(files["in.txt"]), "-o", str(files["out.txt"]), "--stats", index)
    one_line_error(res, "the index")
    _untouched(files)


def test_new_files_that_are_the_same_path_are_refused(tmp_path: Path, files) -> None:
    """Neither file exists yet: the resolved paths are compared."""
    out = tmp_path / "new.txt"
    res = _generate(
        tmp_path, str(files["in.txt"]), "-o", str(out), "--stats", str(tmp_path / "sub" / ".." / "new.txt")
    )
    one_line_error(res, "same file")
    assert not out.exists()


def test_two_writers_on_standard_output_are_refused(tmp_path: Path, files) -> None:
    one_line_error(_generate(tmp_path, str(files["in.txt"]), "--stats", "-"), "--stats - (standard output)")


def test_merge_output_that_is_a_part_manifest_is_refused(tmp_path: Path) -> None:
    part = tmp_path / "part0.txt"
    part.write_text("x\n", encoding="utf-8")
    manifest = tmp_path / "part0.txt.seqgen-part"
    manifest.write_text("{}\n", encoding="utf-8")
    with pytest.raises(SeqgenError, match="part manifest"):
        paths.check_distinct([paths.read("part manifest", str(manifest)), paths.written("-o", str(manifest))])


def test_bench_refuses_an_input_inside_what_it_writes(tmp_path: Path) -> None:
    out = tmp_path / "results"
    out.mkdir()
    src = out / "bench.md"
    src.write_text(KEEP, encoding="utf-8")
    res = seqgen("bench", str(src), "-m", str(tmp_path / "no-model"), "--out", str(out))
    one_line_error(res, "bench.md", "destroy the input")
    assert src.read_text(encoding="utf-8") == KEEP


@pytest.mark.parametrize(
    ("target", "alias", "role"),
    [("ref.txt", "same path", "reference"), ("in.txt", "symlink", "hypotheses"), ("ref.txt", "hard link", "reference"),
     ("base.txt", "same path", "--paired-bs")],
)  # fmt: skip
def test_eval_sentence_scores_over_an_input_is_refused(tmp_path: Path, files, target: str, alias: str, role: str) -> None:
    """``seqgen eval HYP REF --sentence-scores FILE`` wrote its JSONL over a reference or, through a link, over the
    hypotheses, exit 0."""
    files["base.txt"] = tmp_path / "base.txt"
    files["base.txt"].write_text(KEEP, encoding="utf-8")
    out = files[target]
    if alias == "symlink":
        out = tmp_path / "link.txt"
        out.symlink_to(files[target])
    elif alias == "hard link":
        out = tmp_path / "hard.txt"
        os.link(files[target], out)
    base = ["--paired-bs", str(files["base.txt"])] if role == "--paired-bs" else []
    res = seqgen("eval", str(files["in.txt"]), str(files["ref.txt"]), "--metrics", "bleu", "--sentence-scores", str(out), *base)
    one_line_error(res, f"{role} {files[target]}", f"--sentence-scores {out}", "destroy")
    _untouched(files)


def test_eval_sentence_scores_are_written_whole_or_not_at_all(tmp_path: Path, files, monkeypatch) -> None:
    """A write that fails half-way leaves the file that was there and no temporary file beside it."""
    from seqgen_cli import metrics

    out = tmp_path / "scores.jsonl"
    out.write_text("old\n", encoding="utf-8")
    args = ("eval", str(files["in.txt"]), str(files["ref.txt"]), "--metrics", "bleu", "--sentence-scores", str(out))
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    res = seqgen(*args)
    one_line_error(res, "no space left on device writing", str(out))
    assert out.read_text(encoding="utf-8") == "old\n" and sorted(tmp_path.iterdir()) == sorted([out, *files.values()])
    monkeypatch.undo()
    assert seqgen(*args).exit_code == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["line"] for r in rows] == [1, 2] and rows[0]["bleu"] == metrics.sentence_scores(
        ["keep me"], [["keep me"]], ["bleu"], metrics.Options()
    )[0]["bleu"]


def test_streams_are_not_files(tmp_path: Path) -> None:
    """/dev/null twice is fine: devices are streams, not files another write could destroy."""
    paths.check_distinct([paths.written("-o", "/dev/null"), paths.written("--stats", "/dev/null")])


@pytest.mark.parametrize("report", paths.BENCH_REPORTS)
def test_check_bench_refuses_each_report_over_the_input(tmp_path: Path, report: str) -> None:
    """``seqgen bench``'s check, before any model loads: every report it writes into --out against its input."""
    src = tmp_path / report
    src.write_text(KEEP, encoding="utf-8")
    with pytest.raises(SeqgenError, match=report):
        paths.check_bench(str(src), str(tmp_path), str(tmp_path / "no-model"))
    paths.check_bench(str(src), str(tmp_path / "elsewhere"), str(tmp_path / "no-model"))  # another --out: fine
