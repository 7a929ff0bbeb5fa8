"""One benchmark cell: every system on the same work, warmed up, then interleaved ``A B C A B C ...``.

Both modes use :func:`run_cell`; a system is a "run once" callable that does its whole work for the cell
(or the warm-up's smaller share of it) and returns a :class:`Sample`: wall time, outputs, peak memory.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SYSTEMS = ("seqgen", "hf", "ct2")
MODES = ("decode", "e2e")


@dataclass
class Sample:
    """One run of one system."""

    seconds: float  # wall time
    outputs: list[Any]  # one per input: generated ids (decode) or output lines (e2e)
    peak_mb: float | None = None  # peak memory in MiB; None: not measured
    run_mb: float | None = None  # peak RSS above the RSS just before the run (decode on CPU), MiB


# run_once(warmup) -> Sample; warmup: run the smaller warm-up share of the work, untimed.
RunOnce = Callable[[bool], Sample]


@dataclass
class CellStats:
    """One system's repeats in one cell."""

    seconds: list[float] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # the first repeat's
    peak_mb: float | None = None  # max over repeats
    run_mb: float | None = None  # max over repeats

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


@dataclass
class RunResult:
    """One system in one cell: every repeat's time and the medians derived from them (a ``runs`` row)."""

    mode: str
    system: str
    backend: str
    batch_size: int
    num_beams: int
    n: int
    seconds: list[float]
    median_s: float
    samples_per_s: float
    tokens_per_s: float | None
    generated_tokens: int | None
    peak_mem_mb: float | None
    peak_mem_kind: str
    run_mem_mb: float | None = None  # decode on CPU: peak RSS above the RSS just before the run
    agreement_vs_hf: float | None = None
    speedup_vs_hf: float | None = None
    speedup_vs_ct2: float | None = None
    notes: list[str] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list, repr=False)  # first repeat's; not written to JSON


# on_cell(results so far, schedules so far, metadata): called after every cell, to save partial results.
OnCell = Callable[[list[RunResult], list[list[str]], dict[str, Any]], None]


def interleave(names: Sequence[str], repeats: int, warmup: bool) -> list[tuple[str, int]]:
    """The run order: ``(system, repeat)`` with repeat -1 for the warm-up, ``A B C A B C ...``."""
    rounds = ([-1] if warmup else []) + list(range(repeats))
    return [(name, r) for r in rounds for name in names]


def run_cell(
    systems: dict[str, RunOnce], repeats: int, warmup: bool, log: Callable[[str], None]
) -> tuple[dict[str, CellStats], list[str]]:
    """Warm up (optionally), then run the systems interleaved ``repeats`` times.

    Returns per system its times, first-repeat outputs and peak memory, and the run order as
    ``["seqgen:warmup", ..., "seqgen:0", "hf:0", ...]``."""
    stats = {name: CellStats() for name in systems}
    schedule: list[str] = []
    for name, rep in interleave(list(systems), repeats, warmup):
        schedule.append(f"{name}:{'warmup' if rep < 0 else rep}")
        sample = systems[name](rep < 0)
        if rep < 0:
            continue
        log(f"  {name} run {rep + 1}/{repeats}: {sample.seconds:.2f}s")
        st = stats[name]
        st.seconds.append(sample.seconds)
        if sample.peak_mb is not None:
            st.peak_mb = max(st.peak_mb or 0.0, sample.peak_mb)
        if sample.run_mb is not None:
            st.run_mb = max(st.run_mb or 0.0, sample.run_mb)
        if rep == 0:
            st.outputs = sample.outputs
    return stats, schedule


def run_result(
    stats: CellStats,
    *,
    mode: str,
    system: str,
    backend: str,
    batch_size: int,
    num_beams: int,
    n: int,
    peak_mem_kind: str,
    count_tokens: bool,
    notes: Sequence[str] = (),
) -> RunResult:
    """The ``runs`` row for one system's cell of ``n`` inputs; ``count_tokens``: outputs are token ids."""
    med = stats.median_s
    toks = sum(len(o) for o in stats.outputs) if count_tokens else None
    return RunResult(
        mode=mode,
        system=system,
        backend=backend,
        batch_size=batch_size,
        num_beams=num_beams,
        n=n,
        seconds=[round(t, 4) for t in stats.seconds],
        median_s=med,
        samples_per_s=n / med,
        tokens_per_s=None if toks is None else toks / med,
        generated_tokens=toks,
        peak_mem_mb=stats.peak_mb,
        peak_mem_kind=peak_mem_kind,
        run_mem_mb=stats.run_mb,
        notes=list(notes),
        outputs=stats.outputs,
    )


# -- in-process measurement (decode mode) ---------------------------------------------------------------
def _rss_mb() -> float:
    """This process's resident set size now (Linux ``/proc``; peak RSS elsewhere), MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb / 1024 if sys.platform != "darwin" else kb / 2**20


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """Peak memory (MiB) while the block runs: max allocated on a GPU, else the process RSS (sampled
    every 5 ms; ``delta`` is then the peak above the RSS at the start)."""
    import torch

    result: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) / 2**20
        return
    stop = threading.Event()
    before = _rss_mb()
    peak = [before]

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _rss_mb())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["peak"] = max(peak[0], _rss_mb())
        result["delta"] = result["peak"] - before


def timed(work: Callable[[], list[Any]], device: torch.device, track_memory: bool = True) -> Sample:
    """Run ``work`` in this process: wall time (GPU work finished), its outputs and peak memory."""
    import torch

    with peak_memory(device) as mem:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        outputs = work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    if not track_memory:
        return Sample(elapsed, outputs)
    return Sample(elapsed, outputs, mem["peak"], mem.get("delta"))
