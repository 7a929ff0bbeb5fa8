"""What ``--resume``, the journal and ``seqgen merge`` compare: every option of ``seqgen generate`` either reaches
the fingerprint (``pipeline/job.py: FINGERPRINTED``) or is declared output-neutral (``OUTPUT_NEUTRAL``); the
committed output bytes are digested in the index, so an output edited in place is not resumed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from seqgen_cli.cli import generate
from seqgen_cli.config import SAMPLING_KEYS
from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import GeneratorSpec
from seqgen_cli.pipeline.formats import index_path
from seqgen_cli.pipeline.job import (
    FINGERPRINTED,
    OUTPUT_NEUTRAL,
    JobOptions,
    check_job,
    fingerprint,
    generate_job,
)
from tests.helpers import FakeGen, expected, one_line_error, seqgen, write_lines
from tests.tiny_models import copy_checkpoint, sample_texts


def test_every_generate_option_is_fingerprinted_or_declared_neutral() -> None:
    options = {p.name for p in generate.params}
    assert not set(FINGERPRINTED) & OUTPUT_NEUTRAL
    assert options == set(FINGERPRINTED) | OUTPUT_NEUTRAL, (
        f"undeclared: {sorted(options - set(FINGERPRINTED) - OUTPUT_NEUTRAL)}; "
        f"no such option: {sorted((set(FINGERPRINTED) | OUTPUT_NEUTRAL) - options)}"
    )


# A value other than the default for each option that reaches the Generator (device: only the CPU here).
GENERATOR_CHANGES: dict[str, Any] = {
    "preset": "cnndm-bart",
    "backend": "hf",
    "dtype": "bfloat16",
    "prefix": "summarize: ",
    "max_source_length": 7,
    "seed": 3,
    "num_beams": 2,
    "max_new_tokens": 7,
    "min_new_tokens": 2,
    "max_length": 30,
    "min_length": 3,
    "length_penalty": 1.5,
    "early_stopping": "never",
    "no_repeat_ngram_size": 2,
    "num_return_sequences": 2,
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 5,
    "top_p": 0.5,
    "repetition_penalty": 1.3,
    "forced_bos_token_id": 5,
    "forced_eos_token_id": 4,
}
# Options that need a tokenizer with language codes: changed on the tiny mBART (whose checkpoint forces de_DE).
MBART_CHANGES: dict[str, Any] = {"target_lang": "fr_XX"}
JOB_CHANGES: dict[str, Any] = {
    "input_format": "jsonl",
    "input_field": "src",
    "output_format": "jsonl",
    "output_field": "summary",
    "on_error": "skip",
}
BASE = {"num_beams": 4}  # beam search, so that num_return_sequences and early_stopping can change


def _print(model: Path, opts: JobOptions | None = None, **spec: Any) -> dict[str, Any]:
    generation = {**BASE, **{k: spec.pop(k) for k in list(spec) if k in GENERATOR_CHANGES and k not in
                             ("preset", "backend", "dtype", "prefix", "max_source_length", "seed")}}  # fmt: skip
    gen = GeneratorSpec(model=str(model), device="cpu", generation=generation, **spec).build()
    return fingerprint(gen, opts or JobOptions())


def test_each_fingerprinted_option_changes_the_fingerprint(tiny_models, tmp_path: Path) -> None:
    model = tiny_models("bart")
    base = _print(model)
    assert base["device"] == "cpu" and base["dtype"] == "float32"
    covered = {"device", "shard_spec"}  # one device here; --shard: test_resuming_a_shard_whose_input_changed
    sampling = _print(model, do_sample=True)
    for option, value in GENERATOR_CHANGES.items():
        key = FINGERPRINTED[option]
        if option in SAMPLING_KEYS:  # set only with do_sample (transformers refuses them otherwise)
            changed, reference = _print(model, do_sample=True, **{option: value}), sampling
        else:
            changed, reference = _print(model, **{option: value}), base
        assert changed[key] != reference[key], f"{option}={value!r} does not change the fingerprint's {key}"
        covered.add(option)
    mbart = tiny_models("mbart")
    mbart_base = _print(mbart)
    for option, value in MBART_CHANGES.items():
        key = FINGERPRINTED[option]
        assert _print(mbart, **{option: value})[key] != mbart_base[key], f"{option}={value!r}: same {key}"
        covered.add(option)
    for option, value in JOB_CHANGES.items():
        changed = _print(model, JobOptions(**{option: value}))
        assert changed[FINGERPRINTED[option]] != base[FINGERPRINTED[option]], option
        covered.add(option)
    other = copy_checkpoint(model, tmp_path / "other-model")
    assert _print(other)["model"] != base["model"]
    covered.add("model")
    assert covered == set(FINGERPRINTED)


def test_a_checkpoint_saved_anew_in_the_same_folder_is_another_model(tiny_models, tmp_path: Path) -> None:
    model = copy_checkpoint(tiny_models("bart"), tmp_path / "model")
    before = _print(model)["model"]
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    config["dropout"] = 0.25  # a changed config, same folder
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert _print(model)["model"] != before


def _interrupted(tmp_path: Path, texts: list[str], fail_at: int, resume: bool = False) -> Path:
    """A job over ``texts`` whose ``fail_at``-th generated batch raises (the run keeps index and journal)."""
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    write_lines(src, texts)
    calls = []

    def crash(batch) -> None:
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("stop here")

    opts = JobOptions(batch_size=3, sort_window=0, resume=resume)
    with pytest.raises(SeqgenError, match="stop here"):
        generate_job(FakeGen(fail=crash), check_job([str(src)], str(out), opts))
    assert index_path(out).exists()
    return out


def test_resume_refuses_an_output_edited_in_place(tmp_path: Path) -> None:
    texts = [f"input {i:02d}" for i in range(30)]
    out = _interrupted(tmp_path, texts, fail_at=5)
    data = bytearray(out.read_bytes())
    assert len(data) > 10
    i = next(i for i in range(len(data) - 1) if data[i] != data[i + 1] and b"\n" not in data[i : i + 2])
    data[i], data[i + 1] = data[i + 1], data[i]  # two characters swapped: same size
    out.write_bytes(bytes(data))
    with pytest.raises(SeqgenError, match="were changed since they were written.*delete both"):
        generate_job(FakeGen(), check_job([str(tmp_path / "in.txt")], str(out), JobOptions(resume=True)))


def test_resume_after_resume_checks_and_extends_the_digest(tmp_path: Path) -> None:
    texts = [f"input {i:02d}" for i in range(30)]
    _interrupted(tmp_path, texts, fail_at=3)
    out = _interrupted(tmp_path, texts, fail_at=3, resume=True)  # the digest goes on from the resumed bytes
    opts = JobOptions(batch_size=3, sort_window=0, resume=True)
    generate_job(FakeGen(), check_job([str(tmp_path / "in.txt")], str(out), opts))
    assert out.read_text(encoding="utf-8") == expected(texts)
    assert not index_path(out).exists()


def test_resume_with_another_dtype_is_refused(tiny_models, tmp_path: Path) -> None:
    """A float32 run stopped by a bad line, resumed with --dtype bfloat16: refused, naming dtype."""
    bart = str(tiny_models("bart"))
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    lines = [t.encode() for t in sample_texts(12, seed=2)]
    src.write_bytes(b"\n".join(lines[:8] + [b"caf\xe9"] + lines[8:]) + b"\n")  # line 9 is not UTF-8
    args = [
        "generate",
        "-m",
        bart,
        str(src),
        "-o",
        str(out),
        "--max-new-tokens",
        "3",
        "--sort-window",
        "0",
        "-q",
    ]
    res = seqgen(*args)
    assert res.exit_code == 2 and f"{src}:9: not valid UTF-8" in res.stderr
    assert out.read_bytes().count(b"\n") == 8 and index_path(out).exists()
    before = out.read_bytes()
    res = seqgen(*args, "--resume", "--dtype", "bfloat16")
    one_line_error(res, "different settings (dtype)")
    assert out.read_bytes() == before
