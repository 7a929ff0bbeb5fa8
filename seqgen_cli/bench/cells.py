"""Benchmark cells, for both modes: every system on the same work, warmed up, then interleaved ``A B C A B C
...``; a system is a "run once" callable doing its work for the cell (or the warm-up's smaller share)."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from seqgen_cli.errors import SeqgenError

if TYPE_CHECKING:
    from seqgen_cli.bench.ct2 import Ct2Plan
    from seqgen_cli.bench.settings import BenchSettings
    from seqgen_cli.generator import Generator

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
    bleu_vs_hf: float | None = None  # int8: BLEU of the detokenised outputs against hf's (float32)
    beyond_ties: int | None = None  # decode: outputs that differ from hf's beyond near-ties (re-scored)
    sampled: bool = False  # draws from the system's own random stream: not compared with hf's
    speedup_vs_hf: float | None = None
    speedup_vs_ct2: float | None = None
    notes: list[str] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list, repr=False)  # first repeat's; not written to JSON


# judge(rows of one cell): sets their beyond_ties from their outputs and hf's (decode mode).
Judge = Callable[[list["RunResult"]], None]
SAMPLED_NOTE = "sampling: each system draws from its own random stream, so outputs are not compared (same as hf: –)"

# on_cell(results so far, schedules so far, metadata): called after every cell, to save partial results.
OnCell = Callable[[list[RunResult], list[list[str]], dict[str, Any]], None]


def interleave(names: Sequence[str], repeats: int, warmup: bool) -> list[tuple[str, int]]:
    """The run order: ``(system, repeat)`` with repeat -1 for the warm-up, ``A B C A B C ...``."""
    order = ([-1] if warmup else []) + list(range(repeats))
    return [(name, r) for r in order for name in names]


def run_cell(
    systems: dict[str, RunOnce], repeats: int, warmup: bool, log: Callable[[str], None]
) -> tuple[dict[str, list[Sample]], list[str]]:
    """Warm up (optionally), then run the systems interleaved ``repeats`` times.

    Returns per system its timed samples, and the run order as ``["seqgen:warmup", ..., "seqgen:0", ...]``."""
    samples: dict[str, list[Sample]] = {name: [] for name in systems}
    schedule: list[str] = []
    for name, rep in interleave(list(systems), repeats, warmup):
        schedule.append(f"{name}:{'warmup' if rep < 0 else rep}")
        sample = systems[name](rep < 0)
        if rep >= 0:
            log(f"  {name} run {rep + 1}/{repeats}: {sample.seconds:.2f}s")
            samples[name].append(sample)
    return samples, schedule


@dataclass
class Entrant:
    """One system in one cell: its run-once callable and the labels of its ``runs`` row."""

    run_once: RunOnce
    backend: str
    mem_kind: str  # what peak_mem_mb measures: "rss", "max allocated", "process max rss" or "n/a"
    notes: Sequence[str] = ()


Cell = dict[str, Entrant]  # the systems of one cell, by name


def dtype_name(gen: Generator) -> str:
    """The Generator's dtype as transformers and CTranslate2 spell it: ``float32``, ``bfloat16``, ``int8`` ..."""
    return "int8" if gen.loaded.int8 else str(gen.loaded.dtype).replace("torch.", "")


INT8_REFERENCE_NOTE = (
    "int8: hf is float32 generate(), the agreement reference (same as hf: token-identical to float32; "
    "BLEU vs hf: the detokenised outputs against float32's, sacrebleu)"
)


def bleu_vs_reference(rows: list[RunResult], detok: Callable[[list[Any]], list[str]]) -> None:
    """Set ``bleu_vs_hf`` of every row of one cell: corpus BLEU of its outputs against the hf row's."""
    import sacrebleu

    ref = next((r for r in rows if r.system == "hf"), None)
    if ref is None or not ref.outputs:
        return
    refs = detok(ref.outputs)
    for r in rows:
        if len(r.outputs) == len(refs):
            r.bleu_vs_hf = round(sacrebleu.corpus_bleu(detok(r.outputs), [refs]).score, 2)


def run_mode(
    mode: str,
    s: BenchSettings,
    texts: list[str],
    log: Callable[[str], None],
    on_cell: OnCell | None,
    ct2_setup: Callable[[Generator], tuple[Any, Ct2Plan]],
    cells: Callable[[int, Generator, Any], Callable[[int, int], Cell]],
    judge: Callable[[Generator], Judge] | None = None,
) -> tuple[list[RunResult], list[list[str]], dict[str, Any]]:
    """Every (beams, batch size) cell of one mode; returns results, the run order per cell and metadata.

    Per beam count a ``Generator`` resolves the settings as ``seqgen generate`` does and ``ct2_setup``
    readies CTranslate2 for them (a ``SeqgenError``: ct2 skipped from then on, noted in ``ct2_skipped``);
    ``cells(beams, gen, ct2_part or None)`` gives ``cell(batch_size, n)``: the systems on the first n inputs;
    ``judge(gen)`` (decode) marks each cell's rows whose outputs differ from hf's beyond near-ties."""
    from seqgen_cli.generator import Generator

    results: list[RunResult] = []
    schedules: list[list[str]] = []
    meta: dict[str, Any] = {}
    want_ct2 = "ct2" in s.compare
    for beams in s.num_beams:
        gen = Generator(  # capture=True: on CUDA a shape compiles at its first batch (the warm-up where it can)
            s.model,
            backend=s.backend,
            device=s.device,
            dtype=s.dtype,
            preset=s.preset,
            prefix=s.prefix,
            max_source_length=s.max_source_length,
            capture=True,
            target_lang=s.target_lang,
            seed=s.seed,
            **s.generation_flags(beams),
        )
        sampled = bool(gen.config.do_sample)
        meta.setdefault("seqgen_backend", gen.backend)
        meta.setdefault("max_source_length", gen.max_source_length)
        meta.setdefault("device", str(gen.loaded.device))
        meta.setdefault("dtype", dtype_name(gen))
        meta.setdefault("generation_config", {})[str(beams)] = gen.config.to_diff_dict()
        ct2_part = None
        if want_ct2:
            try:
                ct2_part, plan = ct2_setup(gen)
                meta.setdefault("ct2_plan", {})[str(beams)] = asdict(plan)
            except SeqgenError as err:
                log(f"skipping ct2: {err}")
                meta["ct2_skipped"] = str(err)
                want_ct2 = False
        cell = cells(beams, gen, ct2_part)
        detok = functools.partial(_texts, mode, gen.tokenizer)
        check = judge(gen) if judge is not None and not sampled and not gen.loaded.int8 else None
        del gen  # e2e: no model in memory while the subprocesses run (decode's systems keep theirs)
        for bs in s.batch_sizes:
            n = min(len(texts), s.max_batches * bs) if s.max_batches else len(texts)
            entrants = cell(bs, n)
            log(f"{mode} beams={beams} batch={bs} n={n}: {', '.join(entrants)}")
            samples, schedule = run_cell(
                {name: e.run_once for name, e in entrants.items()}, s.repeats, s.warmup, log
            )
            schedules.append(schedule)
            rows = [_row(mode, name, e, samples[name], bs, beams, n) for name, e in entrants.items()]
            for r in rows:
                r.sampled = sampled
                r.notes = [*r.notes, SAMPLED_NOTE] if sampled else r.notes
            if s.dtype == "int8":
                bleu_vs_reference(rows, detok)
            if check is not None:
                check(rows)
            results += rows
            if on_cell:
                on_cell(results, schedules, meta)
        cell = entrants = check = None  # free this beam count's model before the next one loads
    return results, schedules, meta


def _texts(mode: str, tokenizer: Any, outputs: list[Any]) -> list[str]:
    """Outputs as text: e2e's are lines already; decode's are token ids (ct2: -1 = not in its vocabulary)."""
    if mode != "decode":
        return outputs
    return tokenizer.batch_decode([[t for t in o if t >= 0] for o in outputs], skip_special_tokens=True)


def _row(mode: str, system: str, e: Entrant, samples: list[Sample], bs: int, beams: int, n: int) -> RunResult:
    """The ``runs`` row of one system's cell of ``n`` inputs (decode: outputs are token ids, counted)."""
    seconds = [x.seconds for x in samples]
    med = statistics.median(seconds)
    outputs = samples[0].outputs
    toks = sum(len(o) for o in outputs) if mode == "decode" else None
    peaks = [x.peak_mb for x in samples if x.peak_mb is not None]
    runs = [x.run_mb for x in samples if x.run_mb is not None]
    return RunResult(
        mode=mode,
        system=system,
        backend=e.backend,
        batch_size=bs,
        num_beams=beams,
        n=n,
        seconds=[round(t, 4) for t in seconds],
        median_s=med,
        samples_per_s=n / med,
        tokens_per_s=None if toks is None else toks / med,
        generated_tokens=toks,
        peak_mem_mb=max(peaks, default=None),
        peak_mem_kind=e.mem_kind,
        run_mem_mb=max(runs, default=None),
        notes=list(e.notes),
        outputs=outputs,
    )
