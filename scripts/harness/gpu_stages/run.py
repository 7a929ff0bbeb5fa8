"""The ``run`` stage: whole ``seqgen generate`` processes over a CNN/DM-like stream: ``--no-capture``, the default
(a shape compiled once its eager steps pay for it), and ``--capture`` (every shape compiled at once) on empty
inductor caches and again on warm ones.

What a user on a GPU pays and gets: every batch shape and span bucket a run meets is compiled once (about 14 s a
graph for bart-large-cnn on the H200 of docs/BENCHMARKS.md, "GPU"), so on a short or varied stream compiling can
cost more than the captured steps save. The stream: the FastSeq sources recycled to ``inputs`` lines, in file
order (the CLI sorts them by length into mixed-width batches), the ``cnndm-bart`` preset, batch 32, the device's
default dtype. Per arm: wall seconds of the process, ``generate_seconds``, and from ``--stats`` the shapes compiled,
compile seconds, steps captured, batches run on the plain backend (not paid yet) and CUDA graphs recorded; lines
identical to the ``--no-capture`` run's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import REPO

from gpu_stages.base import Budget

RUN_STATS = (  # the --stats device keys each arm reports
    "dtype", "step_path", "shapes_compiled", "compile_seconds", "captured_steps", "eager_steps",
    "search_compile_seconds", "plain_batches", "cuda_graphs_recorded",
)  # fmt: skip
ARMS = {  # name: (extra flags, inductor's caches emptied first)
    "--no-capture": (["--no-capture"], True),
    "default (a shape compiled once it pays)": ([], True),
    "--capture, cold caches": (["--capture"], True),
    "--capture, warm caches": (["--capture"], False),
}


def section_run(
    device: torch.device, path: Path, texts: list[str], out: Path, inputs: int, budget: Budget, quick: bool
) -> tuple[dict, list[str]]:
    """The four arms in turn (each skipped when ``budget`` has run out): see the module docstring. ``quick``:
    4-8 new tokens instead of the preset's 56-142."""
    src = out / "run_input.txt"
    lines = [texts[i % len(texts)].replace("\n", " ") for i in range(inputs)]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cache = out / "run-inductor-cache"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    rows: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[str]] = {}
    for name, (flags, cold) in ARMS.items():
        left = budget.left()
        if left <= 0:
            rows[name] = {"skipped": "budget"}
            continue
        if cold:
            shutil.rmtree(cache, ignore_errors=True)
        dst, stats_file = out / "run_output.txt", out / "run_stats.json"
        dst.unlink(missing_ok=True)
        stats_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", str(path), "--preset", "cnndm-bart"]
        cmd += ["--device", str(device), "--batch-size", "32", "-q", "--stats", str(stats_file), *flags]
        cmd += ["--min-new-tokens", "4", "--max-new-tokens", "8"] if quick else []
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [*cmd, str(src), "-o", str(dst)], capture_output=True, text=True, cwd=REPO, env=env,
                timeout=None if left == float("inf") else left,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            rows[name] = {"skipped": f"timed out after {left:.0f} s"}
            continue
        row: dict[str, Any] = {"wall_s": round(time.perf_counter() - t0, 2), "rc": proc.returncode}
        if proc.returncode != 0:
            row["stderr"] = proc.stderr[-1000:]
        if stats_file.exists():
            stats = json.loads(stats_file.read_text())
            dev = stats.get("device") or {}
            row["generate_s"] = stats.get("generate_seconds")
            row |= {k: dev.get(k) for k in RUN_STATS}
        if dst.exists():
            outputs[name] = dst.read_text(encoding="utf-8").splitlines()
        rows[name] = row
    base = outputs.get("--no-capture")
    for name, got in outputs.items():
        if base is not None and len(got) == len(base):
            rows[name]["same_as_no_capture"] = sum(a == b for a, b in zip(got, base, strict=True)) / len(base)
    data = {"inputs": inputs, "batch_size": 32, "preset": "cnndm-bart", "rows": rows}
    return data, run_md(data)


def run_md(data: dict[str, Any]) -> list[str]:
    md = [
        f"## Whole `seqgen generate` runs: {data['inputs']} CNN/DM inputs, batch 32, `--preset cnndm-bart`",
        "",
        "| arm | wall s | generate s | shapes compiled | compile s (model / search) | steps captured | "
        "batches plain | graphs recorded | same as --no-capture |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in data["rows"].items():
        if "skipped" in r:
            md.append(f"| {name} | skipped: {r['skipped']} | | | | | | | |")
            continue
        steps = (r.get("captured_steps") or 0) + (r.get("eager_steps") or 0)
        captured = f"{r['captured_steps'] / steps:.0%}" if steps else "-"
        compile_s = "-" if r.get("compile_seconds") is None else (
            f"{r['compile_seconds']} / {r.get('search_compile_seconds', '-')}"
        )  # fmt: skip
        same, gen_s, shapes = r.get("same_as_no_capture"), r.get("generate_s"), r.get("shapes_compiled")
        plain, graphs = (r.get(k) for k in ("plain_batches", "cuda_graphs_recorded"))
        md.append(
            f"| {name} | {r['wall_s']} | {'-' if gen_s is None else f'{gen_s:.2f}'} | "
            f"{'-' if shapes is None else shapes} | {compile_s} | {captured} | {'-' if plain is None else plain} | "
            f"{'-' if graphs is None else graphs} | {'-' if same is None else f'{same:.0%}'} |"
        )
        if r.get("rc"):
            md.append(f"|  | exit {r['rc']}: {r.get('stderr', '')[-200:]!r} | | | | | | | |")
    return md
