"""End-to-end behaviour of `seqgen generate` / `eval` / `presets` on tiny checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch

from seqgen_cli.cli import main
from seqgen_cli.cli_options import GENERATION_OPTIONS
from seqgen_cli.rules import GENERATION_KEYS
from tests.helpers import seqgen
from tests.tiny_models import load_tiny, sample_texts

REPO = Path(__file__).resolve().parents[2]


def reference_generate(model_dir: Path, texts: list[str], causal: bool = False, **settings) -> list[str]:
    """transformers generate() called directly, one input at a time (no padding effects)."""
    model, tok = load_tiny(model_dir)
    outs = []
    for text in texts:
        enc = tok(text, return_tensors="pt")
        with torch.inference_mode():
            seq = model.generate(**enc, **settings)
        start = enc["input_ids"].shape[1] if causal else 1
        outs.append(tok.decode(seq[0, start:], skip_special_tokens=True))
    return outs


@pytest.fixture(scope="module")
def bart(tiny_models) -> Path:
    return tiny_models("bart")


def test_stdin_to_stdout_two_lines_equal_hf_and_direct_generate(bart: Path) -> None:
    stdin = "first line\nsecond line\n"
    fast = seqgen(
        "generate", "-m", str(bart), "--num-beams", "4", "--max-new-tokens", "12", "-q", input=stdin
    )
    hf = seqgen(
        "generate",
        "-m",
        str(bart),
        "--num-beams",
        "4",
        "--max-new-tokens",
        "12",
        "-q",
        "--backend",
        "hf",
        input=stdin,
    )
    assert fast.exit_code == 0, fast.stderr
    lines = fast.stdout.splitlines()
    assert len(lines) == 2
    assert lines == hf.stdout.splitlines()
    assert lines == reference_generate(bart, ["first line", "second line"], num_beams=4, max_new_tokens=12)


def test_files_and_jsonl_agree_and_keep_order(bart: Path, tmp_path: Path) -> None:
    texts = sample_texts(7)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    jsrc = tmp_path / "in.jsonl"
    jsrc.write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8"
    )
    out_txt, out_json = tmp_path / "out.txt", tmp_path / "out.jsonl"
    common = ["-m", str(bart), "--max-new-tokens", "8", "--batch-size", "3", "-q"]
    assert seqgen("generate", str(src), "-o", str(out_txt), *common).exit_code == 0
    res = seqgen("generate", str(jsrc), "-o", str(out_json), "--output-format", "jsonl", *common)
    assert res.exit_code == 0, res.stderr
    records = [json.loads(line) for line in out_json.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == list(range(7))  # order and passthrough fields kept
    assert [r["output"] for r in records] == out_txt.read_text(encoding="utf-8").splitlines()
    assert out_txt.read_text(encoding="utf-8").splitlines() == reference_generate(
        bart, texts, max_new_tokens=8
    )


def test_num_return_sequences_lines_and_lists(bart: Path) -> None:
    stdin = "one input\nanother input\n"
    args = [
        "generate",
        "-m",
        str(bart),
        "--num-beams",
        "3",
        "--num-return-sequences",
        "3",
        "--max-new-tokens",
        "6",
        "-q",
    ]
    text = seqgen(*args, input=stdin)
    assert text.exit_code == 0, text.stderr
    assert len(text.stdout.splitlines()) == 6
    js = seqgen(*args, "--output-format", "jsonl", input=stdin)
    rows = [json.loads(line)["output"] for line in js.stdout.splitlines()]
    assert [len(r) for r in rows] == [3, 3]
    assert [o for r in rows for o in r] == text.stdout.splitlines()


def test_decoder_only_outputs_continuation_only(tiny_models) -> None:
    gpt2 = tiny_models("gpt2")
    texts = ["the cat sat on", "a long time ago in a quiet village"]
    res = seqgen("generate", "-m", str(gpt2), "--max-new-tokens", "5", "-q", input="\n".join(texts) + "\n")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.splitlines() == reference_generate(gpt2, texts, causal=True, max_new_tokens=5)


def test_empty_input_and_empty_lines(bart: Path) -> None:
    empty = seqgen("generate", "-m", str(bart), "-q", input="")
    assert (empty.exit_code, empty.stdout) == (0, "")
    res = seqgen("generate", "-m", str(bart), "--max-new-tokens", "4", "-q", input="\nsome text\n\n")
    assert res.exit_code == 0
    lines = res.stdout.split("\n")
    assert len(lines) == 4 and lines[0] == "" and lines[2] == "" and lines[3] == ""


def test_preset_then_flags_override(bart: Path) -> None:
    from seqgen_cli.generator import Generator

    gen = Generator(str(bart), preset="cnndm-bart", max_new_tokens=9)
    assert gen.config.num_beams == 4 and gen.config.no_repeat_ngram_size == 3
    assert (
        gen.config.max_new_tokens == 9 and gen.config.max_length is None
    )  # flag replaced the preset's max_length
    assert gen.config.min_length == 56


def test_presets_command_lists_required_presets() -> None:
    res = seqgen("presets")
    assert res.exit_code == 0
    for name in ("cnndm-bart", "xsum-pegasus", "wmt-marian", "t5-summarize"):
        assert name in res.stdout


def test_truncation_is_counted_on_stderr(bart: Path) -> None:
    res = seqgen(
        "generate",
        "-m",
        str(bart),
        "--max-source-length",
        "5",
        "--max-new-tokens",
        "3",
        input="short\n" + "word " * 40 + "\n",
    )
    assert res.exit_code == 0
    assert "1 of 2 inputs truncated to 5 tokens" in res.stderr


# -- bad input: one line on stderr naming the problem, non-zero exit, no traceback --------------
def _assert_one_line_error(res, *needles: str) -> None:
    assert res.exit_code != 0
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("seqgen: error:"), err
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in err, err


def test_missing_model_folder(tmp_path: Path) -> None:
    _assert_one_line_error(seqgen("generate", "-m", str(tmp_path / "nope"), input="x\n"), "does not exist")


def test_folder_without_checkpoint(tmp_path: Path) -> None:
    _assert_one_line_error(seqgen("generate", "-m", str(tmp_path), input="x\n"), "no config.json")


def test_hub_id_while_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    _assert_one_line_error(
        seqgen("generate", "-m", "some-org/some-model", input="x\n"), "cannot be reached", "-m /path"
    )


def test_architecture_that_cannot_generate(tmp_path: Path) -> None:
    from transformers import ViTConfig

    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8).save_pretrained(
        tmp_path
    )
    _assert_one_line_error(
        seqgen("generate", "-m", str(tmp_path), input="x\n"), "'vit'", "not a text-generation model"
    )


def test_missing_input_file(bart: Path, tmp_path: Path) -> None:
    _assert_one_line_error(
        seqgen("generate", "-m", str(bart), str(tmp_path / "missing.txt")),
        "missing.txt",
        "no such input file",
    )


def test_non_utf8_line_is_named(bart: Path, tmp_path: Path) -> None:
    src = tmp_path / "bad.txt"
    src.write_bytes(b"fine\nalso fine\n\xff\xfebroken\n")
    _assert_one_line_error(seqgen("generate", "-m", str(bart), str(src), "-q"), "bad.txt:3", "UTF-8")


def test_invalid_jsonl_line_is_named(bart: Path, tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    _assert_one_line_error(seqgen("generate", "-m", str(bart), str(src), "-q"), "bad.jsonl:2", "invalid JSON")


def test_missing_jsonl_field_is_named(bart: Path, tmp_path: Path) -> None:
    src = tmp_path / "f.jsonl"
    src.write_text('{"text": "ok"}\n{"body": "no text field"}\n', encoding="utf-8")
    _assert_one_line_error(seqgen("generate", "-m", str(bart), str(src), "-q"), "f.jsonl:2", "--input-field")
    res = seqgen("generate", "-m", str(bart), str(src), "--input-field", "body", "-q")
    _assert_one_line_error(res, "f.jsonl:1", "'body'")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--max-new-tokens", "5", "--max-length", "9"], "contradict"),
        (["--temperature", "0.7"], "do_sample"),
        (["--num-beams", "2", "--num-return-sequences", "3"], "at least as many beams"),
    ],
)
def test_conflicting_flags(bart: Path, flags: list[str], needle: str) -> None:
    _assert_one_line_error(seqgen("generate", "-m", str(bart), *flags, input="x\n"), needle)


def test_output_folder_missing(bart: Path, tmp_path: Path) -> None:
    res = seqgen("generate", "-m", str(bart), "-o", str(tmp_path / "no" / "out.txt"), input="x\n")
    _assert_one_line_error(res, "output folder", "does not exist")


def test_unknown_preset(bart: Path) -> None:
    _assert_one_line_error(
        seqgen("generate", "-m", str(bart), "--preset", "nope", input="x\n"), "unknown preset"
    )


def test_eval_mismatched_lines(tmp_path: Path) -> None:
    (tmp_path / "h").write_text("a\nb\n", encoding="utf-8")
    (tmp_path / "r").write_text("a\n", encoding="utf-8")
    _assert_one_line_error(seqgen("eval", str(tmp_path / "h"), str(tmp_path / "r")), "2", "1")


def test_eval_json_equals_libraries(tmp_path: Path) -> None:
    import sacrebleu

    hyps = ["the cat sat on the mat", "a dog barked loudly at night"]
    refs = ["the cat is on the mat", "the dog barked at night"]
    (tmp_path / "h").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    (tmp_path / "r").write_text("\n".join(refs) + "\n", encoding="utf-8")
    res = seqgen("eval", str(tmp_path / "h"), str(tmp_path / "r"), "--metrics", "bleu,chrf", "--json")
    data = json.loads(res.stdout)
    assert data["bleu"]["score"] == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert data["chrf"]["score"] == sacrebleu.corpus_chrf(hyps, [refs]).score


def test_real_pipe_through_console_entry(bart: Path, tmp_path: Path) -> None:
    """`printf 'first line\\nsecond line\\n' | seqgen generate -m DIR --num-beams 4 > out.txt`."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "out.txt"
    with out.open("w") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "seqgen_cli", "generate", "-m", str(bart), "--num-beams", "4", "--max-new-tokens", "6"],
            input=b"first line\nsecond line\n", stdout=fh, stderr=subprocess.PIPE, env=env, timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
    assert b"inputs in" in proc.stderr  # the summary goes to stderr, never into the output


def test_every_option_has_help() -> None:
    """`seqgen COMMAND --help` explains every option."""
    for name, command in main.commands.items():
        assert command.help, name
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"seqgen {name} {param.opts[0]} has no help text"
        assert seqgen(name, "--help").exit_code == 0


def test_every_generation_key_is_a_flag() -> None:
    """The one table of generation flags covers GENERATION_KEYS, the keys presets and Generator take."""
    assert list(GENERATION_OPTIONS) == list(GENERATION_KEYS)
    generate_params = {p.name for p in main.commands["generate"].params}
    assert set(GENERATION_KEYS) <= generate_params
    bench_params = {p.name for p in main.commands["bench"].params}
    assert {"max_new_tokens", "early_stopping", "repetition_penalty", "do_sample", "top_p"} <= bench_params
    assert "num_return_sequences" not in bench_params, "one output per input in a cell"


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("given, value", [("true", True), ("false", False), ("never", "never"), (None, None)])
def test_early_stopping_values(
    command: str, given: str | None, value: bool | str | None, tmp_path: Path
) -> None:
    """--early-stopping true|false|never reaches both commands as transformers takes it."""
    args = ["-m", "m", *(["--early-stopping", given] if given else [])]
    if command == "bench":
        (tmp_path / "in.txt").write_text("x\n")
        args.append(str(tmp_path / "in.txt"))
    with main.commands[command].make_context(command, args) as ctx:
        assert ctx.params["early_stopping"] == value


def test_sampling_with_a_seed_repeats(bart: Path) -> None:
    args = [
        "generate",
        "-m",
        str(bart),
        "--do-sample",
        "--top-k",
        "20",
        "--seed",
        "3",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "-q",
    ]
    stdin = "".join(f"input number {i}\n" for i in range(5))
    first, second = seqgen(*args, input=stdin), seqgen(*args, input=stdin)
    assert first.exit_code == 0, first.stderr
    assert first.stdout == second.stdout and len(first.stdout.splitlines()) == 5


def test_auto_backend_says_when_it_falls_back_to_generate(bart: Path) -> None:
    res = seqgen(
        "generate", "-m", str(bart), "--num-beams", "2", "--do-sample", "--max-new-tokens", "3", input="a b\n"
    )
    assert res.exit_code == 0, res.stderr
    assert "seqgen: note: running transformers generate(): beam sampling" in res.stderr
    quiet = seqgen("generate", "-m", str(bart), "--max-new-tokens", "3", input="a b\n")
    assert "note:" not in quiet.stderr  # the fast engine runs it: nothing to say


@pytest.mark.parametrize("flags", [[], ["--max-new-tokens", "20"], ["--preset", "cnndm-bart"]])
def test_outputs_cut_by_transformers_default_length_are_named(tiny_models, tmp_path: Path, flags: list[str]) -> None:
    """No length from the checkpoint, a preset or a flag: transformers' default of 20 new tokens applies, and the
    outputs it cut are counted at the end, naming the flag to set (before: every output 20 tokens, silently).
    The same length chosen by a flag, or a preset's, is the user's: no note."""
    src = tmp_path / "in.txt"
    src.write_text("".join(t + "\n" for t in sample_texts(3, seed=3)), encoding="utf-8")
    res = seqgen("generate", "-m", str(tiny_models("bart")), str(src), "-o", str(tmp_path / "out.txt"), *flags)
    assert res.exit_code == 0, res.stderr
    notes = [line for line in res.stderr.splitlines() if "default length limit" in line]
    if flags:
        assert notes == [], res.stderr
    else:
        assert len(notes) == 1 and notes[0].startswith("seqgen: note: ") and "--max-new-tokens" in notes[0]
        assert " of 3 outputs stopped at transformers' default length limit of 20 new tokens" in notes[0]
