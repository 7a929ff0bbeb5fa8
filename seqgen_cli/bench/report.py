"""What ``seqgen bench`` writes: ratios and agreement per cell, ``bench.json``, the Markdown table
(``bench.md``) and the plot (``bench.png``), with the environment facts the JSON records."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

from seqgen_cli.bench.cells import MODES, SYSTEMS, RunResult
from seqgen_cli.whole import write_whole


def add_ratios(results: list[RunResult]) -> None:
    """Speed-ups (median time ratios) and agreement against transformers / CTranslate2 in each cell."""
    cells: dict[tuple[str, int, int], dict[str, RunResult]] = {}
    for r in results:
        cells.setdefault((r.mode, r.batch_size, r.num_beams), {})[r.system] = r
    for cell in cells.values():
        hf, ct2 = cell.get("hf"), cell.get("ct2")
        for r in cell.values():
            if hf is not None:
                r.speedup_vs_hf = hf.median_s / r.median_s
                ref, mine = hf.outputs, r.outputs
                if ref and len(ref) == len(mine) and not r.sampled:
                    r.agreement_vs_hf = 100.0 * sum(a == b for a, b in zip(mine, ref, strict=True)) / len(ref)
            if ct2 is not None:
                r.speedup_vs_ct2 = ct2.median_s / r.median_s


def write_json(path: Path, head: dict[str, Any], results: list[RunResult]) -> dict[str, Any]:
    """Write and return ``bench.json``: ``head`` (command, settings, metadata ...), then every run (ratios
    added, outputs left out)."""
    add_ratios(results)
    report = {**head, "runs": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in results]}
    write_whole(path, json.dumps(report, indent=2, default=str) + "\n")
    return report


TITLES = {
    "decode": "decode-only (model loaded, inputs tokenised)",
    "e2e": "end-to-end (files to files, fresh process)",
}


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def markdown_table(results: list[RunResult]) -> str:
    """One Markdown table per mode, rows by (beams, batch size, system)."""
    parts = []
    for mode in MODES:
        rows = [r for r in results if r.mode == mode]
        if not rows:
            continue
        bleu = any(r.bleu_vs_hf is not None for r in rows)  # int8 benches: a BLEU column
        parts.append(f"**{TITLES[mode]}**\n")
        parts.append(
            "| beams | batch | system | backend | n | median s | samples/s | tokens/s | peak MiB | +run MiB | "
            "vs hf | vs ct2 | same as hf |" + (" BLEU vs hf |" if bleu else "")
        )
        parts.append(
            "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if bleu else "")
        )
        for r in sorted(rows, key=lambda r: (r.num_beams, r.batch_size, SYSTEMS.index(r.system))):
            parts.append(
                f"| {r.num_beams} | {r.batch_size} | {r.system} | {r.backend} | {r.n} | {r.median_s:.2f} | "
                f"{r.samples_per_s:.2f} | {_fmt(r.tokens_per_s, '.0f')} | {_fmt(r.peak_mem_mb, '.0f')} | "
                f"{_fmt(r.run_mem_mb, '.0f')} | {_fmt(r.speedup_vs_hf, '.2f', '×')} | "
                f"{_fmt(r.speedup_vs_ct2, '.2f', '×')} | {_fmt(r.agreement_vs_hf, '.0f', ' %')} |"
                + (f" {_fmt(r.bleu_vs_hf, '.1f')} |" if bleu else "")
            )
        notes = dict.fromkeys(f"{r.system}: {note}" for r in rows for note in [*r.notes, *_flag(r)])
        parts += [""] + [f"- {note}" for note in notes] if notes else []
        parts.append("")
    return "\n".join(parts)


def _flag(r: RunResult) -> list[str]:
    """A cell whose outputs differ from generate()'s beyond near-ties (``beyond_ties``): its speed-up compares
    other work."""
    if not r.beyond_ties:
        return []
    return [
        f"**{r.beyond_ties} of {r.n} outputs differ from generate()'s beyond near-ties** (beams {r.num_beams}, batch "
        f"{r.batch_size}; re-scored under transformers' model): its speed compares other outputs"
    ]


def load_line(load: dict[str, list[float] | None], cores: int) -> str:
    """The machine's load around the run, for ``bench.md``: the 1-min load average at its start and end on
    ``cores`` cores, and a warning where other work already kept half of them busy when it started (the figures
    are then not a quiet machine's; the run's own work raises the end figure)."""
    start, end = load.get("start"), load.get("end")
    if not start or not end:
        return ""
    line = f"Load average (1 min): {start[0]:.2f} at the start, {end[0]:.2f} at the end, on {cores} cores."
    if start[0] > cores / 2:
        line += f" **Busy machine**: other work kept {start[0]:.1f} cores busy before the run; compare with care."
    return line + "\n\n"


def write_markdown(path: Path, results: list[RunResult], command: str, load: str = "") -> str:
    """Write ``bench.md``: the command line, the load (:func:`load_line`), then the tables; returns the tables."""
    table = markdown_table(results)
    write_whole(path, (f"Command: `{command}`\n\n" if command else "") + load + table + "\n")
    return table


def plot(results: list[RunResult], path: Path, title: str) -> bool:
    """Throughput (samples/s) vs batch size, a line per system, a panel per (mode, beams). False: no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = [m for m in MODES if any(r.mode == m for r in results)]
    beams = sorted({r.num_beams for r in results})
    sizes = sorted({r.batch_size for r in results})
    fig, axes = plt.subplots(
        len(modes), len(beams), figsize=(4.5 * len(beams), 3.6 * len(modes)), squeeze=False
    )
    for (i, mode), (j, b) in itertools.product(enumerate(modes), enumerate(beams)):
        ax = axes[i][j]
        for system in SYSTEMS:
            rows = [r for r in results if (r.mode, r.num_beams, r.system) == (mode, b, system)]
            rows.sort(key=lambda r: r.batch_size)
            if rows:
                label = f"seqgen ({rows[0].backend})" if system == "seqgen" and mode == "decode" else system
                ax.plot(
                    [r.batch_size for r in rows], [r.samples_per_s for r in rows], marker="o", label=label
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(x) for x in sizes])
        ax.minorticks_off()
        ax.set(ylim=(0, None), xlabel="batch size", ylabel="samples/s")
        ax.set_title(f"{mode}, beams={b}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages (other work on the machine), or ``None`` where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict[str, Any]:
    """Versions and machine facts for the JSON file."""
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(ImportError):
        import ctranslate2

        info["ctranslate2"] = ctranslate2.__version__
    return info
