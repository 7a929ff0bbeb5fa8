"""One validation of generation settings, whatever their source (``rules.RULES``, resolved by ``config``): a flag, a
preset file and the checkpoint's generation_config.json get the same checks, and the one-line error names the source.
Nothing is written when a setting is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import one_line_error, seqgen, write_lines
from tests.tiny_models import copy_checkpoint


def _run(tiny_models, tmp_path: Path, *args: str, model: Path | None = None):
    src = write_lines(tmp_path / "in.txt", ["a short input", "another one"])
    out = tmp_path / "out.txt"
    res = seqgen("generate", "-m", str(model or tiny_models("bart")), str(src), "-o", str(out), "-q", *args)
    assert not out.exists() and not list(tmp_path.glob("out.txt.*")), "nothing may be written"
    return res


@pytest.mark.parametrize(
    "body,needle",
    [
        ("do_sample = true\ntemperature = 0", "temperature = 0: must be a finite number > 0"),
        ("top_p = 1.5", "top_p = 1.5: must be a finite number > 0 and <= 1"),
        ('num_beams = "four"', "num_beams = 'four': must be a whole number >= 1"),
        ("num_beams = 0", "num_beams = 0: must be a whole number >= 1"),
        ("num_beams = 2.0", "num_beams = 2.0: must be a whole number"),
        ("length_penalty = nan", "length_penalty = nan: must be a finite number"),
        ('early_stopping = "sometimes"', "early_stopping = 'sometimes': must be true or false or never"),
        ("min_length = 40\nmax_length = 20", "min_length = 40 cannot be reached under"),
    ],
)
def test_a_preset_goes_through_the_checks_a_flag_goes_through(
    tiny_models, tmp_path: Path, body, needle
) -> None:
    preset = tmp_path / "task.toml"
    preset.write_text(f'description = "x"\n[generation]\n{body}\n', encoding="utf-8")
    res = _run(tiny_models, tmp_path, "--preset", str(preset))
    one_line_error(res, f"preset {preset}: ", needle)
    assert res.exit_code == 2


def test_a_preset_max_source_length_is_checked(tiny_models, tmp_path: Path) -> None:
    preset = tmp_path / "task.toml"
    preset.write_text("max_source_length = -5\n", encoding="utf-8")
    one_line_error(
        _run(tiny_models, tmp_path, "--preset", str(preset)), "max_source_length = -5: must be a whole"
    )


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--length-penalty", "nan"], "--length-penalty nan: must be a finite number"),
        (["--num-beams", "0"], "--num-beams 0: must be a whole number >= 1"),
        (["--top-p", "0"], "--top-p 0.0: must be a finite number > 0 and <= 1"),
        (["--repetition-penalty", "inf"], "--repetition-penalty inf: must be a finite number > 0"),
        (["--min-new-tokens", "9", "--max-new-tokens", "4"], "--min-new-tokens 9 cannot be reached under"),
        (
            ["--min-length", "30", "--max-new-tokens", "5"],
            "--min-length 30 cannot be reached under --max-new",
        ),
    ],
)
def test_flags_name_themselves(tiny_models, tmp_path: Path, flags: list[str], needle: str) -> None:
    res = _run(tiny_models, tmp_path, *flags)
    one_line_error(res, needle)
    assert res.exit_code == 2


def test_a_preset_minimum_under_a_maximum_flag_runs_as_generate_does(tiny_models) -> None:
    """cnndm-bart's min_length 56 under --max-new-tokens 9 is not an error (generate() runs every output to 9)."""
    from seqgen_cli.generator import Generator

    gen = Generator(str(tiny_models("bart")), preset="cnndm-bart", max_new_tokens=9)
    assert gen.config.min_length == 56 and gen.config.max_new_tokens == 9


def test_the_checkpoint_generation_config_is_checked_and_named(tiny_models, tmp_path: Path) -> None:
    model = copy_checkpoint(tiny_models("bart"), tmp_path / "model")
    path = model / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["no_repeat_ngram_size"] = -1
    path.write_text(json.dumps(config), encoding="utf-8")
    res = _run(tiny_models, tmp_path, model=model)
    # before the weights load
    one_line_error(res, f"{path}: no_repeat_ngram_size = -1: must be a whole number")
    src, out = tmp_path / "in.txt", tmp_path / "fixed.txt"
    fixed = seqgen(
        "generate", "-m", str(model), str(src), "-o", str(out), "--no-repeat-ngram-size", "2", "-q"
    )
    assert fixed.exit_code == 0 and out.read_text(encoding="utf-8").count("\n") == 2, fixed.stderr


def test_temperature_zero_is_greedy_search(tiny_models, tmp_path: Path) -> None:
    """``--temperature 0`` was an error ("must be > 0") where vLLM and llama.cpp read it as greedy: over a checkpoint
    that samples by default (as Qwen's and Llama 3.1's do), it gives ``--no-do-sample``'s outputs."""
    model = copy_checkpoint(tiny_models("gpt2"), tmp_path / "model")
    path = model / "generation_config.json"
    settings = {**json.loads(path.read_text(encoding="utf-8")), "do_sample": True, "temperature": 0.7}
    path.write_text(json.dumps(settings), encoding="utf-8")
    src = write_lines(tmp_path / "in.txt", ["a short input", "another one"])
    outs = []
    for flag in ("--temperature=0", "--no-do-sample"):
        res = seqgen("generate", "-m", str(model), str(src), "--max-new-tokens", "8", "-q", flag)
        assert res.exit_code == 0, res.stderr
        outs.append(res.stdout)
    assert outs[0] == outs[1] and outs[0].count("\n") == 2
    both = _run(tiny_models, tmp_path, "--temperature", "0", "--do-sample")
    one_line_error(both, "--temperature 0 is greedy")


def test_sampling_the_user_did_not_ask_for_is_said_once(tiny_models, tmp_path: Path) -> None:
    """A checkpoint that samples by default, unseeded: two runs differ and nothing said so."""
    model = copy_checkpoint(tiny_models("gpt2"), tmp_path / "model")
    path = model / "generation_config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text(encoding="utf-8")), "do_sample": True}), encoding="utf-8"
    )
    src = write_lines(tmp_path / "in.txt", ["a short input", "another one"])
    args = ("generate", "-m", str(model), str(src), "--max-new-tokens", "4")
    res = seqgen(*args)
    assert res.exit_code == 0 and res.stderr.count("the model's own settings sample") == 1, res.stderr
    for more in (("--seed", "1"), ("--do-sample",), ("--temperature", "0")):
        assert "settings sample" not in seqgen(*args, *more).stderr
