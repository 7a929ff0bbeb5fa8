"""``seqgen bench`` harness on tiny random models: files produced, agreement, order, fixed lengths, ct2.

No timing assertions: the machines these run on are shared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from seqgen_cli.batching import plan_batches
from seqgen_cli.bench import ct2 as bench_ct2
from seqgen_cli.bench.cells import RunResult, interleave
from seqgen_cli.bench.decode import bench_decode
from seqgen_cli.bench.run import run_bench
from seqgen_cli.bench.settings import BenchSettings
from seqgen_cli.errors import SeqgenError
from tests.helpers import seqgen
from tests.tiny_models import sample_texts

N_NEW = 5


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return sample_texts(4)


@pytest.fixture
def input_file(tmp_path: Path, texts: list[str]) -> Path:
    path = tmp_path / "inputs.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def no_ct2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import ctranslate2`` fail, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "ctranslate2", None)


def _settings(model: Path, input_file: Path, out: Path, **kw) -> BenchSettings:
    base = dict(
        model=str(model),
        input=str(input_file),
        n=4,
        batch_sizes=[2],
        num_beams=[1],
        compare=["hf"],
        repeats=1,
        fixed_new_tokens=N_NEW,
        out=str(out),
        ct2_cache=str(out / "ct2"),
        generation={"no_repeat_ngram_size": 2},
    )
    base.update(kw)
    return BenchSettings(**base)


def test_bench_md_says_the_load_and_warns_on_a_busy_machine() -> None:
    from seqgen_cli.bench.report import load_line

    quiet = load_line({"start": [0.4, 0.5, 0.6], "end": [1.9, 1.0, 0.8]}, cores=2)
    assert quiet.startswith("Load average (1 min): 0.40 at the start, 1.90 at the end, on 2 cores.")
    assert "Busy" not in quiet
    busy = load_line({"start": [5.0, 4.0, 3.0], "end": [6.0, 5.0, 4.0]}, cores=2)
    assert "**Busy machine**: other work kept 5.0 cores busy" in busy
    assert load_line({"start": None, "end": None}, cores=2) == ""


def test_interleave_order() -> None:
    assert interleave(["seqgen", "hf", "ct2"], 2, warmup=True) == [
        ("seqgen", -1), ("hf", -1), ("ct2", -1),
        ("seqgen", 0), ("hf", 0), ("ct2", 0),
        ("seqgen", 1), ("hf", 1), ("ct2", 1),
    ]  # fmt: skip
    assert interleave(["a", "b"], 1, warmup=False) == [("a", 0), ("b", 0)]


def test_batches_sorted_by_length() -> None:
    """Bench cells batch as ``seqgen generate`` does: positions sorted by length, cut into batches."""
    assert list(plan_batches([5, 1, 3, 2, 4], 2, None)) == [[1, 3], [2, 4], [0]]


def test_decode_outputs_json_table_png(tiny_models, input_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    report = run_bench(_settings(tiny_models("marian"), input_file, out, num_beams=[1, 2], repeats=2))
    data = json.loads((out / "bench.json").read_text())
    assert (out / "bench.md").read_text().count("| seqgen |") == 2
    runs = data["runs"]
    assert {(r["system"], r["num_beams"]) for r in runs} == {(s, b) for s in ("seqgen", "hf") for b in (1, 2)}
    for r in runs:
        assert len(r["seconds"]) == 2 and r["median_s"] > 0 and r["samples_per_s"] > 0
        assert r["generated_tokens"] == 4 * N_NEW  # every output exactly N_NEW tokens (max is N_NEW)
        assert r["agreement_vs_hf"] == 100.0  # seqgen (hf or fast backend) vs generate()
        assert r["peak_mem_mb"] > 0
    assert data["schedules"][0] == ["seqgen:warmup", "hf:warmup", "seqgen:0", "hf:0", "seqgen:1", "hf:1"]
    assert data["seqgen_backend"] in ("hf", "fast")
    assert data["partial"] is False  # rewritten after every cell; final once complete
    assert "| beams | batch | system |" in report["table"]
    assert "Load average (1 min):" in (out / "bench.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_fixed_new_tokens_exact(tiny_models, texts: list[str], tmp_path: Path, family: str) -> None:
    s = _settings(
        tiny_models(family), Path("-"), tmp_path, num_beams=[2], compare=["hf", "ct2"], warmup=False
    )
    results, _, meta = bench_decode(s, texts, log=lambda _: None)
    for r in results:
        assert [len(o) for o in r.outputs] == [N_NEW] * 4, r.system
    if "ct2_skipped" not in meta:
        assert {r.system for r in results} == {"seqgen", "hf", "ct2"}


@pytest.mark.parametrize("family", ["bart", "mbart", "pegasus"])
def test_ct2_matches_hf(tiny_models, texts: list[str], tmp_path: Path, family: str) -> None:
    """The CTranslate2 quirks: BART/mBART force BOS first and EOS last (prefix, appended EOS), converted
    mBART has no decoder start token (prefix), Pegasus/mBART need the transformers-5 conversion patch."""
    pytest.importorskip("ctranslate2")
    s = _settings(tiny_models(family), Path("-"), tmp_path, compare=["hf", "ct2"], warmup=False)
    results, _, meta = bench_decode(s, texts, log=lambda _: None)
    assert "ct2_skipped" not in meta
    by = {r.system: r.outputs for r in results}
    assert by["ct2"] == by["hf"]  # greedy, float32: identical token ids


def test_ct2_missing_is_skipped_cleanly(no_ct2, tiny_models, input_file: Path, tmp_path: Path) -> None:
    assert bench_ct2.ct2_available() is not None
    with pytest.raises(SeqgenError, match="pip install ctranslate2"):
        bench_ct2.require_ct2()
    out = tmp_path / "res"
    messages: list[str] = []
    run_bench(_settings(tiny_models("gpt2"), input_file, out, compare=["hf", "ct2"]), log=messages.append)
    data = json.loads((out / "bench.json").read_text())
    assert "not installed" in data["ct2_skipped"]
    assert {r["system"] for r in data["runs"]} == {"seqgen", "hf"}
    assert any("skipping ct2" in m for m in messages)


def test_cli_bench(no_ct2, tiny_models, input_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    args = ["bench", "-m", str(tiny_models("marian")), str(input_file), "--n", "2", "--batch-sizes", "2"]
    args += "--num-beams 2 --repeats 1 --no-warmup --fixed-new-tokens 3 --out".split() + [str(out)]
    result = seqgen(*args)
    assert result.exit_code == 0, result.output
    assert "| 2 | 2 | seqgen |" in result.output
    data = json.loads((out / "bench.json").read_text())
    assert {(r["system"], r["num_beams"], r["generated_tokens"]) for r in data["runs"]} == {
        ("seqgen", 2, 6),
        ("hf", 2, 6),
    }


def test_cli_bench_bad_lists(tmp_path: Path, input_file: Path) -> None:
    result = seqgen("bench", "-m", str(tmp_path), str(input_file), "--batch-sizes", "1,x")
    assert result.exit_code == 2 and "comma-separated list of integers" in result.output


@pytest.mark.slow
def test_e2e_mode(tiny_models, input_file: Path, tmp_path: Path) -> None:
    """Whole processes, files to files: seqgen generate vs the plain-transformers script."""
    out = tmp_path / "e2e"
    s = _settings(tiny_models("gpt2"), input_file, out, n=2, modes=["e2e"], warmup=False)
    run_bench(s, log=lambda _: None)
    runs = json.loads((out / "bench.json").read_text())["runs"]
    assert {r["system"] for r in runs} == {"seqgen", "hf"}
    for r in runs:
        assert r["mode"] == "e2e" and r["agreement_vs_hf"] == 100.0 and r["peak_mem_mb"] > 0


def _plan_gen(**settings: object) -> object:
    """What ``plan_for`` reads of a Generator: a decoder-only model with ``settings`` given."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    config = GenerationConfig(eos_token_id=2, **settings)
    return SimpleNamespace(
        config=config,
        is_encoder_decoder=False,
        new_token_limits=lambda: (8, 0),
        tokenizer=SimpleNamespace(convert_ids_to_tokens=lambda i: f"t{i}"),
    )


def test_ct2_plan_takes_generate_defaults_for_unset_settings(tmp_path: Path) -> None:
    """Settings left unset are generate()'s defaults (search/settings.py): top-k 50 when sampling."""
    plan = bench_ct2.plan_for(_plan_gen(do_sample=True), tmp_path, vocab=["t2"])
    assert plan.options["sampling_topk"] == 50
    assert plan.options["sampling_topp"] == 1.0
    assert plan.options["sampling_temperature"] == 1.0
    beam = bench_ct2.plan_for(_plan_gen(num_beams=3), tmp_path, vocab=["t2"]).options
    assert (beam["beam_size"], beam["length_penalty"], beam["repetition_penalty"]) == (3, 1.0, 1.0)
    given = bench_ct2.plan_for(_plan_gen(do_sample=True, top_k=0, top_p=0.9), tmp_path, vocab=["t2"])
    assert (given.options["sampling_topk"], given.options["sampling_topp"]) == (0, 0.9)


def test_cli_bench_target_lang_backend_and_sampling(no_ct2, tiny_models, input_file: Path, tmp_path: Path) -> None:
    """--target-lang reaches every system (generate(): forced_bos_token_id), --backend seqgen's; sampled cells
    are not compared with generate()'s draws."""
    mbart = tiny_models("mbart")
    common = ["bench", "-m", str(mbart), str(input_file), "--n", "2", "--batch-sizes", "2", "--num-beams", "1",
              "--repeats", "1", "--no-warmup", "--fixed-new-tokens", "3"]  # fmt: skip
    out = tmp_path / "lang"
    result = seqgen(*common, "--target-lang", "fr_XX", "--backend", "hf", "--out", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    fr = AutoTokenizer.from_pretrained(mbart).convert_tokens_to_ids("fr_XX")
    assert data["generation_config"]["1"]["forced_bos_token_id"] == fr and data["seqgen_backend"] == "hf"
    runs = {r["system"]: r for r in data["runs"]}
    assert runs["seqgen"]["agreement_vs_hf"] == 100.0 and runs["seqgen"]["beyond_ties"] == 0
    assert runs["hf"]["beyond_ties"] is None, "hf is the reference"
    out = tmp_path / "sampled"
    result = seqgen(*common, "--do-sample", "--top-k", "5", "--seed", "3", "--out", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    assert data["generation_config"]["1"]["do_sample"] is True and data["settings"]["seed"] == 3
    assert all(r["agreement_vs_hf"] is None and r["sampled"] for r in data["runs"])
    assert "outputs are not compared" in (out / "bench.md").read_text()


def test_outputs_that_differ_beyond_ties_are_counted_and_flagged(tiny_models) -> None:
    from seqgen_cli.bench.report import markdown_table
    from seqgen_cli.generator import Generator
    from seqgen_cli.verify import beyond_ties

    gen = Generator(str(tiny_models("bart")), backend="hf", max_new_tokens=5)
    ids = [e.ids for e in gen.encode(sample_texts(3, seed=1))]
    theirs = [seqs[0] for seqs in gen.generate_ids(ids)]
    worst = [[*h[:2], int(gen.model(  # the least likely third token: far from a tie
        input_ids=torch.tensor([x]), decoder_input_ids=torch.tensor([[gen.config.decoder_start_token_id, *h[:2]]])
    ).logits[0, -1].argmin()), *h[3:]] for x, h in zip(ids, theirs, strict=True)]  # fmt: skip
    ours = [theirs[0], worst[1], [*theirs[2][:-1], -1]]
    assert beyond_ties(gen, ids, ours, theirs) == [1, 2]
    row = RunResult("decode", "ct2", "ctranslate2", 8, 1, 3, [1.0], 1.0, 3.0, None, None, None, "rss", beyond_ties=2)
    assert "2 of 3 outputs differ from generate()'s beyond near-ties" in markdown_table([row])
