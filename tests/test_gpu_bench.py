"""``scripts/gpu_bench.sh``, the one command for a GPU machine, run on the CPU with tiny shapes; and what it
relies on there: ``seqgen generate`` without rouge-score, sacrebleu or ctranslate2 installed."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _shared() -> Path | None:
    env = os.environ.get("SEQGEN_SHARED")
    path = Path(env) if env else REPO.parent / "shared"
    needed = ("tokenizers/bart-large-cnn", "tokenizers/gpt2", "data/cnndm/fastseq128/cnndm_128.txt")
    return path if all((path / rel).exists() for rel in needed) else None


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
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    bench = importlib.import_module("gpu_bench")
    common = importlib.import_module("_common")
    monkeypatch.setattr(bench, "STAGED", tmp_path / ".gpu-shared")
    staged = bench.stage_shared(shared)
    for rel in bench.STAGE_FILES:
        assert (staged / rel).exists(), rel
    assert (staged / "tokenizers/bart-large-cnn/tokenizer.json").is_file()
    assert common.find_shared(staged) == staged
    assert ".gpu-shared/" in (REPO / ".gitignore").read_text().splitlines()


def test_gpu_bench_quick_on_cpu(tmp_path: Path) -> None:
    shared = _shared()
    if shared is None:
        pytest.skip("the shared folder (../shared or $SEQGEN_SHARED) is absent")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, SEQGEN_SHARED=str(shared))
    cmd = [str(REPO / "scripts/gpu_bench.sh"), "--device", "cpu", "--quick", "--out", str(out)]
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
            assert "error" not in r, r
            assert r["seqgen_samples_per_s"] > 0 and r["generate_tokens_per_s"] > 0
            assert 0 <= r["same_as_float32"] <= 1 and 0 <= r["same_as_generate"] <= 1
    assert results["cli"]["api_ok"] and results["cli"]["cli_ok"], results["cli"]
    step = "eager (cpu: no CUDA graphs)"
    assert results["cli"]["device_stats"] == {"device": "cpu", "dtype": "float32", "step_path": step}
    md = (out / "results.md").read_text()
    assert "## bart-large-cnn shape" in md and "## GPT-2 shape" in md and "float32 equivalence" in md
