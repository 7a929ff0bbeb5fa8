"""The ``refill`` stage: ``Generator(refill=True)`` against ``refill=False`` in process, on the ``bart`` stage's
model with an EOS bias bisected into ``final_logits_bias`` (outputs spread over lengths), the ``cnndm-bart``
preset with its natural stop, ``INPUTS_PER_LANE`` x batch inputs, per dtype and batch size. The workload
(``spread_checkpoint``, ``generate_ids``, ``counted_steps``) is ``_common``'s, as the CPU measurement of
EXPERIMENTS.md, "Refill: lanes that stay full" used it."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import counted_steps, distribution, generate_ids, interleaved, spread_checkpoint

from seqgen_cli.errors import is_oom

from .base import (
    Budget,
    peak_mb,
    recycled,
    reset_peak,
    skipped_md,
    sorted_rows,
    sync,
    synced,
    table_rows,
    table_sizes,
)

REFILL_SYSTEMS = ("refill", "no_refill")
INPUTS_PER_LANE = 4  # a refill cell runs 4 x its batch of inputs (sources recycled): lanes get refilled
# 8 bisection runs over 16 sources of 1024 tokens took a whole 190 s device call on an H200; 4 sources suffice for
# a spread of lengths
BISECT_INPUTS = 4
MEAN_LENGTH = {False: 90.0, True: 12.0}  # the greedy mean length the EOS bias is bisected for (--quick: True)


def refill_settings(quick: bool) -> dict[str, Any]:
    """The ``cnndm-bart`` preset (beam 4, no-repeat 3, length penalty 2, 56-142 tokens, early stopping), natural
    stopping; ``--quick``: 64-token sources and 4-24 tokens."""
    if quick:
        return {"preset": "cnndm-bart", "max_source_length": 64, "min_length": 4, "max_length": 24}
    return {"preset": "cnndm-bart", "max_source_length": 1024}


def spread_model(base: Path, texts: list[str], device: torch.device, quick: bool) -> tuple[Path, float]:
    """``base`` with an EOS bias in ``final_logits_bias`` bisected so that greedy outputs on the first
    ``BISECT_INPUTS`` sources average ``MEAN_LENGTH`` tokens (``_common.spread_checkpoint``; built once next to
    ``base``), and that bias."""
    from safetensors import safe_open
    from transformers import AutoConfig

    mean = MEAN_LENGTH[quick]
    dest = base.parent / f"{base.name}-eos{mean:g}"
    path = spread_checkpoint(
        str(base), texts[:BISECT_INPUTS], mean, refill_settings(quick), dest, None, str(device)
    )
    eos = AutoConfig.from_pretrained(path).eos_token_id
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return path, float(f.get_tensor("final_logits_bias")[0, eos])


def refill_cell(
    path: Path, texts: list[str], device: torch.device, dtype: str, batch: int, settings: dict, reps: int
) -> dict[str, Any]:
    """One cell: ``Generator(refill=True)`` and ``Generator(refill=False)`` on ``texts`` with ``batch_size=batch``
    (refill: ``batch`` lanes). Each first runs once on its own (compiles where captured; timed as ``_first_s``),
    its decode steps and occupancy counted (``_common.counted_steps``), the memory it adds over what was
    allocated before it (``_run_peak_mb``); then ``reps`` interleaved timed runs each. Out of memory:
    ``error``."""
    from seqgen_cli.generator import Generator

    row: dict[str, Any] = {}
    gens: dict[str, Generator] = {}
    first: dict[str, list] = {}
    try:
        for system in REFILL_SYSTEMS:
            gen = gens[system] = Generator(  # every shape compiled at once: the steps captured, as in the tables
                str(path), device=str(device), dtype=dtype, refill=system == "refill", lanes=batch, capture=True,
                **settings,
            )  # fmt: skip
            reset_peak(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            sync(device)
            t0 = time.perf_counter()
            with counted_steps(gen, batch) as counts:
                first[system] = generate_ids(gen, texts, batch)
            sync(device)
            row[f"{system}_first_s"] = round(time.perf_counter() - t0, 2)
            peak = peak_mb(device)
            row[f"{system}_run_peak_mb"] = None if peak is None else round(peak - before / 2**20, 1)
            row |= {f"{system}_{k}": v for k, v in counts.items()}
        arms = {s: synced(lambda g=gen: generate_ids(g, texts, batch), device) for s, gen in gens.items()}
        times, results = interleaved(arms, reps)
    except Exception as err:  # noqa: BLE001 - out of memory only
        if not is_oom(err):
            raise
        del err
        gens.clear()
        reset_peak(device)
        return {"error": "out of memory"}
    for system, ts in times.items():
        row |= {f"{system}_s": ts, f"{system}_s_median": statistics.median(ts)}
        row |= {f"{system}_s_min": min(ts), f"{system}_s_max": max(ts)}
        stats = gens[system].device_stats()
        row[f"{system}_step_path"] = stats["step_path"]
        row |= {f"{system}_{k}": stats[k] for k in ("shapes_compiled", "compile_seconds", "captured_steps",
                                                      "eager_steps") if k in stats}  # fmt: skip
    row["refill_engine"] = gens["refill"].refill  # False: the refill engine does not run this model here
    row["speedup"] = row["no_refill_s_median"] / row["refill_s_median"]
    row["steps_ratio"] = row["refill_steps"] / row["no_refill_steps"]
    ours, theirs = first["refill"], first["no_refill"]
    row["same_as_no_refill"] = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(texts)
    row["repeats_same"] = all(r == first[s] for s, runs in results.items() for r in runs)
    lengths = [len(seqs[0]) for seqs in theirs]
    row["output_tokens"] = distribution(lengths)
    row["generated_tokens"] = sum(lengths)
    return row


def section_refill(
    base: Path,
    texts: list[str],
    device: torch.device,
    dtypes: list[str],
    plan: tuple[list[int], bool],
    max_batch: int,
    quick: bool,
    reps: int,
    budget: Budget,
) -> dict[str, Any]:
    """Refill vs ``--no-refill`` per dtype and batch size on the spread workload (:func:`spread_model`):
    ``INPUTS_PER_LANE`` x batch inputs per cell; cells that would overrun the budget are skipped, listed with
    the command that runs them, and sizes stop at the first out-of-memory cell."""
    path, bias = spread_model(base, texts, device, quick)
    settings = refill_settings(quick)
    rows: list[dict] = []
    skipped: list[str] = []
    for dtype_name in dtypes:

        def cell(batch_size: int, dtype_name: str = dtype_name) -> dict:
            inputs = INPUTS_PER_LANE * batch_size
            row = {"dtype": dtype_name, "batch": batch_size, "inputs": inputs}
            row |= refill_cell(path, recycled(texts, inputs), device, dtype_name, batch_size, settings, reps)
            reset_peak(device)
            return row

        command = f"--stages refill --dtypes {dtype_name}"
        rows += table_rows(table_sizes(*plan, max_batch), budget, skipped, command, cell, refill_row, "error")
    limits = f"{settings.get('min_length', 56)}-{settings.get('max_length', 142)} tokens"
    return {
        "title": f"cnndm-bart preset (beam 4, no-repeat 3, length penalty 2, {limits}, early stopping), natural "
        f"stop, EOS bias {bias:.2f} in final_logits_bias (greedy mean {MEAN_LENGTH[quick]:g} tokens), "
        f"{settings['max_source_length']}-token sources, {INPUTS_PER_LANE} x batch inputs, on {device}",
        "settings": {k: str(v) for k, v in settings.items()} | {"eos_bias": f"{bias:.4f}", "reps": str(reps)},
        "rows": rows,
        "skipped": skipped,
    }


def _span(row: dict, system: str) -> str:
    return f"{row[f'{system}_s_median']:.2f} ({row[f'{system}_s_min']:.2f}-{row[f'{system}_s_max']:.2f})"


def refill_row(row: dict) -> str:
    head = [row["dtype"], str(row["batch"]), str(row["inputs"])]
    if "error" in row:
        return "| " + " | ".join(head + ["OOM"] + ["-"] * 11) + " |"
    out = row["output_tokens"]
    cells = [
        _span(row, "refill"),
        _span(row, "no_refill"),
        f"{row['speedup']:.2f}x",
        f"{row['refill_steps']} / {row['no_refill_steps']} ({row['steps_ratio']:.2f})",
        f"{row['refill_occupancy']:.2f} / {row['no_refill_occupancy']:.2f}",
        str(row["refill_joins"]),
        f"{100 * row['same_as_no_refill']:.0f} %",
        f"{out['p10']:g} / {out['median']:g} / {out['p90']:g} ({out['min']}-{out['max']})",
        f"{row['refill_first_s']:.1f} / {row['no_refill_first_s']:.1f}",
        row["refill_step_path"],
        f"{row.get('refill_shapes_compiled', '-')} / {row.get('no_refill_shapes_compiled', '-')}",
        f"{row['refill_run_peak_mb'] or '-'} / {row['no_refill_run_peak_mb'] or '-'}",
    ]
    return "| " + " | ".join(head + cells) + " |"


def refill_md(name: str, data: dict) -> list[str]:
    md = [
        f"## {name}: {data['title']}",
        "",
        "| dtype | batch | inputs | refill s | no-refill s | speed-up | steps refill / no-refill | occupancy "
        "refill / no-refill | joins | = no-refill | output tokens p10 / median / p90 (min-max) | first run s "
        "refill / no-refill | step path (refill) | shapes compiled refill / no-refill | run peak MiB refill / "
        "no-refill |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        *map(refill_row, sorted_rows(data["rows"])),
        "",
        "in-process `Generator(refill=True/False).generate(inputs, batch_size=batch)`'s batching (refill: `batch` "
        "lanes over each look-ahead window); seconds: median (min-max) of the interleaved timed runs after each "
        "system's first run (which compiles where the step is captured); speed-up: no-refill s / refill s; "
        "steps: decode steps of the first run, occupancy: live rows / (steps x batch x beams); = no-refill: "
        "inputs whose outputs are token-identical; output tokens: per input, best sequence; run peak: the "
        "most memory the first run adds to what was allocated before it (CUDA).",
    ]
    return md + skipped_md(data)
