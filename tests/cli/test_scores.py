"""`seqgen generate --scores`: each output's score and summed log-probability, at the start of its text line or as
fields of its JSONL object, equal to what the Python API gives (itself held to generate()'s: tests/test_scores.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seqgen_cli.generator import Generator
from tests.helpers import one_line_error, seqgen
from tests.tiny_models import sample_texts

TEXTS = sample_texts(4, seed=2)
BEAMS = ["--num-beams", "3", "--num-return-sequences", "2", "--max-new-tokens", "6", "-q"]


@pytest.fixture(scope="module")
def bart(tiny_models) -> Path:
    return tiny_models("bart")


def test_text_lines_begin_with_the_scores(bart: Path) -> None:
    stdin = TEXTS[0] + "\n\n" + TEXTS[1] + "\n"  # a blank input between: its lines have no scores
    plain = seqgen("generate", "-m", str(bart), *BEAMS, input=stdin)
    scored = seqgen("generate", "-m", str(bart), *BEAMS, "--scores", input=stdin)
    assert plain.exit_code == 0 and scored.exit_code == 0, scored.stderr
    rows = [line.split("\t", 2) for line in scored.stdout.splitlines()]
    assert len(rows) == 6 and all(len(r) == 3 for r in rows)
    assert [r[2] for r in rows] == plain.stdout.splitlines(), "cut -f3- gives the plain output"
    assert rows[2] == ["", "", ""] and rows[3] == ["", "", ""], "the blank input: empty scores, empty outputs"
    gen = Generator(str(bart), scores=True, num_beams=3, num_return_sequences=2, max_new_tokens=6)
    api = gen.generate_output([e.ids for e in gen.encode([TEXTS[0], TEXTS[1]])]).scores
    numbers = [(float(r[0]), float(r[1])) for r in rows[:2] + rows[4:]]
    assert numbers == [s[:2] for per_input in api for s in per_input], "the float32 values, written exactly"
    assert numbers[0][0] >= numbers[1][0], "best first"


def test_jsonl_objects_get_score_fields(bart: Path) -> None:
    stdin = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate([TEXTS[2], " ", TEXTS[3]]))
    text = seqgen("generate", "-m", str(bart), *BEAMS, "--scores", input=stdin)
    js = seqgen("generate", "-m", str(bart), *BEAMS, "--scores", "--output-format", "jsonl", input=stdin)
    assert js.exit_code == 0, js.stderr
    objs = [json.loads(line) for line in js.stdout.splitlines()]
    assert [o["id"] for o in objs] == [0, 1, 2]
    assert objs[1]["score"] == [None, None] and objs[1]["log_prob"] == [None, None]
    lines = [line.split("\t") for line in text.stdout.splitlines()]
    assert objs[1]["token_log_probs"] == [None, None]
    for obj, pair in zip([objs[0], objs[2]], [lines[0:2], lines[4:6]], strict=True):
        assert obj["score"] == [float(p[0]) for p in pair] and obj["log_prob"] == [float(p[1]) for p in pair]
        # text output writes a line boundary inside an output (str.splitlines': \n, \x1c, ...) as a space
        assert [" ".join(o.splitlines()) for o in obj["output"]] == [p[2] for p in pair]
        for per, total in zip(obj["token_log_probs"], obj["log_prob"], strict=True):
            assert 1 <= len(per) <= 6 and abs(sum(per) - total) <= 1e-5 * 6 * abs(total), "its tokens, their sum"
    one = seqgen("generate", "-m", str(bart), "--max-new-tokens", "4", "-q", "--scores", "--output-format", "jsonl",
                 input=TEXTS[0] + "\n")  # fmt: skip
    obj = json.loads(one.stdout)
    assert isinstance(obj["score"], float) and obj["score"] == obj["log_prob"], "greedy: one number, no penalty"


def test_a_field_the_scores_would_overwrite_stops_before_the_model_loads(bart: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "a b c", "score": 4}) + "\n")
    args = ("generate", "-m", str(tmp_path / "no-model"), str(src), "--output-format", "jsonl", "-q")
    one_line_error(seqgen(*args, "--scores"), f"{src}:1", "'score'", "--scores")
    assert "no-model" in one_line_error(seqgen(*args)), "without --scores the field is the input's own"
    one_line_error(seqgen(*args, "--scores", "--output-field", "log_prob"), "--output-field log_prob", "--scores")


def test_scored_text_is_read_back_as_text_and_eval_refuses_it(tmp_path: Path) -> None:
    """A --scores text output read back for --reference (a resumed or --workers run) gives the texts; seqgen eval
    refuses a file of scored lines instead of scoring the numbers as words."""
    from seqgen_cli.pipeline.job import JobOptions, read_hypotheses

    out = tmp_path / "out.txt"
    out.write_text("-0.5\t-2.0\tein Haus\n-0.75\t-3.0\tzwei\n\t\t\n-1.25\t-5.0\tdrei Worte\n", encoding="utf-8")
    assert read_hypotheses(str(out), JobOptions(scores=True), 1) == ["ein Haus", "zwei", "", "drei Worte"]
    assert read_hypotheses(str(out), JobOptions(scores=True), 2) == ["ein Haus", ""]
    ref = tmp_path / "ref.txt"
    ref.write_text("ein Haus\nzwei\n\ndrei Worte\n", encoding="utf-8")
    one_line_error(seqgen("eval", str(out), str(ref)), str(out), "--scores", "cut -f3-")
    plain = tmp_path / "plain.txt"
    plain.write_text("3\t4\tfive\nsix\n\n7\n", encoding="utf-8")  # numbers and tabs on some lines: text
    assert seqgen("eval", str(plain), str(ref), "--metrics", "bleu").exit_code == 0


@pytest.mark.parametrize(("family", "search"), [("gpt2", []), ("gpt2", ["--num-beams", "3"]), ("bart", ["--num-beams", "3"])])
def test_logprobs_are_the_models_own(tiny_models, family: str, search: list[str]) -> None:
    """``--logprobs N``: each token's raw log-prob (before the processors: here a repetition penalty, which the
    processed ``token_log_probs`` include) and its step's N best, generate(output_logits=True)'s log-softmax within
    float32 rounding (the two backends' logits are sums in another order: a few ulp of values near 1-10); beam search
    too, each token's from the row it was chosen on (generate()'s ``beam_indices``)."""
    gpt2 = str(tiny_models(family))
    args = ["--logprobs", "3", "--max-new-tokens", "5", "--repetition-penalty", "1.5", "--output-format", "jsonl", "-q"]
    args += search
    stdin = TEXTS[0] + "\n\n" + TEXTS[1] + "\n"
    fast, hf = (seqgen("generate", "-m", gpt2, *args, "--backend", b, input=stdin) for b in ("fast", "hf"))
    assert fast.exit_code == 0 and hf.exit_code == 0, fast.stderr + hf.stderr
    ours, theirs = ([json.loads(line) for line in r.stdout.splitlines()] for r in (fast, hf))
    assert ours[1]["logprobs"] is None, "a blank input: none"
    for a, b in zip(ours[::2], theirs[::2], strict=True):
        assert a["output"] == b["output"] and len(a["logprobs"]) == len(b["logprobs"]) == len(a["token_log_probs"])
        for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
            assert x["id"] == y["id"] and [t["id"] for t in x["top"]] == [t["id"] for t in y["top"]]
            assert abs(x["logprob"] - y["logprob"]) <= 1e-5 * max(1.0, abs(y["logprob"]))
            values = [t["logprob"] for t in x["top"]]
            assert len(values) == 3 and values == sorted(values, reverse=True) and x["logprob"] <= values[0]
            assert x["token"] == gen_decode(gpt2, x["id"]), "a token's text alone"
        if not search:  # greedy: the penalty moved the distribution of some step (raw != processed)
            assert any(abs(x["logprob"] - p) > 1e-3 for x, p in zip(a["logprobs"], a["token_log_probs"], strict=True))
    plain = seqgen("generate", "-m", gpt2, "--logprobs", "0", "--max-new-tokens", "3", "--output-format", "jsonl",
                   input=TEXTS[0] + "\n")  # fmt: skip
    assert [t["top"] for t in json.loads(plain.stdout)["logprobs"]] == [[], [], []]


def gen_decode(model: str, token: int) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).decode([token], skip_special_tokens=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--logprobs", "2"], "--logprobs writes a JSONL field: add --output-format jsonl"),
        (["--logprobs", "21", "--output-format", "jsonl"], "--logprobs 21: must be a whole number >= 0 and <= 20"),
    ],
)
def test_logprobs_refusals_are_one_line(bart: Path, args: list[str], message: str) -> None:
    result = seqgen("generate", "-m", str(bart), *args, input=TEXTS[0] + "\n")
    assert message in one_line_error(result)
