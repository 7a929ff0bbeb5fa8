"""The ``profile`` stage: where the eager step's time goes per dtype, and where a short whole process's goes.

* Eager step: the ``bart`` stage's cell (bart-large-cnn shape, batch 32, beam 4, no-repeat 3, 1024-token
  sources, exactly 142 new tokens; ``--quick``: the tiny shapes) generated once as warm-up, then once under
  ``torch.profiler`` per dtype: wall seconds, device seconds summed over kernels, and the operators that took most
  device time and most host time. float16 and bfloat16 run the same code: a gap between them is in a kernel.
* Whole process: ``seqgen generate`` on 32 CNN/DM lines, ``--no-capture`` with ``--verify 0`` and with the
  device's default ``--verify``, against a process that only imports torch and initialises the device: wall
  seconds, the run's own seconds (``--stats``), and what is left (interpreter, imports, model load, verify).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import REPO

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import get_backend
from seqgen_cli.search import generate

from .base import encode, load_model, recycled, sync

TOP = 12  # operators listed per dtype


def _top(events: Any, key: str) -> list[dict[str, Any]]:
    """The ``TOP`` operators by ``key`` (``device_time_total`` or ``self_cpu_time_total``), in milliseconds."""
    rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:TOP]
    return [{"op": e.key[:70], "calls": e.count, "ms": round(getattr(e, key, 0) / 1e3, 2)} for e in rows]


def profile_eager(
    path: Path,
    texts: list[str],
    device: torch.device,
    dtypes: list[str],
    shape: tuple[int, int],
    kwargs: dict,
) -> dict[str, Any]:
    src_len, new = shape
    fixed = dict(kwargs, min_new_tokens=new, max_new_tokens=new)
    out: dict[str, Any] = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for name in dtypes:
        model = load_model(path, getattr(torch, name), device)
        config = resolve_generation_config(model.generation_config, None, fixed)
        batch = encode(path, recycled(texts, 32 if device.type == "cuda" else 2), src_len, device, True)
        backend = get_backend(model)
        generate(backend, batch, config)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        generate(backend, batch, config)
        sync(device)
        wall = time.perf_counter() - t0
        with torch.profiler.profile(activities=activities) as prof:
            generate(backend, batch, config)
            sync(device)
        events = prof.key_averages()
        device_total = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
        out[name] = {
            "wall_s": round(wall, 3),
            "device_s": round(device_total, 3),
            "top_device": _top(events, "self_device_time_total"),
            "top_host": _top(events, "self_cpu_time_total"),
        }
        del model, backend
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return out


def startup(device: torch.device, path: Path, texts: list[str], out: Path, quick: bool) -> dict[str, Any]:
    src = out / "profile_input.txt"
    src.write_text("\n".join(t.replace("\n", " ") for t in recycled(texts, 32)) + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    init = "import torch; torch.zeros(1, device=%r); torch.cuda.synchronize() if torch.cuda.is_available() else 0"
    subprocess.run([sys.executable, "-c", init % str(device)], check=True, cwd=REPO)
    rows: dict[str, Any] = {"import torch + device init": {"wall_s": round(time.perf_counter() - t0, 2)}}
    for arm, flags in {"--verify 0": ["--verify", "0"], "default --verify": []}.items():
        dst, stats_file = out / "profile_output.txt", out / "profile_stats.json"
        cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", str(path), "--preset", "cnndm-bart"]
        cmd += [
            "--device",
            str(device),
            "--batch-size",
            "32",
            "--no-capture",
            "-q",
            "--stats",
            str(stats_file),
        ]
        cmd += ["--max-new-tokens", "8"] if quick else []
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*cmd, *flags, str(src), "-o", str(dst)], capture_output=True, text=True, cwd=REPO
        )
        row: dict[str, Any] = {"wall_s": round(time.perf_counter() - t0, 2), "rc": proc.returncode}
        if stats_file.exists():
            stats = json.loads(stats_file.read_text())
            row["run_s"] = round(stats["seconds"], 2)
            row["generate_s"] = round(stats["generate_seconds"], 2)
            row["dtype"] = (stats.get("device") or {}).get("dtype")
        if proc.returncode:
            row["stderr"] = proc.stderr[-500:]
        rows[arm] = row
    return rows


def section_profile(
    device: torch.device, path: Path, texts: list[str], out: Path, dtypes: list[str], shape: tuple[int, int],
    kwargs: dict, quick: bool,
) -> tuple[dict, list[str]]:  # fmt: skip
    data = {"eager": profile_eager(path, texts, device, dtypes, shape, kwargs)}
    data["startup"] = startup(device, path, texts, out, quick)
    md = [f"## Profile: eager step, {shape[0]}-token sources, {shape[1]} new tokens, on {device}", ""]
    for name, r in data["eager"].items():
        md.append(f"### {name}: wall {r['wall_s']} s, kernels {r['device_s']} s")
        md += ["", "| op (device) | calls | ms | op (host) | calls | ms |", "|---|---:|---:|---|---:|---:|"]
        for d, h in zip(r["top_device"], r["top_host"], strict=True):
            md.append(f"| {d['op']} | {d['calls']} | {d['ms']} | {h['op']} | {h['calls']} | {h['ms']} |")
        md.append("")
    md += ["### Whole process, 32 lines, `--no-capture`", "", "| arm | wall s | run s | generate s | dtype |"]
    md.append("|---|---:|---:|---:|---|")
    for arm, r in data["startup"].items():
        md.append(
            f"| {arm} | {r['wall_s']} | {r.get('run_s', '-')} | {r.get('generate_s', '-')} | {r.get('dtype', '-')} |"
        )
    return data, md
