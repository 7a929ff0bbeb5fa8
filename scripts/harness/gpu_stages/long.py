"""The ``long`` stage: one captured backend over many batches of one shape, as a long CNN/DM run goes. Each
batch's seconds and the CUDA graphs recorded so far: kept state buffers (one set per shape) should hold both
the step time and the recordings flat, where buffers allocated per batch re-record every batch. Then one more
batch under CUDA's sync debug mode: the synchronising calls of the captured path."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import get_backend
from seqgen_cli.models.capture import CapturedBackend, capture
from seqgen_cli.search import generate

from .base import Budget, encode, load_model, recycled, sync, sync_sites

SETTINGS = dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, early_stopping=True)
EDGE = 10  # batches compared at each end of the run


def section_long(
    path: Path, texts: list[str], device: torch.device, quick: bool, budget: Budget
) -> tuple[dict[str, Any], list[str]]:
    """``batches`` batches of ``size`` inputs (the sources in turn) through one captured float16 backend
    (eager on the CPU), beam 4, no-repeat 3, a fixed number of new tokens: seconds per batch, the first
    :data:`EDGE` against the last, CUDA graph recordings after the first batch and at the end."""
    batches, size, src_len, new = (6, 2, 64, 8) if quick else (100, 16, 1024, 48)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = load_model(path, dtype, device)
    fixed = dict(SETTINGS, min_new_tokens=new, max_new_tokens=new)
    config = resolve_generation_config(model.generation_config, None, fixed)
    inputs = [
        encode(path, recycled(texts[(i * size) % len(texts) :] + texts, size), src_len, device, True)
        for i in range(batches)
    ]
    backend, step_path = capture(get_backend(model), device, True)
    seconds: list[float] = []
    recordings: list[int | None] = []
    for batch in inputs:
        if seconds and not budget.allows(2 * seconds[-1]):
            break
        sync(device)
        t0 = time.perf_counter()
        generate(backend, batch, config)
        sync(device)
        seconds.append(time.perf_counter() - t0)
        captured = backend.stats() if isinstance(backend, CapturedBackend) else {}
        recordings.append(captured.get("cuda_graphs_recorded"))
    edge = min(EDGE, len(seconds) // 2) or 1
    first, last = statistics.median(seconds[1 : edge + 1] or seconds), statistics.median(seconds[-edge:])
    data: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."),
        "batches": len(seconds),
        "inputs_per_batch": size,
        "new_tokens": new,
        "src_len": src_len,
        "step_path": backend.path if isinstance(backend, CapturedBackend) else step_path,
        "first_batch_s": seconds[0],
        "first_median_s": first,  # batches 2..EDGE+1 (the first compiles)
        "last_median_s": last,
        "last_over_first": last / first,
        "recordings_after_first": recordings[0],
        "recordings_at_end": recordings[-1],
        "batch_seconds": [round(s, 4) for s in seconds],
    }
    if isinstance(backend, CapturedBackend):
        data["capture"] = backend.stats()
    md = [
        f"## Long run: one backend, {len(seconds)} batches of {size} inputs ({data['dtype']}, beam 4, "
        f"{src_len}-token sources, {new} new tokens, {data['step_path']})",
        "",
        f"- first batch (compiles) {seconds[0]:.2f} s; median of batches 2-{edge + 1} {first:.3f} s, of the last "
        f"{edge} {last:.3f} s (last/first {last / first:.3f})",
        f"- CUDA graphs recorded: {recordings[0]} after the first batch, {recordings[-1]} at the end",
    ]
    per_shape = data.get("capture", {}).get("cuda_graphs_recorded_per_shape", {})
    md += [f"  - {name}: {n}" for name, n in per_shape.items()]
    if device.type == "cuda":
        sites = sync_sites(lambda: generate(backend, inputs[0], config, sync_every=4))
        data["sync"] = {"steps": new, "host_checks": new // 4, "calls": sum(sites.values()), "sites": sites}
        md.append(
            f"- captured path under CUDA sync debug mode, {new} steps, sync_every 4 ({new // 4} checks): "
            f"{sum(sites.values())} synchronising calls"
        )
        md += [f"  - {k}: {v}" for k, v in sorted(sites.items(), key=lambda kv: -kv[1])]
    return data, md
