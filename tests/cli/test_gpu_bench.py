"""``scripts/harness/gpu_bench.sh``, the one command for a GPU machine, run on the CPU with tiny shapes; what it relies
on there (``seqgen generate`` without rouge-score, sacrebleu or ctranslate2 installed); and its table logic
in-process, with out-of-memory errors and the capture path faked: ``--batches max``, inputs recycled to fill
a batch, an OOM in one system keeping the others' cells, the captured arm's first run timed, ``--budget`` and
calls adding up in one ``--out``; the refill stage's step counts."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _shared() -> Path | None:
    env = os.environ.get("SEQGEN_SHARED")
    path = Path(env) if env else REPO.parent / "shared"
    needed = ("tokenizers/bart-large-cnn", "tokenizers/gpt2", "data/cnndm/fastseq128/cnndm_128.txt")
    return path if all((path / rel).exists() for rel in needed) else None


@pytest.mark.slow
def test_generate_needs_no_metrics_or_ct2_packages(tiny_models, tmp_path: Path) -> None:
    """The GPU machine has no rouge-score or ctranslate2: `seqgen generate` must not import them (nor sacrebleu)."""
    model = tiny_models("bart")
    src = tmp_path / "in.txt"
    src.write_text("first line\nsecond line\n")
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        BLOCKED = ("rouge_score", "sacrebleu", "ctranslate2", "nltk")
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError("not installed here: " + name)
        sys.meta_path.insert(0, Block())
        from seqgen_cli.cli import main
        sys.argv = ["seqgen", "generate", "-m", {str(model)!r}, "--max-new-tokens", "4", "-q", {str(src)!r}]
        try:
            main()
        finally:
            assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.splitlines()) == 2


def test_stage_shared_copies_what_the_bench_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = _shared()
    if shared is None:
        pytest.skip("the shared folder (../shared or $SEQGEN_SHARED) is absent")
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "harness"))
    bench = importlib.import_module("gpu_bench")
    common = importlib.import_module("_common")
    monkeypatch.setattr(bench, "STAGED", tmp_path / ".gpu-shared")
    staged = bench.stage_shared(shared)
    for rel in bench.STAGE_FILES:
        assert (staged / rel).exists(), rel
    assert (staged / "tokenizers/bart-large-cnn/tokenizer.json").is_file()
    assert common.find_shared(staged) == staged
    assert ".gpu-shared/" in (REPO / ".gitignore").read_text().splitlines()


@pytest.mark.slow  # a whole gpu_bench run (about 50 s)
def test_gpu_bench_quick_on_cpu(tmp_path: Path) -> None:
    shared = _shared()
    if shared is None:
        pytest.skip("the shared folder (../shared or $SEQGEN_SHARED) is absent")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, SEQGEN_SHARED=str(shared))
    cmd = [str(REPO / "scripts/harness/gpu_bench.sh"), "--device", "cpu", "--quick", "--out", str(out)]
    cmd += ["--models", str(tmp_path / "models")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["env"]["device"] == "cpu"
    assert results["equiv"]["ok"], results["equiv"]["notes"]
    assert {"bart-large-cnn shape", "gpt2 shape", "bart"} <= set(results["equiv"]["rows"])
    assert results["sync"] == {"skipped": "needs CUDA", "seconds": results["sync"]["seconds"]}
    for section in ("bart", "gpt2"):
        rows = results[section]["rows"]
        assert {(r["dtype"], r["batch"]) for r in rows} == {
            (d, b) for d in ("float16", "bfloat16") for b in (2, 4)
        }
        for r in rows:
            assert not [k for k in r if k.endswith("_error")], r
            assert r["seqgen_samples_per_s"] > 0 and r["generate_tokens_per_s"] > 0
            assert 0 <= r["same_as_float32"] <= 1 and 0 <= r["same_as_generate"] <= 1
            assert r["step_path"] == "eager (cpu: no CUDA graphs)" and "captured_first_s" not in r
    long = results["long"]  # 6 batches of 2 through one backend: every batch timed, no recordings on the CPU
    assert long["batches"] == len(long["batch_seconds"]) == 6 and long["recordings_at_end"] is None
    assert long["step_path"] == "eager (cpu: no CUDA graphs)" and "sync" not in long
    refill = results["refill"]
    assert {(r["dtype"], r["batch"]) for r in refill["rows"]} == {
        (d, b) for d in ("float16", "bfloat16") for b in (2, 4)
    }
    assert refill["settings"]["preset"] == "cnndm-bart" and float(refill["settings"]["eos_bias"]) != 0
    for r in refill["rows"]:
        assert "error" not in r and r["inputs"] == 4 * r["batch"] and r["refill_engine"], r
        assert r["same_as_no_refill"] == 1 and r["repeats_same"], r
        for system in ("refill", "no_refill"):
            assert len(r[f"{system}_s"]) == 2 and r[f"{system}_s_min"] <= r[f"{system}_s_median"]
            assert (
                r[f"{system}_steps"] > 0 and 0 < r[f"{system}_occupancy"] <= 1 and r[f"{system}_first_s"] > 0
            )
            assert r[f"{system}_step_path"] == "eager (cpu: no CUDA graphs)"
        assert r["refill_live_row_steps"] == r["no_refill_live_row_steps"], "the same live rows either way"
        assert r["refill_joins"] >= 1 and r["speedup"] > 0 and r["steps_ratio"] > 0
        lengths = r["output_tokens"]
        assert 4 <= lengths["min"] <= lengths["median"] <= lengths["max"] <= 24
        assert r["generated_tokens"] >= lengths["max"]
    assert results["cli"]["api_ok"] and results["cli"]["cli_ok"], results["cli"]
    step = "eager (cpu: no CUDA graphs)"
    stats = {"device": "cpu", "dtype": "float32", "loader": "seqgen", "engine": "bart decoder", "step_path": step}
    got = results["cli"]["device_stats"]
    assert {k: got[k] for k in stats} == stats and got["linear_maps"] == "float32 oneDNN (weights packed once)"
    run = results["run"]  # whole processes over 12 lines: on the CPU every arm runs the eager step
    assert run["inputs"] == 12 and len(run["rows"]) == 4 and "--capture, warm caches" in run["rows"]
    for r in run["rows"].values():
        assert r["rc"] == 0 and r["wall_s"] > 0 and r["generate_s"] > 0 and r["same_as_no_capture"] == 1, r
        assert r["step_path"].startswith("eager (") and r["shapes_compiled"] is None, r
    profile = results["profile"]  # the eager step profiled per dtype; whole processes with and without --verify
    assert set(profile["eager"]) == {"float16", "bfloat16"}
    for r in profile["eager"].values():
        assert r["wall_s"] > 0 and len(r["top_host"]) == len(r["top_device"]) == 12, r
        assert r["top_host"][0]["ms"] >= r["top_host"][-1]["ms"] > 0, r["top_host"]
    for arm in ("--verify 0", "default --verify"):
        r = profile["startup"][arm]
        assert r["rc"] == 0 and r["wall_s"] > r["run_s"] >= r["generate_s"] > 0 and r["dtype"] == "float32", r
    md = (out / "results.md").read_text()
    assert "## Profile: eager step, 64-token sources, 8 new tokens, on cpu" in md
    assert "## Whole `seqgen generate` runs: 12 CNN/DM inputs" in md
    assert "## bart-large-cnn shape" in md and "## GPT-2 shape" in md and "float32 equivalence" in md
    assert "## Refill vs --no-refill" in md and "| float16 | 2 | 8 |" in md


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``scripts/harness/`` on the import path, as gpu_bench.py puts it: import a module of it by name."""
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "harness"))
    return importlib.import_module


@pytest.fixture
def bench(scripts: Any) -> Any:
    return scripts("gpu_bench")


@pytest.fixture
def base(scripts: Any) -> Any:
    return scripts("gpu_stages.base")


@pytest.fixture
def tables(scripts: Any) -> Any:
    return scripts("gpu_stages.tables")


@pytest.fixture
def refill(scripts: Any) -> Any:
    return scripts("gpu_stages.refill")


TEXTS = ["The first article is short.", "A second one, a little longer than the first.", "Third."]


def test_batch_plan(base: Any) -> None:
    assert base.batch_plan("32,64,128", False) == ([32, 64, 128], False)
    assert base.batch_plan("max", False) == ([32], True)
    assert base.batch_plan("max", True) == ([2], True)
    assert base.batch_plan("256,max", False) == ([256], True)
    assert list(base.table_sizes([2], True, 16)) == [2, 4, 8, 16]
    assert list(base.table_sizes([2, 3], False, 16)) == [2, 3]
    with pytest.raises(ValueError):
        base.batch_plan("0,4", False)
    assert base.recycled(TEXTS, 7) == TEXTS * 2 + TEXTS[:1]


def _table(tables: Any, model: Path, plan: tuple, budget: Any = None, dtypes: tuple = ("float32",)) -> dict:
    return tables.section_table(
        "bart", model, TEXTS, torch.device("cpu"), list(dtypes), plan, 64, 32, 4,
        dict(num_beams=2), 1, False, budget or tables.Budget(None),
    )  # fmt: skip


def test_max_doubles_until_seqgen_runs_out_and_an_oom_keeps_the_other_cells(
    tables: Any, base: Any, tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max``: 2, 4, 8, ... until seqgen's eager step runs out of memory (here at 8 inputs); generate() running
    out at 4 leaves seqgen's figures of that cell; every batch has as many inputs as its size."""
    sizes: list[int] = []
    real_generate, real_load = tables.generate, tables.load_model

    def generate(backend: Any, batch: Any, config: Any) -> Any:
        sizes.append(batch.input_ids.shape[0])
        if batch.input_ids.shape[0] >= 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real_generate(backend, batch, config)

    def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
        model = real_load(path, dtype, device)
        hf = model.generate

        def hf_generate(**kwargs: Any) -> Any:
            if kwargs["input_ids"].shape[0] >= 4:
                raise RuntimeError("CUDA error: out of memory")
            return hf(**kwargs)

        model.generate = hf_generate
        return model

    monkeypatch.setattr(tables, "generate", generate)
    monkeypatch.setattr(tables, "load_model", load_model)
    data = _table(tables, tiny_models("bart"), base.batch_plan("max", True))
    rows = {r["batch"]: r for r in data["rows"]}
    assert sorted(rows) == [2, 4, 8], "doubling stops at seqgen's first out-of-memory"
    assert 8 in sizes and 4 in sizes, "inputs recycled to fill each batch"
    assert rows[2]["speedup"] > 0 and "generate_error" not in rows[2]
    assert rows[4]["generate_error"] == "out of memory" and rows[4]["seqgen_samples_per_s"] > 0
    assert rows[4]["same_as_float32"] == 1 and "speedup" not in rows[4]
    assert rows[8]["seqgen_error"] == "out of memory" and "seqgen_s" not in rows[8]
    md = "\n".join(tables.table_md("bart-large-cnn shape", data))
    assert "| float32 | 4 |" in md and "| OOM |" in md


def test_the_captured_arm_times_its_first_run(
    tables: Any, tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the step is captured (CUDA; here an uncompiled stand-in), its first run (compile and recording) is
    timed apart from the timed runs, with the capture path's counts."""
    from seqgen_cli.models.capture import CapturedBackend

    search_compilers: list = []

    def stand_in(backend: Any, device: Any, on: bool, search_compiler: Any = "default") -> tuple:
        search_compilers.append(search_compiler)
        return CapturedBackend(backend, lambda d: d), "x"

    monkeypatch.setattr(tables, "capture", stand_in)
    data = _table(tables, tiny_models("bart"), ([2], False))
    (row,) = data["rows"]
    assert row["step_path"] == "captured" and row["captured_first_s"] > 0
    assert row["shapes_compiled"] >= 1 and row["compile_seconds"] >= 0 and row["eager_steps"] == 0
    assert row["captured_steps"] > 0 and row["captured_same_as_eager"] == 1 and row["captured_speedup"] > 0
    # the second captured arm: the model's step alone (no search compiler), timed against the first
    assert search_compilers == ["default", None] and row["model_only_s_median"] > 0
    assert row["search_graph_speedup"] > 0 and "| " in tables.table_row(row)


def test_budget_skips_cells_and_names_their_command(tables: Any, tiny_models) -> None:
    class OneCell(tables.Budget):  # time for a first cell (estimate 0), not for a second
        def left(self) -> float:
            return 1e-6

    data = _table(tables, tiny_models("bart"), ([2, 4], False), OneCell(None))
    assert [r["batch"] for r in data["rows"]] == [2]
    assert data["skipped"] == ["--stages bart --dtypes float32 --batches 4"]
    assert "--batches 4" in "\n".join(tables.table_md("t", data))


def test_calls_into_one_out_add_up(bench: Any, tmp_path: Path) -> None:
    """One call per stage (10-minute calls): a table keeps the cells of earlier calls unless re-run."""
    args = argparse.Namespace(out=tmp_path)

    def table(*cells: tuple[str, int, float]) -> dict:
        rows = [{"dtype": d, "batch": b, "seqgen_s_median": s, "step_path": "eager"} for d, b, s in cells]
        return {
            "title": "t",
            "settings": {"num_beams": "4"},
            "reference_inputs": 2,
            "rows": rows,
            "skipped": [],
        }

    bench.Report(tmp_path, args).add_table("bart", table(("float16", 32, 1.0), ("float16", 64, 2.0)))
    second = bench.Report(tmp_path, args)
    second.add_table("bart", table(("bfloat16", 32, 3.0), ("float16", 64, 2.5)))
    second.not_run("--stages gpt2")
    results = json.loads((tmp_path / "results.json").read_text())
    cells = {(r["dtype"], r["batch"]): r["seqgen_s_median"] for r in results["bart"]["rows"]}
    assert cells == {("float16", 32): 1.0, ("float16", 64): 2.5, ("bfloat16", 32): 3.0}
    assert len(results["commands"]) == 2 and results["not_run"] == ["--stages gpt2"]
    md = (tmp_path / "results.md").read_text()
    assert (
        md.index("| float16 | 64 |") < md.index("| bfloat16 | 32 |")
        and "`scripts/harness/gpu_bench.sh --stages gpt2`" in md
    )


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_counted_steps_are_one_per_new_token(
    family: str, tiny_models, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """One input, exactly 5 new tokens, beam 2: 5 decode steps of 2 live rows, with and without refill (an
    encoder-decoder's ``start`` runs the encoder only: not a step; a decoder-only one's prefill is the first)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "harness"))
    common = importlib.import_module("_common")
    from seqgen_cli.generator import Generator

    settings = dict(num_beams=2, min_new_tokens=5, max_new_tokens=5)
    for refill in (False, True) if family == "bart" else (False,):
        gen = Generator(str(tiny_models(family)), device="cpu", refill=refill, lanes=1, **settings)
        assert gen.refill == refill
        with common.counted_steps(gen, 1) as counts:
            (seqs,) = common.generate_ids(gen, ["The first article is short."], 1)
        assert len(seqs) == 1 and len(seqs[0]) == 5
        assert (counts["steps"], counts["live_row_steps"], counts["occupancy"]) == (5, 10, 1.0), (
            refill,
            counts,
        )
        assert gen.model_backend().step.__self__ is gen.model_backend(), "the engine's own step again"


@pytest.fixture
def one_thread() -> Any:
    """One torch thread, as gpu_bench.py runs on the CPU (tiny ops on 2 threads of a busy machine crawl)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _refill(refill: Any, model: Path, plan: tuple, budget: Any = None) -> dict:
    return refill.section_refill(
        model, TEXTS, torch.device("cpu"), ["float32"], plan, 64, True, 1, budget or refill.Budget(None)
    )


def test_refill_stage_stops_at_oom_and_skips_what_the_budget_cannot_fit(
    refill: Any, tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """An out-of-memory cell is marked and ends its dtype's sizes; a cell beyond ``--budget`` is listed with
    its command. The EOS-biased checkpoint is built next to the base one (here a copy)."""
    import shutil

    base = tmp_path / "bart"
    shutil.copytree(tiny_models("bart"), base)
    real = refill.generate_ids

    def generate_ids(gen: Any, texts: list[str], batch: int) -> Any:
        if batch >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(gen, texts, batch)

    monkeypatch.setattr(refill, "generate_ids", generate_ids)
    data = _refill(refill, base, ([2, 4, 8], False))
    assert [(r["batch"], "error" in r) for r in data["rows"]] == [(2, False), (4, True)]
    assert data["rows"][0]["same_as_no_refill"] == 1 and data["rows"][1]["error"] == "out of memory"
    assert (tmp_path / "bart-eos12" / "config.json").is_file()
    assert "| float32 | 4 | 16 | OOM |" in "\n".join(refill.refill_md("t", data))

    class OneCell(refill.Budget):  # time for a first cell (estimate 0), not for a second
        def left(self) -> float:
            return 1e-6

    data = _refill(refill, base, ([2, 4], False), OneCell(None))
    assert [r["batch"] for r in data["rows"]] == [2]
    assert data["skipped"] == ["--stages refill --dtypes float32 --batches 4"]


def test_refill_cell_through_the_capture_path(
    refill: Any, tiny_models, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """On CUDA both systems' steps run captured (here an uncompiled stand-in): the cell records the capture
    counts, and the steps it counts (first run) are the steps the capture path ran (first run + timed run)."""
    from seqgen_cli.models import capture

    def captured(backend: Any, device: Any, on: bool) -> tuple[Any, str]:
        return capture.CapturedBackend(backend, lambda decode: decode), "captured"

    monkeypatch.setattr(capture, "capture", captured)
    settings = dict(num_beams=2, min_new_tokens=2, max_new_tokens=6)
    row = refill.refill_cell(tiny_models("bart"), TEXTS * 3, torch.device("cpu"), "float32", 2, settings, 1)
    assert row["refill_engine"] and row["same_as_no_refill"] == 1 and row["repeats_same"]
    for system in refill.REFILL_SYSTEMS:
        assert row[f"{system}_step_path"] == "captured" and row[f"{system}_shapes_compiled"] >= 1, row
        assert row[f"{system}_eager_steps"] == 0 and row[f"{system}_compile_seconds"] >= 0
        assert row[f"{system}_captured_steps"] == 2 * row[f"{system}_steps"], (system, row)
