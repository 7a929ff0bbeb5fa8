"""A user's first hour: outputs on a terminal stay intact, the library shares the cores as the command
does, the closing line says what it did, a .txt file is text, and mistakes are found before the model loads."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from seqgen_cli.pipeline.stats import Summary
from tests.helpers import REPO, one_line_error, seqgen, write_lines

GENERATE = ("generate", "--max-new-tokens", "4", "--num-beams", "2")
TEXTS = [f"input number {i} with a few words" for i in range(12)]


@pytest.fixture(scope="module")
def bart(tiny_models) -> Path:
    return tiny_models("bart")


# -- 1. the progress bar and outputs on the same terminal ---------------------------------------------------


def _on_a_terminal(args: list[str], cwd: Path) -> tuple[int, str]:
    """``python -m seqgen_cli ARGS`` with stdout and stderr on one pseudo-terminal (80x24); its exit status and
    everything the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "seqgen_cli", *args],
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True,
    )  # fmt: skip
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode("utf-8", "replace")


def test_outputs_on_a_terminal_arrive_intact(bart: Path, tmp_path: Path) -> None:
    """stdout and stderr on one terminal: every output line is whole (no bar drawn over or into it)."""
    src = write_lines(tmp_path / "in.txt", TEXTS)
    res = seqgen(*GENERATE, "-m", str(bart), str(src), "-o", str(tmp_path / "out.txt"), "-q")
    assert res.exit_code == 0, res.stderr
    expected = (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()
    status, screen = _on_a_terminal([*GENERATE, "-m", str(bart), "--batch-size", "2", "in.txt"], tmp_path)
    assert status == 0, screen
    assert "\r" not in screen.replace("\r\n", "\n"), screen  # no bar redraws
    lines = screen.replace("\r\n", "\n").splitlines()
    assert lines[: len(expected)] == expected, screen
    assert lines[len(expected)].startswith("seqgen: in.txt: 12 inputs in "), screen
    assert len(lines) == len(expected) + 1, screen


def test_the_bar_still_shows_for_output_to_a_file(bart: Path, tmp_path: Path) -> None:
    """-o FILE with stderr on a terminal: the bar shows (it overwrites nothing there)."""
    write_lines(tmp_path / "in.txt", TEXTS)
    status, screen = _on_a_terminal([*GENERATE, "-m", str(bart), "in.txt", "-o", "out.txt"], tmp_path)
    assert status == 0, screen
    assert "input/s" in screen or "input [" in screen, screen
    assert len((tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()) == len(TEXTS)


# -- 3. the closing line ------------------------------------------------------------------------------------


def test_closing_line_counts_in_the_singular() -> None:
    assert Summary(inputs=1, seconds=0.5).line().startswith("seqgen: 1 input in 0.5s: ")
    assert Summary(inputs=2, seconds=0.5).line().startswith("seqgen: 2 inputs in 0.5s: ")
    line = Summary(inputs=5, seconds=0.1).line("in.txt", process_seconds=4.6)
    assert line.startswith("seqgen: in.txt: 5 inputs in 0.1s (4.6s with start-up and model load): ")


def test_closing_line_names_the_input_and_the_whole_time(bart: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "one.txt", ["a single input"])
    res = seqgen(*GENERATE, "-m", str(bart), str(src), "-o", str(tmp_path / "out.txt"))
    assert res.exit_code == 0, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"seqgen: {src}: 1 input in "), line
    assert "s with start-up and model load): " in line, line
    res = seqgen(*GENERATE, "-m", str(bart), input="one\ntwo\n")
    assert res.stderr.strip().splitlines()[-1].startswith("seqgen: stdin: 2 inputs in "), res.stderr


def test_a_failures_error_line_comes_last(bart: Path, tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": oops}\n', encoding="utf-8")
    res = seqgen(*GENERATE, "-m", str(bart), str(src), "-o", str(tmp_path / "out.txt"))
    assert res.exit_code == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("seqgen: error: ") and "bad.jsonl:3" in lines[-1], res.stderr
    assert lines[-2].startswith(f"seqgen: {src}: 2 inputs in "), res.stderr


# -- 4. input formats ---------------------------------------------------------------------------------------


def test_a_txt_file_starting_with_json_is_text(bart: Path, tmp_path: Path) -> None:
    src = tmp_path / "notes.txt"
    src.write_text('{"text": "looks like JSON"}\nplain text after it\n', encoding="utf-8")
    res = seqgen(*GENERATE, "-m", str(bart), str(src), "-q")
    assert res.exit_code == 0, res.stderr
    assert len(res.stdout.splitlines()) == 2


def test_stdin_and_other_names_are_still_sniffed(bart: Path, tmp_path: Path) -> None:
    jsonl = '{"text": "one"}\n{"text": "two"}\n'
    res = seqgen(*GENERATE, "-m", str(bart), "--output-format", "jsonl", "-q", input=jsonl)
    assert res.exit_code == 0, res.stderr
    assert '"text": "two"' in res.stdout.splitlines()[1]
    (tmp_path / "data.lines").write_text(jsonl, encoding="utf-8")
    res = seqgen(*GENERATE, "-m", str(bart), str(tmp_path / "data.lines"), "--output-format", "jsonl", "-q")
    assert res.exit_code == 0 and '"text": "one"' in res.stdout, res.stderr


def test_input_field_with_text_input_is_an_error(bart: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["one", "two"])
    res = seqgen(*GENERATE, "-m", str(bart), str(src), "--input-field", "body", "-q")
    assert res.exit_code == 2
    one_line_error(res, "in.txt is text (one input per line): --input-field needs JSONL input")
    res = seqgen(*GENERATE, "-m", str(bart), "--input-field", "body", "-q", input="one\n")
    one_line_error(res, "stdin is text", "--input-field needs JSONL input")


# -- 5. --reference of another length, before the model loads ------------------------------------------------

NO_MODEL = "no-such-model-folder"  # the checks come first: a job that passes them stops at the model


def test_reference_of_another_length_fails_before_the_model_loads(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", TEXTS[:5])
    ref = write_lines(tmp_path / "ref.txt", TEXTS[:3])
    res = seqgen("generate", "-m", NO_MODEL, str(src), "--reference", str(ref))
    one_line_error(res, f"--reference {ref} has 3 lines", "the input has 5 inputs")
    assert res.exit_code == 2


def test_reference_check_counts_the_shard_and_not_the_returned_sequences(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", TEXTS[:5])
    whole = write_lines(tmp_path / "whole.txt", TEXTS[:5])
    part = write_lines(tmp_path / "part.txt", TEXTS[:2])  # shard 0/2 of 5 inputs: 2 of them
    res = seqgen("generate", "-m", NO_MODEL, str(src), "--shard", "0/2", "--reference", str(whole))
    one_line_error(res, "has 5 lines but shard 0/2 of the input has 2 inputs")
    for args in (["--shard", "0/2", "--reference", str(part)],
                 ["--num-return-sequences", "2", "--num-beams", "2", "--reference", str(whole)]):  # fmt: skip
        res = seqgen("generate", "-m", NO_MODEL, str(src), *args)
        assert "--reference" not in res.stderr and NO_MODEL in res.stderr, res.stderr


def test_reference_from_a_stream_is_not_counted(tmp_path: Path) -> None:
    ref = write_lines(tmp_path / "ref.txt", TEXTS[:3])
    res = seqgen("generate", "-m", NO_MODEL, "--reference", str(ref), input="one\ntwo\n")
    assert "--reference" not in res.stderr and NO_MODEL in res.stderr, res.stderr


def test_jsonl_output_of_text_input_carries_its_line(bart: Path, tmp_path: Path) -> None:
    import json

    src = write_lines(tmp_path / "in.txt", ["first line", "", "third line"])
    res = seqgen(
        "generate", "-m", str(bart), str(src), "--output-format", "jsonl", "--max-new-tokens", "3", "-q"
    )
    assert res.exit_code == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["text"] for r in rows] == ["first line", "", "third line"] and all("output" in r for r in rows)


def test_generate_help_has_sections_and_examples() -> None:
    res = seqgen("generate", "--help")
    assert res.exit_code == 0
    for section in ("Input and output:", "Generation:", "Batching:", "Resume and errors:", "Examples:"):
        assert section in res.stdout, section
    generation = res.stdout.split("Generation:")[1].split("Batching:")[0]
    assert "--num-beams" in generation and "--target-lang" in generation and "--batch-size" not in generation


def test_eval_says_which_metrics_it_picked(tmp_path: Path) -> None:
    hyp = write_lines(tmp_path / "hyp.txt", ["the cat sat on the mat"])
    res = seqgen("eval", str(hyp), str(hyp))
    assert res.exit_code == 0 and "seqgen: scoring rouge, bleu, chrf (choose with --metrics)" in res.stderr
    res = seqgen("eval", str(hyp), str(hyp), "--metrics", "bleu")
    assert res.exit_code == 0 and "scoring" not in res.stderr
