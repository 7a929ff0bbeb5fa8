"""Inputs and checkpoints that used to crash, hang or change an output: a named pipe, a JSON text no tokenizer
takes, a byte-order mark, NaN in JSONL, broken weights, SIGTERM while the model loads; and a first run that
fails before any output leaves nothing behind, so the fix the error names works."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import REPO, one_line_error, run_seqgen, seqgen, with_fixture_tokenizer, write_lines
from tests.tiny_models import copy_checkpoint, sharpen

ARGS = ("--max-new-tokens", "3", "-q")


def _generate(model: Path, *args: str, input: bytes | None = None):
    return seqgen("generate", "-m", str(model), *args, *ARGS, input=input)


@pytest.mark.slow
def test_a_named_pipe_is_read_once_and_streamed(tiny_models, tmp_path: Path) -> None:
    fifo, out = tmp_path / "in.fifo", tmp_path / "out.txt"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "w", encoding="utf-8") as fh:
            fh.write("first input\nsecond input\n")

    threading.Thread(target=feed, daemon=True).start()
    res = run_seqgen(
        "generate", "-m", str(tiny_models("bart")), str(fifo), "-o", str(out), *ARGS, timeout=120
    )
    assert res.returncode == 0, res.stderr.decode()
    assert out.read_text(encoding="utf-8").count("\n") == 2
    assert not list(tmp_path.glob("out.txt.seqgen-*"))


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_lone_surrogate_in_jsonl_is_a_bad_line(tiny_models, tmp_path: Path, on_error: str) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.txt"
    src.write_text('{"text": "good one"}\n{"text": "a\\ud800b"}\n{"text": "good two"}\n', encoding="utf-8")
    res = _generate(tiny_models("bart"), str(src), "-o", str(out), "--on-error", on_error)
    lines = out.read_text(encoding="utf-8").splitlines()
    if on_error == "fail":
        assert res.exit_code == 2, res.stderr
        assert f"{src}:2: not valid Unicode: a lone surrogate (\\ud800)" in res.stderr
        assert len(lines) == 1 and lines[0], "the good line before it is written"
    else:
        assert res.exit_code == 0, res.stderr
        assert len(lines) == 3 and lines[1] == "" and lines[0] and lines[2]


def test_a_byte_order_mark_is_not_text(tiny_models, tmp_path: Path) -> None:
    model = tiny_models("bart")
    plain = write_lines(tmp_path / "plain.txt", ["the first line", "the second"])
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    jsonl = tmp_path / "marked.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"text": "the first line"}\n{"text": "the second"}\n')
    outs = {}
    for src in (plain, marked, jsonl):
        res = _generate(model, str(src))
        assert res.exit_code == 0, res.stderr
        outs[src.name] = res.stdout
    assert outs["marked.txt"] == outs["plain.txt"] == outs["marked.jsonl"]


def test_nan_in_jsonl_fails_its_line_and_output_stays_json(tiny_models, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine", "score": 1.5}\n{"text": "x", "score": NaN}\n', encoding="utf-8")
    res = _generate(tiny_models("bart"), str(src), "-o", str(tmp_path / "out.jsonl"))
    assert res.exit_code == 2 and f"{src}:2: invalid JSON: NaN is not a JSON value" in res.stderr
    out = tmp_path / "skipped.jsonl"
    res = _generate(
        tiny_models("bart"), str(src), "-o", str(out), "--on-error", "skip", "--output-format", "jsonl"
    )
    assert res.exit_code == 0, res.stderr

    def strict(constant: str) -> None:
        raise ValueError(constant)

    rows = [json.loads(line, parse_constant=strict) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 2 and "error" in rows[1] and rows[0]["score"] == 1.5


def test_broken_weights_are_one_line_naming_the_file(tiny_models, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["an input"])
    truncated = copy_checkpoint(tiny_models("bart"), tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    res = _generate(truncated, str(src))
    one_line_error(res, f"model {truncated}: cannot load its weights (model.safetensors)")
    assert res.exit_code == 2

    pickled = copy_checkpoint(tiny_models("bart"), tmp_path / "pickled")
    state = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    state["extra"] = print  # a global weights_only loading refuses (and must keep refusing)
    torch.save(state, pickled / "pytorch_model.bin")
    res = _generate(pickled, str(src))
    one_line_error(res, "(pytorch_model.bin) hold Python objects besides tensors (print)", "weights_only")
    assert res.exit_code == 2


def _catches_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal mask from /proc")
def test_sigterm_while_the_model_loads_is_an_interrupt(tiny_models, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["an input"])
    out = tmp_path / "out.txt"
    cmd = [
        sys.executable,
        "-m",
        "seqgen_cli",
        "generate",
        "-m",
        str(tiny_models("bart")),
        str(src),
        "-o",
        str(out),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not _catches_sigterm(proc.pid):  # the handler is set before torch is imported
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 130 and lines and lines[-1].startswith("seqgen: interrupted"), err.decode()
    assert not out.exists() and not list(tmp_path.glob("out.txt.seqgen-*"))


def test_sigterm_before_a_command_runs_is_an_interrupt_not_clicks_abort() -> None:
    """SIGTERM landing while click still parses the arguments (its handler is set first thing): exit 130 and the
    interrupt line, not click's "Aborted!" and exit 1 (a KeyboardInterrupt outside a command)."""
    code = (
        "import os, signal\n"
        "from seqgen_cli import cli\n"
        "from seqgen_cli.pipeline import process\n"
        "signal.signal(signal.SIGTERM, process.on_sigterm)\n"
        "parse = cli._Group.make_context\n"
        "def parsing(self, *args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return parse(self, *args, **kwargs)\n"
        "cli._Group.make_context = parsing\n"
        "cli.main(['presets'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert (proc.returncode, proc.stderr) == (130, "seqgen: interrupted\n"), proc.stderr


def test_a_run_that_fails_before_any_output_leaves_nothing_and_the_fix_runs(
    tiny_models, tmp_path: Path
) -> None:
    """The field is `document`: the error says so; the rerun with --input-field works without --resume."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"document": "one"}\n{"document": "two"}\n', encoding="utf-8")
    res = _generate(tiny_models("bart"), str(src), "-o", str(out))
    assert res.exit_code == 2 and "no field" in res.stderr and "--input-field" in res.stderr
    assert "--resume" not in res.stderr  # a first line: named before the model loads, no run to resume
    assert not out.exists() and not list(tmp_path.glob("out.jsonl.seqgen-*"))
    res = _generate(tiny_models("bart"), str(src), "-o", str(out), "--input-field", "document")
    assert res.exit_code == 0, res.stderr
    assert out.read_text(encoding="utf-8").count("\n") == 2


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_duplicate_key_in_jsonl_is_a_bad_line_naming_it(tiny_models, tmp_path: Path, on_error: str) -> None:
    """JSON keeps a repeated key's last value: a silent loss, so the line is bad (``--on-error`` rules)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.txt"
    src.write_text('{"text": "one"}\n{"text": "two", "text": "three"}\n{"text": "four"}\n', encoding="utf-8")
    res = _generate(tiny_models("bart"), str(src), "-o", str(out), "--on-error", on_error)
    lines = out.read_text(encoding="utf-8").splitlines()
    needle = f"{src}:2: duplicate key 'text'"
    if on_error == "fail":
        one_line_error(res, needle)
        assert res.exit_code == 2 and len(lines) == 1 and lines[0], "the good line before it is written"
    else:
        assert res.exit_code == 0, res.stderr
        assert needle in res.stderr and "skipped" in res.stderr
        assert len(lines) == 3 and lines[1] == "" and lines[0] and lines[2]


def test_an_input_holding_the_output_field_stops_before_the_model_loads(tiny_models, tmp_path: Path) -> None:
    """JSONL output would overwrite the input's own ``output``: one line naming file, line and field, before the
    model loads (a missing model folder is not reached), nothing written; ``--output-field`` another name runs."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"text": "one", "output": "mine"}\n{"text": "two", "output": "also"}\n', encoding="utf-8")
    jsonl = ("-o", str(out), "--output-format", "jsonl")
    wanted = f"{src}:1: the input already has a field 'output'"
    for on_error in ("fail", "skip"):
        res = _generate(tiny_models("bart"), str(src), *jsonl, "--on-error", on_error)
        one_line_error(res, wanted, "--output-field")
        assert res.exit_code == 2
        assert not out.exists() and not list(tmp_path.glob("out.jsonl.seqgen-*"))
    res = _generate(tmp_path / "no-such-model", str(src), *jsonl)
    one_line_error(res, wanted, "--output-field")

    res = _generate(tiny_models("bart"), str(src), *jsonl, "--output-field", "other")
    assert res.exit_code == 0, res.stderr
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["output"] for r in rows] == ["mine", "also"] and all(isinstance(r["other"], str) for r in rows)


def test_other_fields_the_output_would_overwrite(tiny_models, tmp_path: Path) -> None:
    """``error`` under ``--on-error skip`` (JSONL output), text input's ``text``, and ``--output-field error``."""
    model = tiny_models("bart")
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "one", "error": "none"}\n', encoding="utf-8")
    res = _generate(model, str(src), "--output-format", "jsonl", "--on-error", "skip")
    one_line_error(res, f"{src}:1: the input already has a field 'error'", "--on-error skip")
    res = _generate(model, str(src), "--output-format", "jsonl")  # no error field is written: no clash
    assert res.exit_code == 0 and json.loads(res.stdout)["error"] == "none", res.stderr

    text = write_lines(tmp_path / "in.txt", ["one"])
    res = _generate(model, str(text), "--output-format", "jsonl", "--output-field", "text")
    one_line_error(res, f"{text}:1: text input is written", "--output-field")
    res = _generate(
        model, str(text), "--output-format", "jsonl", "--output-field", "error", "--on-error", "skip"
    )
    one_line_error(res, "--output-field error", "--on-error skip")


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_later_line_holding_the_output_field_is_a_bad_line(
    tiny_models, tmp_path: Path, on_error: str
) -> None:
    """Past the first line, a clash follows ``--on-error``; on stdin's first line it stops the run, whatever
    ``--on-error`` says, before anything is written."""
    model = tiny_models("bart")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        '{"text": "one"}\n{"text": "two", "output": "mine"}\n{"text": "three"}\n', encoding="utf-8"
    )
    res = _generate(model, str(src), "-o", str(out), "--output-format", "jsonl", "--on-error", on_error)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    wanted = f"{src}:2: the input already has a field 'output'"
    if on_error == "fail":
        one_line_error(res, wanted, "--output-field")
        assert res.exit_code == 2 and len(rows) == 1
    else:
        assert res.exit_code == 0 and wanted in res.stderr, res.stderr
        assert len(rows) == 3 and rows[1]["output"] == "" and wanted in rows[1]["error"]
        assert rows[0]["output"] and rows[2]["output"]

    piped = b'{"text": "one", "output": "mine"}\n{"text": "two"}\n'
    res = _generate(model, "--output-format", "jsonl", "--on-error", on_error, input=piped)
    one_line_error(res, "<stdin>:1: the input already has a field 'output'", "--output-field")
    assert res.stdout == ""


def test_a_file_name_with_a_newline_keeps_the_error_one_line(tiny_models, tmp_path: Path) -> None:
    """The closing line and the error name the file with its newline escaped: each stays one line."""
    src = tmp_path / "two\nlines.jsonl"
    src.write_text("not json\n", encoding="utf-8")
    res = seqgen("generate", "-m", str(tiny_models("t5")), str(src), "--max-new-tokens", "2")
    assert res.exit_code != 0
    lines = res.stderr.strip().splitlines()
    assert all(line.startswith("seqgen: ") for line in lines), res.stderr
    assert "two\\nlines.jsonl:1: invalid JSON" in lines[-1]


def test_a_new_token_limit_past_any_memory_names_the_limit(tiny_models, tmp_path: Path) -> None:
    """T5's relative positions set no limit, so --max-new-tokens 2147483647 runs out of memory: the line names
    the limit and what one input's caches take at it, not the input."""
    src = write_lines(tmp_path / "in.txt", ["a short line"])
    res = seqgen("generate", "-m", str(tiny_models("t5")), str(src), "--max-new-tokens", "2147483647", "-q")
    one_line_error(res, "in.txt:1: out of memory: one input's caches for up to 2147483647 new tokens", "GiB, more than")


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_line_past_the_line_limit_is_a_bad_line(
    tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_error: str
) -> None:
    """A line longer than MAX_LINE_BYTES (here 64 bytes) is a bad line naming it: the run stops there, or skips it
    and goes on at the next line; an input linked to /dev/zero (one endless line) stops at once."""
    from seqgen_cli.pipeline import records

    monkeypatch.setattr(records, "MAX_LINE_BYTES", 64)
    src = tmp_path / "in.txt"
    src.write_text("a first line\n" + "x" * 200 + "\na last line\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    args = ["generate", "-m", str(tiny_models("t5")), str(src), "-o", str(out), "--max-new-tokens", "3", "-q"]
    res = seqgen(*args, "--on-error", on_error)
    if on_error == "fail":
        one_line_error(res, "in.txt:2: a line of more than")
        assert len(out.read_text(encoding="utf-8").splitlines()) == 1  # the output before it is kept
    else:
        assert res.exit_code == 0, res.stderr
        assert "in.txt:2" in res.stderr
        got = out.read_text(encoding="utf-8").splitlines()
        assert len(got) == 3 and got[1] == "" and got[0] and got[2]
    zero = tmp_path / "zero.txt"
    zero.symlink_to("/dev/zero")
    one_line_error(seqgen("generate", "-m", str(tiny_models("t5")), str(zero), "-q"), "zero.txt:1: a line of more than")


# -- user mistakes that ended in an internal error: each one line naming the line or the setting ---------------

SEQ2SEQ = dict(
    vocab_size=601, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=1, bos_token_id=0,
    eos_token_id=2, decoder_start_token_id=2,
)  # fmt: skip  # the BART fixture's special ids


def _checkpoint(config, dest: Path, fixture: Path) -> Path:
    """A tiny random checkpoint of ``config`` in ``dest``, with ``fixture``'s tokenizer."""
    import transformers as tf

    auto = tf.AutoModelForSeq2SeqLM if config.is_encoder_decoder else tf.AutoModelForCausalLM
    torch.manual_seed(0)
    sharpen(auto.from_config(config), seed=1).save_pretrained(dest)
    return with_fixture_tokenizer(dest, fixture)


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_token_past_the_models_vocabulary_is_a_bad_line(tiny_models, tmp_path: Path, on_error: str) -> None:
    """bart-large-cnn's tokenizer maps ``<mask>`` to 50264, its config has 50264 rows: a token the tokenizer has
    and the embedding has not (here one added to the tokenizer) is a bad line naming it, not an IndexError that
    ends the run under ``--on-error skip`` too; the ``--resume`` the error suggests goes on past it."""
    from transformers import AutoTokenizer

    model = copy_checkpoint(tiny_models("bart"), tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens(["<past>"], special_tokens=True)
    tok.save_pretrained(model)
    src = write_lines(tmp_path / "in.txt", ["good one", "a <past> b", "good two"])
    out = tmp_path / "out.txt"
    res = _generate(model, str(src), "-o", str(out), "--on-error", on_error)
    if on_error == "fail":
        one_line_error(res, "in.txt:2: token '<past>' (id 601) is not in the model's vocabulary", "601 rows")
        assert len(out.read_text(encoding="utf-8").splitlines()) == 1, "the line before it is written"
        again = _generate(model, str(src), "-o", str(out), "--resume", "--on-error", on_error)
        one_line_error(again, "in.txt:2: token '<past>'")  # the advice's rerun stops at it the same way
        return
    assert res.exit_code == 0, res.stderr
    assert "in.txt:2: token '<past>'" in res.stderr
    got = out.read_text(encoding="utf-8").splitlines()
    assert len(got) == 3 and got[1] == "" and got[0] and got[2]


def test_a_new_token_limit_past_leds_decoder_positions_names_its_field(tiny_models, tmp_path: Path) -> None:
    """LED's decoder has a table of its own (``max_decoder_position_embeddings``, 1,024 in led-large-16384 beside
    16,384 encoder positions): a limit past it is refused before any input, as for BART's one table."""
    import transformers as tf

    config = tf.LEDConfig(
        max_encoder_position_embeddings=256, max_decoder_position_embeddings=16, attention_window=8, **SEQ2SEQ
    )
    model = _checkpoint(config, tmp_path / "led", tiny_models("bart"))
    src = write_lines(tmp_path / "in.txt", ["a short line"])
    res = seqgen("generate", "-m", str(model), str(src), "--max-new-tokens", "40", "-q")
    one_line_error(res, "max_decoder_position_embeddings", "16")
    res = seqgen("generate", "-m", str(model), str(src), "--max-new-tokens", "8", "-q")
    assert res.exit_code == 0, res.stderr


def test_m2m100_outputs_past_its_sinusoid_table_run_as_in_generate(tiny_models, tmp_path: Path) -> None:
    """M2M-100 / NLLB make their sinusoidal positions on demand past ``max_position_embeddings`` (generate() goes
    on): the fast decoder extends its table as transformers does and gives generate()'s tokens."""
    import transformers as tf

    config = tf.M2M100Config(max_position_embeddings=8, scale_embedding=True, **SEQ2SEQ)
    model = _checkpoint(config, tmp_path / "m2m", tiny_models("bart"))
    src = write_lines(tmp_path / "in.txt", ["a short line", "another short line here"])
    lines = {}
    for backend in ("fast", "hf"):
        out = tmp_path / f"{backend}.txt"
        args = ("--min-new-tokens", "20", "--max-new-tokens", "20", "--backend", backend, "-o", str(out))
        res = seqgen("generate", "-m", str(model), str(src), *args, "-q")
        assert res.exit_code == 0, res.stderr
        lines[backend] = out.read_text(encoding="utf-8")
    assert lines["fast"] == lines["hf"] and lines["fast"].strip()


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_a_max_length_below_the_prompt_says_what_it_counts(tiny_models, tmp_path: Path, backend: str) -> None:
    """GPT-2 ``--max-length`` counts the prompt: one below it is one line saying so, on either backend (before:
    generate()'s ValueError as an internal error with --backend hf)."""
    src = write_lines(tmp_path / "in.txt", ["a prompt of quite a few words for this model"])
    res = seqgen("generate", "-m", str(tiny_models("gpt2")), str(src), "--max-length", "3", "--backend", backend, "-q")
    one_line_error(res, "in.txt:1: max_length (3) leaves no room", "--max-new-tokens counts new tokens only")


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_json_nested_too_deep_or_a_number_past_float_is_a_bad_line(
    tiny_models, tmp_path: Path, on_error: str
) -> None:
    """A JSONL line nested past Python's recursion limit (a RecursionError before) and a number such as ``1e400``
    (read as infinity and written back as ``Infinity``, not JSON) are bad lines naming the line."""
    deep = '{"text": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n' + deep + '\n{"text": "y", "n": 1e400}\n{"text": "last"}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    res = _generate(tiny_models("bart"), str(src), "-o", str(out), "--on-error", on_error, "--output-format", "jsonl")
    if on_error == "fail":
        one_line_error(res, "in.jsonl:2: invalid JSON: nested too deep")
        return
    assert res.exit_code == 0, res.stderr
    assert "in.jsonl:3: invalid JSON: 1e400 is past a float's range" in res.stderr

    def strict(constant: str) -> None:
        raise ValueError(constant)

    rows = [json.loads(line, parse_constant=strict) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4 and "error" in rows[1] and "error" in rows[2] and rows[3]["output"]


def test_nllb_moe_runs_on_generate_and_fast_is_refused_up_front(tiny_models, tmp_path: Path) -> None:
    """NLLB-MoE's decoder reads the encoder's router logits, which the generic backend does not keep (before: an
    AttributeError, with advice to --resume): ``--backend auto`` runs generate(), ``--backend fast`` is refused
    before any input, naming the model type."""
    import transformers as tf

    config = tf.NllbMoeConfig(
        num_experts=2, expert_capacity=4, encoder_sparse_step=2, decoder_sparse_step=2, max_position_embeddings=64,
        **SEQ2SEQ,
    )  # fmt: skip
    model = _checkpoint(config, tmp_path / "moe", tiny_models("bart"))
    src = write_lines(tmp_path / "in.txt", ["a short line", "another line"])
    out = tmp_path / "out.txt"
    res = seqgen("generate", "-m", str(model), str(src), "-o", str(out), "--max-new-tokens", "4", "-q")
    assert res.exit_code == 0, res.stderr
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
    res = seqgen("generate", "-m", str(model), str(src), "--backend", "fast", "--max-new-tokens", "4", "-q")
    one_line_error(res, "--backend fast cannot run this model: model_type 'nllb-moe'", "--backend hf")


@pytest.mark.parametrize(
    ("first", "needle"),
    [
        ('[{"text": "a"}, {"text": "b"}]', "a JSON array, not a JSONL line"),
        ('{"text": NaN}', "invalid JSON: NaN is not a JSON value"),
        ("plain words, not JSON", "invalid JSON"),
    ],
)
def test_a_bad_first_line_stops_the_run_before_the_model_loads(
    tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str, needle: str
) -> None:
    """Under ``--on-error fail`` the run would stop at a bad first line with nothing written: it says so before
    the model loads (before: after 5-11 s of loading and a "0 inputs" summary line); a JSON array is named as
    JSON, not JSONL, with the two ways out."""
    from seqgen_cli.generator import GeneratorSpec

    def no_load(self):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(GeneratorSpec, "build", no_load)
    src = tmp_path / "in.jsonl"
    src.write_text(first + '\n{"text": "fine"}\n', encoding="utf-8")
    res = seqgen("generate", "-m", str(tiny_models("bart")), str(src), "--input-format", "jsonl")
    line = one_line_error(res, f"in.jsonl:1: {needle}")
    if "array" in needle:
        assert "--input-format text" in line and "one object per line" in line
