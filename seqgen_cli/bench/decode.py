"""Decode mode: model loaded, inputs tokenised; only generation is timed (what CTranslate2 reports).

Per beam count one ``Generator`` resolves the settings; every system then generates for the same batches
(the first ``n`` inputs sorted by length, cut into batches) in each batch-size cell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from seqgen_cli.batching import plan_batches
from seqgen_cli.bench import ct2
from seqgen_cli.bench.cells import OnCell, RunOnce, RunResult, Sample, run_cell, run_result, timed
from seqgen_cli.bench.systems import (
    Ct2Model,
    Ct2System,
    HFSystem,
    SeqgenSystem,
    System,
    check_compute_type,
    load_ct2_model,
)
from seqgen_cli.errors import SeqgenError

if TYPE_CHECKING:
    import torch

    from seqgen_cli.bench import BenchSettings

WARMUP_ROWS = 8  # the warm-up runs the first batch's first rows: same code paths, less time


def bench_decode(
    s: BenchSettings, texts: list[str], log: Callable[[str], None], on_cell: OnCell | None = None
) -> tuple[list[RunResult], list[list[str]], dict[str, Any]]:
    """Run every decode cell; returns results, the run schedule (per cell), and run metadata.

    ``on_cell(results, schedules, meta)`` is called after every cell (to save partial results)."""
    from seqgen_cli.generator import Generator

    results: list[RunResult] = []
    schedules: list[list[str]] = []
    meta: dict[str, Any] = {}
    ct2_model: Ct2Model | None = None  # converted and loaded once, for every beam count
    want_ct2 = "ct2" in s.compare
    if want_ct2:
        reason = ct2.ct2_available()
        if reason:
            log(f"skipping ct2: {reason}")
            meta["ct2_skipped"] = reason
            want_ct2 = False
    for beams in s.num_beams:
        gen = Generator(
            s.model,
            backend="auto",
            device=s.device,
            dtype=s.dtype,
            preset=s.preset,
            prefix=s.prefix,
            max_source_length=s.max_source_length,
            **s.generation_flags(beams),
        )
        device = gen.loaded.device
        meta.setdefault("seqgen_backend", gen.backend)
        meta.setdefault("max_source_length", gen.max_source_length)
        meta.setdefault("device", str(device))
        meta.setdefault("dtype", str(gen.loaded.dtype).replace("torch.", ""))
        meta.setdefault("generation_config", {})[str(beams)] = gen.config.to_diff_dict()
        encoded = [e.ids for e in gen.encode(texts)]
        systems: list[System] = [SeqgenSystem(gen)]
        if "hf" in s.compare:
            systems.append(HFSystem(gen))
        if want_ct2:
            try:
                check_compute_type(gen)
                ct2_model = ct2_model or load_ct2_model(s.model, s.ct2_cache, gen, s.threads, log)
                plan = ct2.plan_for(gen, ct2_model.path, ct2_model.vocab)
                systems.append(Ct2System(ct2_model, plan, gen.tokenizer, gen.is_encoder_decoder))
                meta.setdefault("ct2_plan", {})[str(beams)] = asdict(plan)
            except SeqgenError as err:
                log(f"skipping ct2: {err}")
                meta["ct2_skipped"] = str(err)
                want_ct2 = False
        for bs in s.batch_sizes:
            n = min(len(encoded), s.max_batches * bs) if s.max_batches else len(encoded)
            ids = encoded[:n]
            batches = [[ids[i] for i in b] for b in plan_batches([len(x) for x in ids], bs, None)]
            log(f"decode beams={beams} batch={bs} n={n}: {', '.join(x.name for x in systems)}")
            cell, schedule = run_cell(
                {x.name: _run_once(x, batches, device) for x in systems}, s.repeats, s.warmup, log
            )
            schedules.append(schedule)
            for x in systems:
                kind = "n/a" if x.mem_kind == "n/a" else "max allocated" if device.type == "cuda" else "rss"
                results.append(
                    run_result(
                        cell[x.name],
                        mode="decode",
                        system=x.name,
                        backend=x.backend,
                        batch_size=bs,
                        num_beams=beams,
                        n=n,
                        peak_mem_kind=kind,
                        count_tokens=True,
                        notes=x.notes,
                    )
                )
            if on_cell:
                on_cell(results, schedules, meta)
        del systems, gen
    return results, schedules, meta


def _run_once(system: System, batches: list[list[list[int]]], device: torch.device) -> RunOnce:
    """The cell's work for one system: every batch (the warm-up: the first batch's first rows)."""
    prepared = [system.prepare(b) for b in batches]  # untimed
    warmup_work = [prepared[0][:WARMUP_ROWS]]

    def run_once(warmup: bool) -> Sample:
        work = warmup_work if warmup else prepared

        def generate() -> list[list[int]]:
            return [out for batch in work for out in system.run(batch)]

        return timed(generate, device, track_memory=system.mem_kind != "n/a")

    return run_once
