"""The examples of README.md and docs/GUIDE.md run: every ``seqgen`` command of their ```bash blocks (and the
guide's Python API example), taken from the Markdown as written, on tiny checkpoints in place of the models they
name, in the order the doc gives them, so a recipe that stops working fails here. Commands on a cluster of several
machines (``--address``) and on a local Ray (``--workers``: tests/pipeline/test_cluster.py runs it) are parsed, not
run. Running them takes a
minute or more (the presets' lengths, beam search), so those tests are slow; that every command parses, with
options the CLI has and a model this test maps, is checked at once."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from seqgen_cli.cli import main
from tests.helpers import REPO, seqgen, with_chat_template, write_lines
from tests.tiny_models import copy_checkpoint, sample_texts

# The models the docs name -> the tiny family standing in for each ("chat": CHAT_FAMILY with a chat template).
MODELS = {
    "path/to/bart-large-cnn": "bart",
    "bart-large-cnn": "bart",
    "ckpt": "bart",
    "pegasus-xsum": "pegasus",
    "opus-mt-en-de": "marian",
    "nllb-200-distilled-600M": "mbart",  # a many-to-many tokenizer with language codes: `de` is its de_DE
    "Qwen2.5-0.5B-Instruct": "chat",
}
CHAT_FAMILY = "gpt2"  # byte-level: any stop string is a token sequence of its vocabulary
INPUTS = 4
SHARDS = 8  # the guide's SLURM array: out.part{0..7}


def _blocks(doc: str, language: str) -> list[str]:
    text = (REPO / doc).read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _commands(doc: str) -> list[str]:
    """The ``seqgen`` command lines of a doc's bash blocks, continuation lines joined."""
    commands = []
    for block in _blocks(doc, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("seqgen "):
                commands.append(line)
    return commands


def _words(command: str, env: dict[str, str]) -> list[str]:
    """A command line's words as bash makes them (quotes, $'\\n', {0..7}, $VARIABLES, # comments)."""
    script = 'eval "set -- $1"; printf "%s\\0" "$@"'
    done = subprocess.run(
        ["bash", "-c", script, "_", command], env={**os.environ, **env}, capture_output=True, check=True
    )
    return done.stdout.decode("utf-8").split("\0")[:-1]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    chat = with_chat_template(
        copy_checkpoint(tiny_models(CHAT_FAMILY), tmp_path_factory.mktemp("recipes") / "chat")
    )
    return {name: chat if family == "chat" else tiny_models(family) for name, family in MODELS.items()}


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding the files the docs' commands read, as the docs name them."""
    texts = sample_texts(INPUTS, seed=3)
    for name in ("articles.txt", "news.en", "references.txt", "reference.de", "baseline.de"):
        write_lines(tmp_path / name, texts)
    write_lines(tmp_path / "in.txt", sample_texts(2 * SHARDS, seed=4))
    write_lines(tmp_path / "reviews.txt", texts)
    schema = '{"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}}}'
    (tmp_path / "schema.json").write_text(schema, encoding="utf-8")
    (tmp_path / "system.txt").write_text(
        "Translate into German.\n\nEnglish: Hello.\nGerman: Hallo.\n", encoding="utf-8"
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(words: list[str], models: dict[str, Path]) -> str:
    """``seqgen WORDS`` in this process, the model named by ``-m`` replaced by its tiny stand-in; its stdout."""
    words = list(words)
    if "-m" in words:
        at = words.index("-m") + 1
        assert words[at] in models, f"a doc's example names a model this test does not map: {words[at]}"
        words[at] = str(models[words[at]])
    res = seqgen(*words[1:])
    assert res.exit_code == 0, (words, res.stderr)
    return res.stdout


def _run_doc(doc: str, models: dict[str, Path], skip: Callable[[list[str]], bool]) -> list[tuple[str, str]]:
    """Run a doc's commands in order: (command, stdout) of each that ran."""
    ran = []
    for command in _commands(doc):
        if "$SLURM_ARRAY_TASK_ID" in command:  # an array of SHARDS tasks
            runs = [_words(command, {"SLURM_ARRAY_TASK_ID": str(i)}) for i in range(SHARDS)]
        else:
            runs = [_words(command, {})]
        for words in runs:
            if not skip(words):
                ran.append((command, _run(words, models)))
    return ran


def _not_here(words: list[str]) -> bool:
    return "--address" in words or "--workers" in words


@pytest.mark.parametrize("doc", ["README.md", "docs/GUIDE.md"])
def test_every_example_parses(doc: str) -> None:
    """Each command's options are the CLI's (an option renamed in the code fails here), its model one this test maps."""
    commands = [_words(c, {"SLURM_ARRAY_TASK_ID": "0"}) for c in _commands(doc)]
    assert len(commands) >= 4, commands
    for words in commands:
        assert words[0] == "seqgen" and words[1] in main.commands, words
        if "-m" in words and "--address" not in words:
            assert words[words.index("-m") + 1] in MODELS, words
        main.commands[words[1]].make_context(words[1], words[2:], resilient_parsing=False).close()


@pytest.mark.slow  # the presets' lengths under beam search on a loaded CPU: a minute or more
def test_the_readme_recipes_run(models: dict[str, Path], workdir: Path) -> None:
    ran = _run_doc("README.md", models, _not_here)
    assert len(ran) >= 10, [
        c for c, _ in ran
    ]  # quick start, summarise, translate, LLM, score, shards + merge
    assert len((workdir / "summaries.txt").read_text(encoding="utf-8").splitlines()) == INPUTS
    shown = next(out for command, out in ran if "--show-prompt" in command)
    assert "Translate into German" in shown and re.search(r"\n-- news\.en:1: \d+ prompt tokens\n$", shown), (
        shown
    )
    table = next(out for command, out in ran if command.startswith("seqgen eval summaries.txt"))
    assert table.startswith("metric      score  detail\nROUGE-1 "), table
    assert (workdir / "news.de").exists() and (workdir / "one-line-summaries.txt").exists()


@pytest.mark.slow
def test_the_guide_examples_run(models: dict[str, Path], workdir: Path) -> None:
    ran = _run_doc("docs/GUIDE.md", models, _not_here)
    assert any(c.startswith("seqgen merge") for c, _ in ran) and any("--chat" in c for c, _ in ran), ran
    assert len((workdir / "out.txt").read_text(encoding="utf-8").splitlines()) == 2 * SHARDS
    (api,) = [block for block in _blocks("docs/GUIDE.md", "python") if "from seqgen_cli" in block]
    code = api.replace('"bart-large-cnn"', repr(str(models["bart-large-cnn"])))
    exec(compile(code, "docs/GUIDE.md (Python API)", "exec"), {})
