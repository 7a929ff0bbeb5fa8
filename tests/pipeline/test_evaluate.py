"""What ``seqgen eval`` prints (``pipeline/evaluate.py``'s :func:`eval_report`): the metrics checked before
any file, the note when none were chosen, the table or the JSON object, ``--sentence-scores -``'s lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline.evaluate import eval_report


@pytest.fixture
def pair(tmp_path: Path) -> list[str]:
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("the cat sat on the mat\na dog ran\n", encoding="utf-8")
    ref.write_text("the cat sat on a mat\na dog ran fast\n", encoding="utf-8")
    return [str(hyp), str(ref)]


def test_no_metrics_chosen_scores_the_default_and_says_so(pair: list[str]) -> None:
    report = eval_report(pair, None, None)
    assert report.note == "seqgen: scoring rouge, bleu, chrf (choose with --metrics)"
    assert "BLEU" in report.text and report.sentences is None


def test_chosen_metrics_as_json(pair: list[str]) -> None:
    report = eval_report(pair[1:], pair[0], "bleu", as_json=True)  # sacrebleu's order: REF -i HYP
    result = json.loads(report.text)
    assert report.note is None and set(result) >= {"bleu", "files"} and "chrf" not in result
    assert result["files"] == {"hypotheses": pair[0], "references": [pair[1]]}


def test_sentence_scores_to_stdout(pair: list[str]) -> None:
    report = eval_report(pair, None, "chrf", sentence_scores="-")
    assert [json.loads(line)["line"] for line in report.sentences.splitlines()] == [1, 2]


def test_a_bad_metric_is_named_before_any_file_is_read(tmp_path: Path) -> None:
    with pytest.raises(SeqgenError, match="unknown metric 'nope'"):
        eval_report([str(tmp_path / "missing.txt")], None, "nope")
