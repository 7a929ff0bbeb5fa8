"""``seqgen bench``: speed and agreement of seqgen against transformers ``generate()`` and CTranslate2.

For every (beams, batch size) cell the systems run on the same batches (the first ``n`` inputs, sorted by
length, cut into batches), interleaved after a warm-up: ``A B C A B C ...``; the median of the repeats
is reported. Two modes:

- ``decode``: model loaded, inputs tokenised; only generation is timed (what CTranslate2 reports).
- ``e2e``: the whole process from input file to output file, each system a fresh subprocess
  (``python -m seqgen_cli generate`` against the minimal scripts in ``seqgen_cli.bench_e2e``).

Agreement is the share of outputs token-identical (decode) or text-identical (e2e) to transformers'.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from seqgen_cli import bench_ct2
from seqgen_cli.errors import SeqgenError

SYSTEMS = ("seqgen", "hf", "ct2")
MODES = ("decode", "e2e")
REPO_ROOT = Path(__file__).resolve().parent.parent
WARMUP_ROWS = 8


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


@dataclass
class RunResult:
    """One system in one cell: every repeat's time and the medians derived from them."""

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


# -- memory ----------------------------------------------------------------------------------------
def _rss_mb() -> float:
    """This process's resident set size now (Linux ``/proc``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb / 1024 if sys.platform != "darwin" else kb / 2**20


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """Peak memory while the block runs: max allocated on a GPU, else the process RSS (sampled)."""
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


# -- systems (decode-only mode) ----------------------------------------------------------------------
class System:
    """A way to generate: ``run(batch of token-id lists) -> first output's generated ids per input``."""

    name = ""
    backend = ""
    mem_kind = "rss"
    notes: list[str]

    def run(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        raise NotImplementedError


class SeqgenSystem(System):
    """seqgen's ``Generator`` (best backend available: ``fast`` when it can, else ``hf``)."""

    name = "seqgen"

    def __init__(self, gen: Any) -> None:
        self.gen = gen
        self.backend = gen.backend
        self.notes = [] if gen.backend == "fast" else ["seqgen's engine unavailable: backend hf"]

    def run(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        return [seqs[0] for seqs in self.gen.generate_ids(batch)]


class HFSystem(System):
    """Plain transformers ``generate()`` on the same model object, with a copy of the same settings."""

    name = "hf"
    backend = "transformers"

    def __init__(self, model: Any, tokenizer: Any, config: Any, seq2seq: bool, device: torch.device) -> None:
        self.model, self.tokenizer, self.seq2seq, self.device = model, tokenizer, seq2seq, device
        self.config = copy.deepcopy(config)
        self.config.num_return_sequences = 1
        eos = self.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.notes = []

    @torch.inference_mode()
    def run(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "right" if self.seq2seq else "left"
        try:
            enc = self.tokenizer.pad({"input_ids": [list(x) for x in batch]}, return_tensors="pt")
        finally:
            self.tokenizer.padding_side = side
        enc = enc.to(self.device)
        out = self.model.generate(**enc, generation_config=self.config)
        start = 1 if self.seq2seq else enc["input_ids"].shape[1]
        rows = []
        for row in out[:, start:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            rows.append(row[:cut])
        return rows


class Ct2System(System):
    """CTranslate2 ``Translator`` (encoder-decoder) or ``Generator`` (decoder-only) on the converted model."""

    name = "ct2"
    mem_kind = "rss"

    def __init__(self, engine: Any, plan: bench_ct2.Ct2Plan, tokenizer: Any, vocab: list[str], seq2seq: bool):
        import ctranslate2

        self.engine, self.plan, self.tokenizer, self.seq2seq = engine, plan, tokenizer, seq2seq
        self.index = {t: i for i, t in enumerate(vocab)}
        self.backend = f"ctranslate2 {ctranslate2.__version__}"
        self.notes = list(plan.notes)
        self.mem_kind = "rss" if engine.device == "cpu" else "n/a"

    def tokens(self, batch: Sequence[Sequence[int]]) -> list[list[str]]:
        """Token ids to the token strings CTranslate2 takes (done before timing)."""
        return [self.tokenizer.convert_ids_to_tokens(list(x)) for x in batch]

    def run_tokens(self, tokens: list[list[str]]) -> list[list[int]]:
        p = self.plan
        if self.seq2seq:
            prefix = [p.prefix] * len(tokens) if p.prefix else None
            results = self.engine.translate_batch(tokens, target_prefix=prefix, **p.options)
            hyps = [list(r.hypotheses[0]) for r in results]
        else:
            hyps = [list(r.sequences[0]) for r in self.engine.generate_batch(tokens, **p.options)]
        out = []
        for hyp in hyps:
            if p.append_eos and not (hyp and hyp[-1] in p.eos):
                hyp.append(p.append_eos)
            out.append([self.index.get(t, -1) for t in hyp])
        return out

    def run(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        return self.run_tokens(self.tokens(batch))


# -- helpers -----------------------------------------------------------------------------------------
def read_inputs(path: str, n: int) -> list[str]:
    """The first ``n`` non-empty lines of a text file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    except OSError as err:
        raise SeqgenError(f"bench: cannot read {path}: {err.strerror}") from None
    if not lines:
        raise SeqgenError(f"bench: {path} holds no input lines")
    return lines[:n]


def make_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Input positions sorted by length (as ``seqgen generate`` does), cut into batches."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def interleave(names: Sequence[str], repeats: int, warmup: bool) -> list[tuple[str, int]]:
    """The run order: ``(system, repeat)`` with repeat -1 for the warm-up, ``A B C A B C ...``."""
    rounds = ([-1] if warmup else []) + list(range(repeats))
    return [(name, r) for r in rounds for name in names]


def generation_flags(settings: BenchSettings, beams: int) -> dict[str, Any]:
    """The generation flags of one cell: the user's, the cell's beams, fixed lengths when asked."""
    flags = {k: v for k, v in settings.generation.items() if v is not None}
    flags["num_beams"] = beams
    flags["num_return_sequences"] = 1
    if settings.fixed_new_tokens is not None:
        for k in ("max_length", "min_length"):
            flags.pop(k, None)
        flags["max_new_tokens"] = flags["min_new_tokens"] = settings.fixed_new_tokens
    return flags


def min_new_tokens(config: Any, seq2seq: bool, prompt_len: int = 0) -> int:
    """Fewest new tokens before EOS, in transformers' terms."""
    if config.min_new_tokens is not None:
        return config.min_new_tokens
    return max(0, (config.min_length or 0) - (1 if seq2seq else prompt_len))


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _log(msg: str) -> None:
    print(f"seqgen bench: {msg}", file=sys.stderr, flush=True)


# -- decode-only mode ----------------------------------------------------------------------------------
OnCell = Callable[[list[RunResult], list[list[str]], dict[str, Any]], None]


def bench_decode(
    s: BenchSettings, texts: list[str], log: Callable[[str], None] = _log, on_cell: OnCell | None = None
) -> tuple[list[RunResult], list[list[str]], dict[str, Any]]:
    """Run every decode-only cell; returns results, the run schedule (per cell), and run metadata.

    ``on_cell(results, schedules, meta)`` is called after every cell (to save partial results)."""
    from seqgen_cli.generator import Generator

    results: list[RunResult] = []
    schedules: list[list[str]] = []
    meta: dict[str, Any] = {}
    ct2_state: dict[str, Any] = {}
    want_ct2 = "ct2" in s.compare
    if want_ct2:
        reason = bench_ct2.ct2_available()
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
            **generation_flags(s, beams),
        )
        device = gen.loaded.device
        seq2seq = gen.is_encoder_decoder
        meta.setdefault("seqgen_backend", gen.backend)
        meta.setdefault("max_source_length", gen.max_source_length)
        meta.setdefault("device", str(device))
        meta.setdefault("dtype", str(gen.loaded.dtype).replace("torch.", ""))
        meta.setdefault("generation_config", {})[str(beams)] = gen.config.to_diff_dict()
        encoded = [e.ids for e in gen.encode(texts)]
        systems: list[System] = [SeqgenSystem(gen)]
        if "hf" in s.compare:
            systems.append(HFSystem(gen.model, gen.tokenizer, gen.config, seq2seq, device))
        if want_ct2:
            try:
                systems.append(_ct2_system(s, gen, ct2_state, log))
                meta.setdefault("ct2_plan", {})[str(beams)] = asdict(ct2_state["plan"])
            except SeqgenError as err:
                log(f"skipping ct2: {err}")
                meta["ct2_skipped"] = str(err)
                want_ct2 = False
        for bs in s.batch_sizes:
            n = min(len(encoded), s.max_batches * bs) if s.max_batches else len(encoded)
            ids = encoded[:n]
            batches = [[ids[i] for i in b] for b in make_batches([len(x) for x in ids], bs)]
            log(f"decode beams={beams} batch={bs} n={n}: {', '.join(x.name for x in systems)}")
            cell, schedule = _run_cell(systems, batches, s, device, log)
            schedules.append(schedule)
            for sys_ in systems:
                times, outputs, peak, delta = cell[sys_.name]
                toks = sum(len(o) for o in outputs)
                med = _median(times)
                results.append(
                    RunResult(
                        mode="decode",
                        system=sys_.name,
                        backend=sys_.backend,
                        batch_size=bs,
                        num_beams=beams,
                        n=n,
                        seconds=[round(t, 4) for t in times],
                        median_s=med,
                        samples_per_s=n / med,
                        tokens_per_s=toks / med,
                        generated_tokens=toks,
                        peak_mem_mb=peak,
                        peak_mem_kind=("max allocated" if device.type == "cuda" else "rss")
                        if sys_.mem_kind != "n/a"
                        else "n/a",
                        run_mem_mb=delta,
                        notes=list(sys_.notes),
                        outputs=outputs,
                    )
                )
            if on_cell:
                on_cell(results, schedules, meta)
        del systems, gen
    return results, schedules, meta


def _ct2_system(s: BenchSettings, gen: Any, state: dict[str, Any], log: Callable[[str], None]) -> Ct2System:
    """The CTranslate2 system for this Generator's settings (conversion and model load happen once)."""
    ct2 = bench_ct2.require_ct2()
    device = gen.loaded.device
    dtype = str(gen.loaded.dtype).replace("torch.", "")
    ct2_device = "cuda" if device.type == "cuda" else "cpu"
    supported = ct2.get_supported_compute_types(ct2_device)
    if dtype not in supported:
        raise SeqgenError(
            f"CTranslate2 has no {dtype} on {ct2_device} (it has {', '.join(sorted(supported))})"
        )
    if "engine" not in state:
        start = time.perf_counter()
        path = bench_ct2.convert(s.model, Path(s.ct2_cache) if s.ct2_cache else None)
        log(f"ct2 model at {path} ({time.perf_counter() - start:.1f}s)")
        cls = ct2.Translator if gen.is_encoder_decoder else ct2.Generator
        kwargs: dict[str, Any] = {"device": ct2_device, "compute_type": dtype}
        if ct2_device == "cpu":
            kwargs["intra_threads"] = s.threads or torch.get_num_threads()
        elif device.index is not None:
            kwargs["device_index"] = device.index
        state.update(engine=cls(str(path), **kwargs), path=path, vocab=bench_ct2.vocabulary(path))
    plan = make_ct2_plan(gen, state["vocab"], bench_ct2.start_in_prefix(state["path"]))
    state["plan"] = plan
    return Ct2System(state["engine"], plan, gen.tokenizer, state["vocab"], gen.is_encoder_decoder)


def make_ct2_plan(gen: Any, vocab: list[str], start_in_prefix: bool = False) -> bench_ct2.Ct2Plan:
    """CTranslate2 options for a Generator's resolved settings."""
    seq2seq = gen.is_encoder_decoder
    return bench_ct2.plan(
        gen.config,
        gen.tokenizer,
        vocab,
        max_new=gen.max_new_tokens(),
        min_new=min_new_tokens(gen.config, seq2seq),
        causal=not seq2seq,
        start_token_in_prefix=start_in_prefix,
    )


def _run_cell(
    systems: list[System],
    batches: list[list[list[int]]],
    s: BenchSettings,
    device: torch.device,
    log: Callable[[str], None] = _log,
) -> tuple[dict[str, tuple[list[float], list[list[int]], float | None, float | None]], list[str]]:
    """Warm up, then run the systems interleaved ``repeats`` times; per system: times, outputs, peak."""
    by_name = {x.name: x for x in systems}
    prepared: dict[str, list[Any]] = {
        x.name: [x.tokens(b) for b in batches] if isinstance(x, Ct2System) else batches for x in systems
    }
    times: dict[str, list[float]] = {x.name: [] for x in systems}
    outputs: dict[str, list[list[int]]] = {}
    peaks: dict[str, float | None] = {x.name: None for x in systems}
    deltas: dict[str, float | None] = {x.name: None for x in systems}
    schedule: list[str] = []
    for name, rep in interleave([x.name for x in systems], s.repeats, s.warmup):
        system = by_name[name]
        # Warm-up: the first batch, at most WARMUP_ROWS inputs (same shapes' code paths, less time).
        work = [prepared[name][0][:WARMUP_ROWS]] if rep < 0 else prepared[name]
        call = system.run_tokens if isinstance(system, Ct2System) else system.run
        schedule.append(f"{name}:{'warmup' if rep < 0 else rep}")
        with peak_memory(device) as mem:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            outs = [call(b) for b in work]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
        if rep < 0:
            continue
        log(f"  {name} run {rep + 1}/{s.repeats}: {elapsed:.2f}s")
        times[name].append(elapsed)
        if system.mem_kind != "n/a":
            peaks[name] = max(peaks[name] or 0.0, mem["peak"])
            if "delta" in mem:
                deltas[name] = max(deltas[name] or 0.0, mem["delta"])
        if rep == 0:
            outputs[name] = [o for batch_out in outs for o in batch_out]
    return {k: (times[k], outputs.get(k, []), peaks[k], deltas[k]) for k in times}, schedule


# -- end-to-end mode ----------------------------------------------------------------------------------
def _cli_flags(flags: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in flags.items():
        if value is None:
            continue
        opt = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if key == "do_sample":
                args.append(opt if value else "--no-do-sample")
            elif key == "early_stopping":
                args += [opt, "true" if value else "false"]
            continue
        args += [opt, str(value)]
    return args


# Run through a small launcher: Linux carries a process's peak RSS across fork/exec, so a child forked
# straight from this (large) process would report at least this process's RSS as its own peak.
_LAUNCHER = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, st, ru = os.wait4(p.pid, 0); "
    "open(sys.argv[1], 'w').write(str(ru.ru_maxrss)); sys.exit(os.waitstatus_to_exitcode(st))"
)


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path) -> tuple[float, float, int]:
    """Run a command; (wall seconds, its own peak RSS in MiB, exit code)."""
    rss_file = log_path.with_suffix(".rss")
    with open(log_path, "w") as logf:
        start = time.perf_counter()
        rc = subprocess.call(
            [sys.executable, "-c", _LAUNCHER, str(rss_file), *cmd],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
        )
        elapsed = time.perf_counter() - start
    try:
        rss = int(rss_file.read_text()) / 1024
    except (OSError, ValueError):
        rss = float("nan")
    return elapsed, rss, rc


def bench_e2e(
    s: BenchSettings,
    texts: list[str],
    workdir: Path,
    log: Callable[[str], None] = _log,
    on_cell: OnCell | None = None,
) -> tuple[list[RunResult], list[list[str]], dict[str, Any]]:
    """Time whole processes, files to files: ``seqgen generate`` vs plain-transformers/CTranslate2 scripts."""
    from seqgen_cli.generator import Generator

    results: list[RunResult] = []
    schedules: list[list[str]] = []
    meta: dict[str, Any] = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    threads = s.threads or torch.get_num_threads()
    env.setdefault("OMP_NUM_THREADS", str(threads))
    want_ct2 = "ct2" in s.compare and bench_ct2.ct2_available() is None
    if "ct2" in s.compare and not want_ct2:
        meta["ct2_skipped"] = bench_ct2.ct2_available()
    ct2_path = None
    for beams in s.num_beams:
        flags = generation_flags(s, beams)
        # The settings every system gets, resolved once in this process exactly as `seqgen generate` will.
        gen = Generator(
            s.model, backend="auto", device=s.device, dtype=s.dtype, preset=s.preset, prefix=s.prefix,
            max_source_length=s.max_source_length, **flags,
        )  # fmt: skip
        dtype = str(gen.loaded.dtype).replace("torch.", "")
        device = str(gen.loaded.device)
        common = ["--max-source-length", str(gen.max_source_length)] if gen.max_source_length else []
        common += ["--prefix", gen.prefix] if gen.prefix else []
        hf_settings = json.dumps(gen.config.to_dict(), default=str)
        ct2_settings = None
        if want_ct2:
            try:
                ct2_path = ct2_path or bench_ct2.convert(s.model, Path(s.ct2_cache) if s.ct2_cache else None)
                p = make_ct2_plan(gen, bench_ct2.vocabulary(ct2_path), bench_ct2.start_in_prefix(ct2_path))
                ct2_settings = json.dumps({**asdict(p)})
            except SeqgenError as err:
                log(f"skipping ct2: {err}")
                meta["ct2_skipped"] = str(err)
                want_ct2 = False
        del gen
        for bs in s.batch_sizes:
            n = min(len(texts), s.max_batches * bs) if s.max_batches else len(texts)
            inp = workdir / f"input-{n}.txt"
            inp.write_text("".join(t + "\n" for t in texts[:n]), encoding="utf-8")
            outs = {name: workdir / f"{name}-b{beams}-bs{bs}.txt" for name in SYSTEMS}
            cmds: dict[str, list[str]] = {
                "seqgen": [
                    sys.executable, "-m", "seqgen_cli", "generate", "-m", s.model, str(inp),
                    "-o", str(outs["seqgen"]), "--batch-size", str(bs), "--device", device, "--dtype", dtype,
                    "-q", *(["--preset", s.preset] if s.preset else []), *common, *_cli_flags(flags),
                ],
            }  # fmt: skip
            base = [sys.executable, "-m", "seqgen_cli.bench_e2e"]
            io_args = ["--model", s.model, "--input", str(inp), "--batch-size", str(bs), *common]
            if "hf" in s.compare:
                cmds["hf"] = [
                    *base, "hf", *io_args, "--output", str(outs["hf"]), "--settings", hf_settings,
                    "--device", device, "--dtype", dtype, "--threads", str(threads),
                ]  # fmt: skip
            if want_ct2 and ct2_settings:
                cmds["ct2"] = [
                    *base, "ct2", *io_args, "--output", str(outs["ct2"]), "--settings", ct2_settings,
                    "--ct2-model", str(ct2_path), "--device", device, "--compute-type", dtype,
                    "--threads", str(threads),
                ]  # fmt: skip
            log(f"e2e beams={beams} batch={bs} n={n}: {', '.join(cmds)}")
            times: dict[str, list[float]] = {k: [] for k in cmds}
            peaks: dict[str, float] = {k: 0.0 for k in cmds}
            texts_out: dict[str, list[str]] = {}
            schedule: list[str] = []
            for name, rep in interleave(list(cmds), s.repeats, s.warmup):
                schedule.append(f"{name}:{'warmup' if rep < 0 else rep}")
                elapsed, rss, rc = _spawn(cmds[name], env, workdir / f"{name}.log")
                if rc != 0:
                    tail = (workdir / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
                    raise SeqgenError(f"bench e2e: {name} exited with {rc}: {' | '.join(tail)}")
                if rep < 0:
                    continue
                log(f"  {name} run {rep + 1}/{s.repeats}: {elapsed:.2f}s")
                times[name].append(elapsed)
                peaks[name] = max(peaks[name], rss)
                if rep == 0:
                    texts_out[name] = outs[name].read_text(encoding="utf-8").splitlines()
            schedules.append(schedule)
            for name in cmds:
                med = _median(times[name])
                r = RunResult(
                    mode="e2e",
                    system=name,
                    backend={
                        "seqgen": "seqgen generate",
                        "hf": "transformers script",
                        "ct2": "ctranslate2 script",
                    }[name],
                    batch_size=bs,
                    num_beams=beams,
                    n=n,
                    seconds=[round(t, 4) for t in times[name]],
                    median_s=med,
                    samples_per_s=n / med,
                    tokens_per_s=None,
                    generated_tokens=None,
                    peak_mem_mb=peaks[name],
                    peak_mem_kind="process max rss",
                    outputs=texts_out.get(name, []),
                )
                results.append(r)
            if on_cell:
                on_cell(results, schedules, meta)
    return results, schedules, meta


# -- figures, agreement, output ---------------------------------------------------------------------------
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
                if ref and len(ref) == len(mine):
                    r.agreement_vs_hf = 100.0 * sum(a == b for a, b in zip(mine, ref, strict=True)) / len(ref)
            if ct2 is not None:
                r.speedup_vs_ct2 = ct2.median_s / r.median_s


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def markdown_table(results: list[RunResult]) -> str:
    """One Markdown table per mode, rows by (beams, batch size, system)."""
    parts = []
    for mode in MODES:
        rows = [r for r in results if r.mode == mode]
        if not rows:
            continue
        title = (
            "decode-only (model loaded, inputs tokenised)"
            if mode == "decode"
            else "end-to-end (files to files, fresh process)"
        )
        parts.append(f"**{title}**\n")
        parts.append(
            "| beams | batch | system | backend | n | median s | samples/s | tokens/s | peak MiB | +run MiB | "
            "vs hf | vs ct2 | same as hf |\n|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        )
        for r in sorted(rows, key=lambda r: (r.num_beams, r.batch_size, SYSTEMS.index(r.system))):
            parts.append(
                f"| {r.num_beams} | {r.batch_size} | {r.system} | {r.backend} | {r.n} | {r.median_s:.2f} | "
                f"{r.samples_per_s:.2f} | {_fmt(r.tokens_per_s, '.0f')} | {_fmt(r.peak_mem_mb, '.0f')} | {_fmt(r.run_mem_mb, '.0f')} | "
                f"{_fmt(r.speedup_vs_hf, '.2f', '×')} | {_fmt(r.speedup_vs_ct2, '.2f', '×')} | "
                f"{_fmt(r.agreement_vs_hf, '.0f', ' %')} |"
            )
        parts.append("")
    return "\n".join(parts)


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
    fig, axes = plt.subplots(
        len(modes), len(beams), figsize=(4.5 * len(beams), 3.6 * len(modes)), squeeze=False
    )
    for i, mode in enumerate(modes):
        for j, b in enumerate(beams):
            ax = axes[i][j]
            for system in SYSTEMS:
                rows = sorted(
                    (r for r in results if r.mode == mode and r.num_beams == b and r.system == system),
                    key=lambda r: r.batch_size,
                )
                if rows:
                    label = (
                        f"seqgen ({rows[0].backend})" if system == "seqgen" and mode == "decode" else system
                    )
                    ax.plot(
                        [r.batch_size for r in rows], [r.samples_per_s for r in rows], marker="o", label=label
                    )
            sizes = sorted({r.batch_size for r in results})
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(x) for x in sizes])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(f"{mode}, beams={b}", fontsize=10)
            ax.set_xlabel("batch size")
            ax.set_ylabel("samples/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict[str, Any]:
    """Versions and machine facts for the JSON file."""
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


def run_bench(s: BenchSettings, command: str = "", log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run the benchmark and write ``bench.json``, ``bench.md`` and ``bench.png`` into ``s.out``."""
    for m in s.modes:
        if m not in MODES:
            raise SeqgenError(f"bench: unknown mode {m!r} (choose from {', '.join(MODES)})")
    unknown = [c for c in s.compare if c not in ("hf", "ct2")]
    if unknown:
        raise SeqgenError(f"bench: --compare takes hf and/or ct2, not {', '.join(unknown)}")
    if s.repeats < 1 or s.n < 1:
        raise SeqgenError("bench: --repeats and --n must be at least 1")
    if s.threads:
        torch.set_num_threads(s.threads)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = read_inputs(s.input, s.n)
    results: list[RunResult] = []
    schedules: list[list[str]] = []
    meta: dict[str, Any] = {}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_start = _loadavg()

    def save(
        more: list[RunResult], more_sched: list[list[str]], more_meta: dict[str, Any], partial: bool = True
    ) -> dict[str, Any]:
        """Write bench.json with everything measured so far (after every cell, so a stop keeps it)."""
        runs = results + more
        add_ratios(runs)
        report = {
            "command": command,
            "started": started,
            "partial": partial,
            "settings": asdict(s),
            "environment": environment(),
            "load_average": {"start": load_start, "end": _loadavg()},  # other work on the machine
            **{k: v for k, v in more_meta.items() if k not in meta},
            **meta,
            "schedules": schedules + more_sched,
            "runs": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in runs],
        }
        text = json.dumps(report, indent=2, default=str) + "\n"
        (out / "bench.json").write_text(text, encoding="utf-8")
        return report

    if "decode" in s.modes:
        r, sch, m = bench_decode(s, texts, log, on_cell=save)
        results += r
        schedules += sch
        meta.update(m)
    if "e2e" in s.modes:
        with tempfile.TemporaryDirectory(prefix="seqgen-bench-") as tmp:
            r, sch, m = bench_e2e(s, texts, Path(tmp), log, on_cell=save)
        results += r
        schedules += sch
        meta.update({k: v for k, v in m.items() if k not in meta})
    report = save([], [], {}, partial=False)
    table = markdown_table(results)
    header = f"Command: `{command}`\n\n" if command else ""
    (out / "bench.md").write_text(header + table + "\n", encoding="utf-8")
    title = f"{Path(s.model).name}: {meta.get('device', s.device)}, {meta.get('dtype', s.dtype)}"
    if s.fixed_new_tokens:
        title += f", {s.fixed_new_tokens} new tokens"
    if not plot(results, out / "bench.png", title):
        log("matplotlib is not installed: no plot (pip install matplotlib)")
    report["table"] = table
    return report


def rerender(json_path: str | Path) -> str:
    """Rewrite ``bench.md`` and ``bench.png`` next to a ``bench.json`` (e.g. after a plotting change)."""
    path = Path(json_path)
    report = json.loads(path.read_text(encoding="utf-8"))
    results = [RunResult(**r) for r in report["runs"]]
    table = markdown_table(results)
    command = report.get("command", "")
    (path.parent / "bench.md").write_text(
        (f"Command: `{command}`\n\n" if command else "") + table + "\n", encoding="utf-8"
    )
    s = report.get("settings", {})
    title = f"{Path(s.get('model', '')).name}: {report.get('device', '')}, {report.get('dtype', '')}"
    if s.get("fixed_new_tokens"):
        title += f", {s['fixed_new_tokens']} new tokens"
    plot(results, path.parent / "bench.png", title)
    return table
