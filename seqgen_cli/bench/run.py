"""``run_bench``: ``seqgen bench``'s top: checks the settings, reads the inputs, runs the modes (:mod:`.decode`,
:mod:`.e2e`) and writes the report after every cell (:mod:`.report`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from seqgen_cli.bench.settings import BenchSettings
from seqgen_cli.errors import SeqgenError


def _log(msg: str) -> None:
    print(f"seqgen bench: {msg}", file=sys.stderr, flush=True)


def _read_inputs(path: str, n: int) -> list[str]:
    """The first ``n`` non-empty lines of a text file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    except OSError as err:
        raise SeqgenError(f"bench: cannot read {path}: {err.strerror}") from None
    if not lines:
        raise SeqgenError(f"bench: {path} holds no input lines")
    return lines[:n]


def _check(s: BenchSettings) -> None:
    from seqgen_cli.bench.cells import MODES

    for m in s.modes:
        if m not in MODES:
            raise SeqgenError(f"bench: unknown mode {m!r} (choose from {', '.join(MODES)})")
    unknown = [c for c in s.compare if c not in ("hf", "ct2")]
    if unknown:
        raise SeqgenError(f"bench: --compare takes hf and/or ct2, not {', '.join(unknown)}")
    if s.repeats < 1 or s.n < 1:
        raise SeqgenError("bench: --repeats and --n must be at least 1")


def run_bench(s: BenchSettings, command: str = "", log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run the benchmark and write ``bench.json``, ``bench.md`` and ``bench.png`` into ``s.out``.

    Returns the JSON report plus ``table`` (the Markdown table)."""
    import torch

    from seqgen_cli.bench import report as rep
    from seqgen_cli.bench.cells import RunResult
    from seqgen_cli.bench.decode import bench_decode
    from seqgen_cli.bench.e2e import bench_e2e

    _check(s)
    if s.threads:
        torch.set_num_threads(s.threads)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = _read_inputs(s.input, s.n)
    results: list[RunResult] = []
    schedules: list[list[str]] = []
    meta: dict[str, Any] = {}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_start = rep.loadavg()

    def save(
        more: list[RunResult], more_sched: list[list[str]], more_meta: dict[str, Any], partial: bool = True
    ) -> dict[str, Any]:
        """Write bench.json with everything measured so far (after every cell, so a stop keeps it)."""
        head = {
            "command": command,
            "started": started,
            "partial": partial,
            "settings": asdict(s),
            "environment": rep.environment(),
            "load_average": {"start": load_start, "end": rep.loadavg()},  # other work on the machine
            **more_meta,
            **meta,  # decode's metadata first
            "schedules": schedules + more_sched,
        }
        return rep.write_json(out / "bench.json", head, results + more)

    for mode, bench in (("decode", bench_decode), ("e2e", bench_e2e)):
        if mode in s.modes:
            r, sch, m = bench(s, texts, log, on_cell=save)
            results += r
            schedules += sch
            meta = {**m, **meta}
    report = save([], [], {}, partial=False)
    load = rep.load_line(report["load_average"], os.cpu_count() or 1)
    report["table"] = rep.write_markdown(out / "bench.md", results, command, load)
    title = f"{Path(s.model).name}: {meta.get('device', s.device)}, {meta.get('dtype', s.dtype)}"
    if s.fixed_new_tokens:
        title += f", {s.fixed_new_tokens} new tokens"
    if not rep.plot(results, out / "bench.png", title):
        log("matplotlib is not installed: no plot (pip install matplotlib)")
    return report
