"""Decode mode: model loaded, inputs tokenised; only generation is timed (what CTranslate2 reports), every
system on the same batches of token ids (the first ``n`` inputs sorted by length)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from seqgen_cli.batching import plan_batches
from seqgen_cli.bench import ct2
from seqgen_cli.bench.cells import Entrant, Sample, run_mode
from seqgen_cli.bench.systems import Ct2System, HFSystem, SeqgenSystem, System

if TYPE_CHECKING:
    from seqgen_cli.bench.cells import Cell, OnCell, RunOnce, RunResult
    from seqgen_cli.bench.settings import BenchSettings
    from seqgen_cli.generator import Generator

WARMUP_ROWS = 8  # the warm-up runs the first batch's first rows: same code paths, less time


def bench_decode(
    s: BenchSettings, texts: list[str], log: Callable[[str], None], on_cell: OnCell | None = None
) -> tuple[list[RunResult], list[list[str]], dict[str, Any]]:
    """Run every decode cell (see :func:`~seqgen_cli.bench.cells.run_mode`)."""
    ct2_system: Ct2System | None = None  # converted and loaded once, for every beam count
    reference: torch.nn.Module | None = None  # int8: the float32 model hf runs, loaded once

    def ct2_setup(gen: Generator) -> tuple[Ct2System, ct2.Ct2Plan]:
        nonlocal ct2_system
        ct2_system = ct2_system or Ct2System(s.model, s.ct2_cache, gen, s.threads, log)
        return ct2_system, ct2_system.use(gen)

    def cells(beams: int, gen: Generator, ct2_ready: Ct2System | None) -> Callable[[int, int], Cell]:
        nonlocal reference
        device = gen.loaded.device
        encoded = [e.ids for e in gen.encode(texts)]
        systems: list[System] = [SeqgenSystem(gen)]
        if "hf" in s.compare:
            if gen.loaded.int8 and reference is None:
                from seqgen_cli.loading import load

                reference = load(s.model, str(device), "float32").model
            systems.append(HFSystem(gen, reference if gen.loaded.int8 else None))
        systems += [ct2_ready] if ct2_ready else []
        kind = "max allocated" if device.type == "cuda" else "rss"

        def cell(bs: int, n: int) -> Cell:
            ids = encoded[:n]
            # batches as `seqgen generate` cuts them
            plan = list(plan_batches([len(x) for x in ids], bs, None, buckets=gen.buckets, width=gen.width))
            batches = [[ids[i] for i in b] for b in plan]
            order = [i for b in plan for i in b]
            return {
                x.name: Entrant(
                    _run_once(x, batches, order, device), x.backend, kind if x.measured else "n/a", x.notes
                )
                for x in systems
            }

        return cell

    def judge(gen: Generator) -> Callable[[list[RunResult]], None]:
        """Each row's outputs against hf's: how many differ beyond near-ties (``verify.beyond_ties``)."""
        from seqgen_cli.verify import beyond_ties

        encoded = [e.ids for e in gen.encode(texts)]

        def check(rows: list[RunResult]) -> None:
            hf = next((r for r in rows if r.system == "hf"), None)
            for r in rows:
                if hf is not None and r is not hf and len(r.outputs) == len(hf.outputs):
                    r.beyond_ties = len(beyond_ties(gen, encoded, r.outputs, hf.outputs))

        return check

    return run_mode("decode", s, texts, log, on_cell, ct2_setup, cells, judge)


def _run_once(system: System, batches: list[list[list[int]]], order: list[int], device: torch.device) -> RunOnce:
    """The cell's work for one system in this process: every batch (the warm-up: the first batch's first
    rows); wall time with the GPU work finished, outputs (in input order: ``order``, the batches' inputs) and
    peak memory."""
    prepared = [system.prepare(b) for b in batches]  # untimed
    warmup_work = [prepared[0][:WARMUP_ROWS]]

    def run_once(warmup: bool) -> Sample:
        with peak_memory(device) as mem:
            start = time.perf_counter()
            outputs = [out for batch in (warmup_work if warmup else prepared) for out in system.run(batch)]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
        if not warmup:
            outputs = [out for _, out in sorted(zip(order, outputs, strict=True), key=lambda pair: pair[0])]
        if not system.measured:
            return Sample(elapsed, outputs)
        return Sample(elapsed, outputs, mem["peak"], mem.get("delta"))

    return run_once


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
    """Peak memory (MiB) while the block runs: max allocated on a GPU (synchronised before), else the
    process RSS (sampled every 5 ms; ``delta`` is then the peak above the RSS at the start)."""
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
