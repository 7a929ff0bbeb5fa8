"""``seqgen bench``: speed and agreement of seqgen against transformers ``generate()`` and CTranslate2.

Every (beams, batch size) cell runs the systems on the same work, interleaved after a warm-up (:mod:`.cells`):
:mod:`.decode` times generation only (systems in :mod:`.systems`, CTranslate2 in :mod:`.ct2`), :mod:`.e2e`
whole processes, files to files (against :mod:`.baselines`). Agreement: outputs token-identical (decode) or
text-identical (e2e) to transformers'. :mod:`.report` writes ``bench.json``, ``bench.md``, ``bench.png``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from seqgen_cli.errors import SeqgenError


@dataclass
class BenchSettings:
    """Everything one ``seqgen bench`` invocation needs."""

    model: str
    input: str
    n: int = 32
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_beams: list[int] = field(default_factory=lambda: [1, 4])
    compare: list[str] = field(default_factory=lambda: ["hf", "ct2"])
    modes: list[str] = field(default_factory=lambda: ["decode"])
    device: str = "auto"
    dtype: str = "auto"
    fixed_new_tokens: int | None = None
    repeats: int = 3
    warmup: bool = True
    max_batches: int | None = None
    threads: int | None = None
    out: str = "bench-results"
    preset: str | None = None
    prefix: str | None = None
    max_source_length: int | None = None
    ct2_cache: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)

    def generation_flags(self, beams: int) -> dict[str, Any]:
        """The generation flags of one cell: the user's, the cell's beams, fixed lengths when asked."""
        flags = {k: v for k, v in self.generation.items() if v is not None}
        flags["num_beams"] = beams
        flags["num_return_sequences"] = 1
        if self.fixed_new_tokens is not None:
            for k in ("max_length", "min_length"):
                flags.pop(k, None)
            flags["max_new_tokens"] = flags["min_new_tokens"] = self.fixed_new_tokens
        return flags


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
    report["table"] = rep.write_markdown(out / "bench.md", results, command)
    title = f"{Path(s.model).name}: {meta.get('device', s.device)}, {meta.get('dtype', s.dtype)}"
    if s.fixed_new_tokens:
        title += f", {s.fixed_new_tokens} new tokens"
    if not rep.plot(results, out / "bench.png", title):
        log("matplotlib is not installed: no plot (pip install matplotlib)")
    return report
