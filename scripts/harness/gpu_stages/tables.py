"""The ``bart`` and ``gpt2`` stages: seqgen against ``generate()`` per dtype and batch size, each system of a cell
timed on its own (an out-of-memory error marks that system, the others' figures stay), the captured decode step
(CUDA graphs) beside the eager one, agreement with float32."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.errors import is_oom
from seqgen_cli.models import get_backend
from seqgen_cli.models.capture import CapturedBackend, capture
from seqgen_cli.search import Batch, generate

from .base import (
    Budget,
    encode,
    load_model,
    peak_mb,
    recycled,
    reset_peak,
    skipped_md,
    sorted_rows,
    sync,
    table_rows,
    table_sizes,
)

REF_INPUTS = 32  # float32 reference outputs: the first inputs of every batch
SHAPES = {  # stage: (source tokens, new tokens), the same with --quick, the generation settings
    "bart": ((1024, 142), (64, 8), dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, early_stopping=True)),
    "gpt2": ((512, 128), (64, 8), dict(num_beams=4)),
}  # fmt: skip


def timed(
    fn: Callable[[], Any], device: torch.device, reps: int, warmup: bool
) -> tuple[list[float], Any, float | None]:
    """Seconds of ``reps`` runs (after a warm-up run if ``warmup``), the last result and the peak memory (MiB)."""
    if warmup:
        fn()
    times, result = [], None
    reset_peak(device)
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, result, peak_mb(device)


def run_system(
    name: str,
    fn: Callable[[], Any],
    device: torch.device,
    reps: int,
    warmup: bool,
    size: int,
    new_tokens: int,
) -> tuple[dict[str, Any], Any]:
    """One system's timings in a cell (``<name>_s``, ``_s_median``, ``_samples_per_s``, ``_tokens_per_s``,
    ``_peak_mb``) and its last result; out of memory: ``<name>_error`` (the other systems' cells stay)."""
    try:
        times, result, peak = timed(fn, device, reps, warmup)
    except Exception as err:  # noqa: BLE001 - out of memory only
        if not is_oom(err):
            raise
        del err
        reset_peak(device)
        return {f"{name}_error": "out of memory"}, None
    median = statistics.median(times)
    return {
        f"{name}_s": times,
        f"{name}_s_median": median,
        f"{name}_samples_per_s": size / median,
        f"{name}_tokens_per_s": size * new_tokens / median,
        f"{name}_peak_mb": peak,
    }, result


def first_run(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """The captured arm's first run (compiles and records its shapes), timed on its own: ``captured_first_s``;
    an OOM there: ``captured_error``."""
    try:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
    except Exception as err:  # noqa: BLE001 - out of memory only
        if not is_oom(err):
            raise
        del err
        reset_peak(device)
        return {"captured_error": "out of memory (first run)"}
    return {"captured_first_s": time.perf_counter() - t0}


def measure_cell(
    model: torch.nn.Module,
    batch: Batch,
    config: Any,
    device: torch.device,
    reps: int,
    warmup: bool,
    new_tokens: int,
    reference: list,
) -> dict[str, Any]:
    """One table cell: seqgen (eager step, and captured where it can be: its first run, which compiles, timed on
    its own with the capture counts) and ``generate()`` on ``batch``, each timed on its own (an OOM in one
    leaves the others' figures); agreement with the float32 reference on its first inputs."""
    size = batch.input_ids.shape[0]
    row: dict[str, Any] = {}
    backend = get_backend(model)
    ours_row, ours = run_system(
        "seqgen", lambda: generate(backend, batch, config).sequences, device, reps, warmup, size, new_tokens
    )
    row |= ours_row
    captured, row["step_path"] = capture(get_backend(model), device, True)
    if isinstance(captured, CapturedBackend):
        row |= first_run(lambda: generate(captured, batch, config).sequences, device)
        cap_row, cap = run_system(
            "captured",
            lambda: generate(captured, batch, config).sequences,
            device,
            reps,
            False,
            size,
            new_tokens,
        )
        row |= cap_row | captured.stats()
        row["step_path"] = captured.path
        if cap is not None and ours is not None:
            row["captured_speedup"] = row["seqgen_s_median"] / row["captured_s_median"]
            row["captured_same_as_eager"] = sum(a == b for a, b in zip(cap, ours, strict=True)) / size
        # the same with only the model's step captured (the search eager): what the search's graph brings
        model_only, _ = capture(get_backend(model), device, True, search_compiler=None)
        only_row, only = run_system(
            "model_only",
            lambda: generate(model_only, batch, config).sequences,
            device, reps, True, size, new_tokens,
        )  # fmt: skip
        row |= only_row
        if cap is not None and only is not None:
            row["search_graph_speedup"] = row["model_only_s_median"] / row["captured_s_median"]
    hf_row, hf = run_system(
        "generate",
        lambda: model.generate(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, generation_config=config
        ),
        device, reps, warmup, size, new_tokens,
    )  # fmt: skip
    row |= hf_row
    if ours is not None:
        n = len(reference)
        row["same_as_float32"] = sum(a == b for a, b in zip(ours[:n], reference, strict=True)) / n
    if ours is not None and hf is not None:
        start = 1 if model.config.is_encoder_decoder else batch.input_ids.shape[1]
        hf_seqs = [[ids[start:].tolist()] for ids in hf]
        ours_first = [[per[0][:new_tokens]] for per in ours]
        row["speedup"] = row["generate_s_median"] / row["seqgen_s_median"]
        row["same_as_generate"] = sum(a == b for a, b in zip(ours_first, hf_seqs, strict=True)) / size
    return row


def section_table(
    stage: str,
    path: Path,
    texts: list[str],
    device: torch.device,
    dtypes: list[str],
    plan: tuple[list[int], bool],
    max_batch: int,
    src_len: int,
    new_tokens: int,
    kwargs: dict,
    reps: int,
    warmup: bool,
    budget: Budget,
) -> dict[str, Any]:
    """seqgen vs generate() per dtype and batch size (inputs recycled to fill any size); agreement of each
    dtype with seqgen in float32 on the first inputs. With ``max`` the sizes double until seqgen's eager step
    runs out of memory (or reaches ``max_batch``); cells that would overrun the budget are skipped, listed
    with the command that runs them."""
    fixed = dict(kwargs, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    ref_model = load_model(path, torch.float32, device)
    encdec = ref_model.config.is_encoder_decoder
    config = resolve_generation_config(ref_model.generation_config, None, fixed)
    ref_inputs = min(plan[0][0], REF_INPUTS)
    ref_batch = encode(path, recycled(texts, ref_inputs), src_len, device, encdec)
    reference = generate(get_backend(ref_model), ref_batch, config).sequences  # float32, the first inputs
    del ref_model
    reset_peak(device)
    rows: list[dict] = []
    skipped: list[str] = []
    for dtype_name in dtypes:
        model = load_model(path, getattr(torch, dtype_name), device)

        def cell(batch_size: int, dtype_name: str = dtype_name, model: Any = model) -> dict:
            batch = encode(path, recycled(texts, batch_size), src_len, device, encdec)
            row = {"dtype": dtype_name, "batch": batch_size}
            return row | measure_cell(model, batch, config, device, reps, warmup, new_tokens, reference)

        command = f"--stages {stage} --dtypes {dtype_name}"
        # a row with seqgen's OOM: seqgen's largest batch is behind, no larger size
        rows += table_rows(
            table_sizes(*plan, max_batch), budget, skipped, command, cell, table_row, "seqgen_error"
        )
        del model
        reset_peak(device)
    return {
        "title": f"beam {config.num_beams}, no-repeat {config.no_repeat_ngram_size or '-'}, {src_len}-token inputs, "
        f"{new_tokens} new tokens, on {device}",
        "settings": {k: str(v) for k, v in fixed.items()},
        "src_len": src_len,
        "reference_inputs": ref_inputs,
        "rows": rows,
        "skipped": skipped,
    }


def _cell(row: dict, key: str, fmt: str, system: str) -> str:
    if f"{system}_error" in row:
        return "OOM"
    return format(row[key], fmt) if row.get(key) is not None else "-"


def table_row(row: dict) -> str:
    cells = [
        row["dtype"],
        str(row["batch"]),
        _cell(row, "seqgen_s_median", ".2f", "seqgen"),
        _cell(row, "generate_s_median", ".2f", "generate"),
        _cell(row, "speedup", ".2f", "seqgen") + ("x" if row.get("speedup") else ""),
        _cell(row, "seqgen_samples_per_s", ".1f", "seqgen"),
        _cell(row, "seqgen_tokens_per_s", ".0f", "seqgen"),
        _cell(row, "generate_samples_per_s", ".1f", "generate"),
        _cell(row, "seqgen_peak_mb", "", "seqgen"),
        _cell(row, "generate_peak_mb", "", "generate"),
        f"{100 * row['same_as_float32']:.0f} %" if "same_as_float32" in row else "-",
        f"{100 * row['same_as_generate']:.0f} %" if "same_as_generate" in row else "-",
        _cell(row, "captured_s_median", ".2f", "captured") if "captured_first_s" in row or "captured_error" in row
        else row["step_path"],
        _cell(row, "captured_first_s", ".1f", "captured"),
        _cell(row, "compile_seconds", ".1f", "captured"),
        _cell(row, "captured_speedup", ".2f", "captured"),
        f"{100 * row['captured_same_as_eager']:.0f} %" if "captured_same_as_eager" in row else "-",
        _cell(row, "model_only_s_median", ".2f", "model_only"),
        _cell(row, "search_graph_speedup", ".2f", "model_only"),
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def table_md(name: str, data: dict) -> list[str]:
    md = [
        f"## {name}: {data['title']}",
        "",
        "| dtype | batch | seqgen s | generate() s | speed-up | seqgen samples/s | seqgen tokens/s | "
        "generate() samples/s | seqgen peak MiB | generate() peak MiB | = float32 | = generate() | "
        "captured s | captured first run s | compile s | captured speed-up | = eager | model step only captured s | "
        "search graph speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *map(table_row, sorted_rows(data["rows"])),
        "",
        "median of the timed runs; OOM: that system ran out of memory (the others' figures stand); `= float32`: "
        f"outputs identical to seqgen in float32 on the first {data['reference_inputs']} inputs; `= generate()`: "
        "identical to generate() in the same dtype; captured: the decode step replayed as CUDA graphs "
        "(`models/capture.py`; seqgen s is the eager step); its first run compiles and records (compile s: "
        "the capture path's own count), then its speed-up over the eager step and agreement with it; model step only "
        "captured: the beam search's step eager (no search graph), and the captured run's speed-up over it.",
    ]
    return md + skipped_md(data)
