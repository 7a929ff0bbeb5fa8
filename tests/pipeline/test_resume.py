"""What ``--resume``, the journal and ``seqgen merge`` compare: every option of ``seqgen generate`` either reaches
the fingerprint (``pipeline/resume.py: FINGERPRINTED``) or is declared output-neutral (``OUTPUT_NEUTRAL``); the
committed output bytes are digested in the index, so an output edited in place is not resumed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from seqgen_cli.cli import generate
from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import GeneratorSpec
from seqgen_cli.grammars import grammar_spec
from seqgen_cli.pipeline.formats import index_path
from seqgen_cli.pipeline.job import JobOptions, check_job, generate_job
from seqgen_cli.pipeline.resume import FINGERPRINTED, OUTPUT_NEUTRAL, fingerprint
from seqgen_cli.prompts import PromptSettings
from seqgen_cli.rules import SAMPLING_KEYS
from tests.helpers import FakeGen, expected, one_line_error, seqgen, with_chat_template, write_lines
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
    "stop": ("the",),
    "scores": True,
    "min_p": 0.1,
    "typical_p": 0.9,
    "epsilon_cutoff": 0.01,
    "eta_cutoff": 0.01,
    "stop_token_id": [5],
}
# structured outputs: each option's grammar (a GeneratorSpec's ``grammar``)
GRAMMAR_CHANGES = {"json_schema": '{"type": "object"}', "regex": "[a-z]+", "grammar": 'root ::= "a"', "choice": ("a",)}
# Options that need a tokenizer with language codes: changed on the tiny mBART (whose checkpoint forces de_DE).
MBART_CHANGES: dict[str, Any] = {"target_lang": "fr_XX"}
JOB_CHANGES: dict[str, Any] = {
    "input_format": "jsonl",
    "input_field": "src",
    "output_format": "jsonl",
    "output_field": "summary",
    "on_error": "skip",
}
# The prompt options, as the settings they make (on a copy of the model whose tokenizer has a chat template).
PROMPT_CHANGES: dict[str, PromptSettings] = {
    "chat": PromptSettings(chat=True),
    "system_prompt": PromptSettings(system_prompt="Be brief."),
    "chat_template": PromptSettings(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    "chat_template_kwargs": PromptSettings(chat=True, chat_template_kwargs={"enable_thinking": False}),
    "prompt_template": PromptSettings(template="Q: {input} A:"),
}
BASE = {"num_beams": 4}  # beam search, so that num_return_sequences and early_stopping can change


def _print(model: Path, opts: JobOptions | None = None, **spec: Any) -> dict[str, Any]:
    generation = {**BASE, **{k: spec.pop(k) for k in list(spec) if k in (*GENERATOR_CHANGES, "logprobs") and k not in
                             ("preset", "backend", "dtype", "prefix", "max_source_length", "seed", "stop", "scores")}}  # fmt: skip
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
    greedy = _print(model, num_beams=1)  # --logprobs: greedy search and sampling only
    assert _print(model, num_beams=1, logprobs=2)["generation"] != greedy["generation"]
    covered.add("logprobs")
    for option, value in GRAMMAR_CHANGES.items():
        spec = grammar_spec(**{"choices" if option == "choice" else option: value})
        assert _print(model, grammar=spec)["grammar"] != base.get("grammar"), option
        covered.add(option)
    mbart = tiny_models("mbart")
    mbart_base = _print(mbart)
    for option, value in MBART_CHANGES.items():
        key = FINGERPRINTED[option]
        assert _print(mbart, **{option: value})[key] != mbart_base[key], f"{option}={value!r}: same {key}"
        covered.add(option)
    chat = with_chat_template(copy_checkpoint(model, tmp_path / "chat-model"))
    chat_base = _print(chat, prompt=PromptSettings(chat=True))
    for option, prompt in PROMPT_CHANGES.items():
        reference = chat_base if prompt.chat and option != "chat" else _print(chat)
        assert _print(chat, prompt=prompt)[FINGERPRINTED[option]] != reference.get(FINGERPRINTED[option]), option
        covered.add(option)
    stopped = _print(model, stop=("x",))  # the text written (outputs.py): the stop string cut or kept, reasoning
    assert _print(model, stop=("x",), keep_stop=True)["text"] != stopped["text"]
    assert _print(model, reasoning="strip")["text"] != base.get("text")
    covered |= {"keep_stop", "reasoning"}
    for option, value in JOB_CHANGES.items():
        changed = _print(model, JobOptions(**{option: value}))
        assert changed[FINGERPRINTED[option]] != base[FINGERPRINTED[option]], option
        covered.add(option)
    other = copy_checkpoint(model, tmp_path / "other-model")
    assert _print(other)["model"] == base["model"], "a copy holds the same model (identity is content)"
    resave_weights(other)
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


def resave_weights(folder: Path) -> None:
    """Save ``folder``'s weights again with other values at the same shapes: the same file names and sizes."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    size = path.stat().st_size
    weights = load_file(path)
    save_file({k: v + 1 if v.is_floating_point() else v for k, v in weights.items()}, path, {"format": "pt"})
    assert path.stat().st_size == size


def test_the_model_is_identified_by_the_content_of_its_files(tiny_models, tmp_path: Path) -> None:
    """Weights saved anew at the same sizes, a tokenizer file changed: another model; a file touched back to its
    old modification time after a rewrite is hashed again; an unchanged folder is not hashed again."""
    import os

    from seqgen_cli import checkpoint, digests
    from seqgen_cli.pipeline.resume import model_identity

    class Named:
        def __init__(self, folder: Path) -> None:
            self.config = type("Config", (), {"_name_or_path": str(folder)})()

    model = copy_checkpoint(tiny_models("bart"), tmp_path / "model")
    first = model_identity(Named(model))["files"]
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(first)
    assert any(name.startswith("tokenizer") or name in ("vocab.json", "merges.txt") for name in first)
    assert len(first) == len(checkpoint.read_files(model))
    (model / "README.md").write_text("a model card does not decide outputs\n")
    assert model_identity(Named(model))["files"] == first

    hashed: list[str] = []
    real = digests.hashlib.file_digest

    def counting(f, name):  # noqa: ANN001, ANN202
        hashed.append(f.name)
        return real(f, name)

    digests._memo.clear()  # this process's memo: the on-disk cache alone answers
    digests.hashlib.file_digest = counting
    try:
        assert model_identity(Named(model))["files"] == first and hashed == []
        weights = model / "model.safetensors"
        st = weights.stat()
        resave_weights(model)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old size and modification time
        second = model_identity(Named(model))["files"]
    finally:
        digests.hashlib.file_digest = real
    assert hashed == [str(weights)], "only the rewritten file is hashed again"
    assert second["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in second.items() if k != "model.safetensors"} == {
        k: v for k, v in first.items() if k != "model.safetensors"
    }
    tokenizer = next(p for p in sorted(model.iterdir()) if p.name.startswith("tokenizer_config"))
    config = json.loads(tokenizer.read_text(encoding="utf-8"))
    tokenizer.write_text(json.dumps({**config, "add_prefix_space": True}), encoding="utf-8")
    assert model_identity(Named(model))["files"][tokenizer.name] != second[tokenizer.name]


@pytest.mark.parametrize("change", ["weights", "tokenizer"])
def test_resume_after_the_checkpoint_was_saved_again_is_refused(tiny_models, tmp_path: Path, change: str) -> None:
    """Through the CLI: a run stopped by a bad line, the checkpoint saved again (weights at the same sizes, or a
    tokenizer setting), ``--resume``: one line naming the changed file; the output is left as it was."""
    model = copy_checkpoint(tiny_models("bart"), tmp_path / "model")
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    lines = [t.encode() for t in sample_texts(12, seed=2)]
    src.write_bytes(b"\n".join(lines[:8] + [b"caf\xe9"] + lines[8:]) + b"\n")  # line 9 is not UTF-8
    args = ["generate", "-m", str(model), str(src), "-o", str(out), "--max-new-tokens", "3"]
    args += ["--sort-window", "0", "-q"]
    res = seqgen(*args)
    assert res.exit_code == 2 and index_path(out).exists()
    before = out.read_bytes()
    if change == "weights":
        resave_weights(model)
        changed = "model.safetensors"
    else:
        changed = "tokenizer_config.json"
        config = json.loads((model / changed).read_text(encoding="utf-8"))
        (model / changed).write_text(json.dumps({**config, "add_prefix_space": True}), encoding="utf-8")
    res = seqgen(*args, "--resume")
    one_line_error(res, f"different settings (model: {changed} changed)")
    assert out.read_bytes() == before


def test_merge_refuses_shards_made_before_and_after_the_checkpoint_was_saved_again(
    tiny_models, tmp_path: Path
) -> None:
    model = copy_checkpoint(tiny_models("bart"), tmp_path / "model")
    src = write_lines(tmp_path / "in.txt", sample_texts(6, seed=3))
    parts = [tmp_path / "part0.txt", tmp_path / "part1.txt"]
    for i, part in enumerate(parts):
        if i == 1:
            resave_weights(model)
        res = seqgen("generate", "-m", str(model), str(src), "-o", str(part), "--shard", f"{i}/2",
                     "--max-new-tokens", "3", "-q")  # fmt: skip
        assert res.exit_code == 0, res.stderr
    res = seqgen("merge", *map(str, parts), "-o", str(tmp_path / "out.txt"))
    one_line_error(res, "different settings (model: model.safetensors changed): not parts of one job")
    assert not (tmp_path / "out.txt").exists()


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
