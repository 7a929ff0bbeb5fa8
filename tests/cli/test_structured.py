"""`seqgen generate --json-schema / --regex / --grammar / --choice`: outputs held to a grammar through the command
line; an output cut short is counted at the end and marked in JSONL, never passed off as whole; a bad grammar is one
line before the model loads (the search itself: tests/search/test_grammar.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import one_line_error, seqgen

pytest.importorskip("llguidance")

STDIN = "The weather today\nA list of\nHello there\n"
SCHEMA = {
    "type": "object", "properties": {"tag": {"enum": ["red", "green"]}}, "required": ["tag"], "additionalProperties": False
}


@pytest.fixture(scope="module")
def gpt2(tiny_models) -> Path:
    return tiny_models("gpt2")


def test_jsonl_says_whether_each_output_is_whole(gpt2: Path, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    whole = seqgen("generate", "-m", str(gpt2), "--json-schema", str(schema), "--max-new-tokens", "40",
                   "--output-format", "jsonl", input=STDIN)  # fmt: skip
    assert whole.exit_code == 0, whole.stderr
    objs = [json.loads(line) for line in whole.stdout.splitlines()]
    assert [o["complete"] for o in objs] == [True] * 3
    assert all(json.loads(o["output"])["tag"] in ("red", "green") for o in objs)
    assert "before the grammar completed" not in whole.stderr
    cut = seqgen("generate", "-m", str(gpt2), "--json-schema", f"@{schema}", "--max-new-tokens", "2",
                 "--output-format", "jsonl", input=STDIN)  # fmt: skip
    assert cut.exit_code == 0, cut.stderr
    assert [json.loads(line)["complete"] for line in cut.stdout.splitlines()] == [False] * 3
    assert "3 of 3 outputs ended before the grammar completed" in cut.stderr


def test_text_output_keeps_its_lines(gpt2: Path) -> None:
    """Text output: one line per input, as without a grammar; every line a choice, or a match of the regex."""
    choice = seqgen("generate", "-m", str(gpt2), "--choice", "positive", "--choice", "negative", "-q", input=STDIN)
    assert choice.exit_code == 0, choice.stderr
    assert set(choice.stdout.splitlines()) <= {"positive", "negative"} and len(choice.stdout.splitlines()) == 3
    regex = seqgen("generate", "-m", str(gpt2), "--regex", "[0-9]{3}-[0-9]{4}", "-q", input=STDIN)
    assert regex.exit_code == 0, regex.stderr
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", line) for line in regex.stdout.splitlines())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regex", "a(b"], '--regex: invalid regex "a(b": unclosed group'),
        (["--json-schema", '{"type": '], "--json-schema: not JSON"),
        (["--grammar", "no-such.gbnf"], "--grammar no-such.gbnf: cannot read no-such.gbnf"),
        (["--regex", "a", "--choice", "b"], "--regex and --choice contradict"),
        (["--choice", "a", "--output-format", "jsonl", "--output-field", "complete"], "--output-field complete"),
    ],
)
def test_bad_grammar_options_are_one_line_before_the_model(tmp_path: Path, args: list[str], message: str) -> None:
    """No model folder exists: the grammar is refused before anything loads."""
    result = seqgen("generate", "-m", str(tmp_path / "no-model"), *args, input=STDIN)
    assert result.exit_code == 2
    assert message in one_line_error(result)


def test_each_jsonl_input_may_carry_its_own_schema(gpt2: Path, tmp_path: Path) -> None:
    """A JSONL object's ``schema`` field is its own grammar (one compiled per distinct schema): each output is what
    a run with that schema alone gives it, the others keep the run's (here none, then --choice); a schema that does
    not compile is a bad line naming its file and line."""
    colours = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"],
               "additionalProperties": False}  # fmt: skip
    sizes = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"], "additionalProperties": False}
    texts = STDIN.splitlines()
    records = [{"text": texts[0], "schema": colours}, {"text": texts[1]}, {"text": texts[2], "schema": json.dumps(sizes)}]
    stdin = "".join(json.dumps(r) + "\n" for r in records)
    both = seqgen("generate", "-m", str(gpt2), "--max-new-tokens", "16", "--output-format", "jsonl", "-q", input=stdin)
    assert both.exit_code == 0, both.stderr
    objs = [json.loads(line) for line in both.stdout.splitlines()]
    alone = []
    for text, schema in ((texts[0], colours), (texts[2], sizes)):
        one = seqgen("generate", "-m", str(gpt2), "--max-new-tokens", "16", "--json-schema", json.dumps(schema), "-q",
                     input=text + "\n")  # fmt: skip
        alone.append(one.stdout.strip())
    assert [objs[0]["output"], objs[2]["output"]] == alone
    assert json.loads(objs[0]["output"])["c"] in ("red", "blue") and json.loads(objs[2]["output"])["n"] in (1, 2, 3)
    assert objs[0]["complete"] is True and objs[2]["complete"] is True and "complete" not in objs[1]
    plain = seqgen("generate", "-m", str(gpt2), "--max-new-tokens", "16", "-q", input=texts[1] + "\n")
    assert objs[1]["output"] == plain.stdout.strip(), "no schema, no grammar: as without one"
    chosen = seqgen("generate", "-m", str(gpt2), "--max-new-tokens", "16", "--choice", "yes", "--choice", "no",
                    "--output-format", "jsonl", "-q", input=stdin)  # fmt: skip
    assert [json.loads(line)["output"] in ("yes", "no") for line in chosen.stdout.splitlines()] == [False, True, False]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "y", "schema": [1]}) + "\n")
    failed = seqgen("generate", "-m", str(gpt2), str(bad), "--output-format", "jsonl", "-q")
    assert f"{bad}:2: its schema field: a JSON schema is an object, not list" in one_line_error(failed)
