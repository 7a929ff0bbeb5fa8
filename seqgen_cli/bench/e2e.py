"""End-to-end mode: the whole process from input file to output file, each system a fresh subprocess
(``seqgen generate`` against the plain scripts in :mod:`.baselines`, given the settings the ``Generator``
resolved as JSON: a ``GenerationConfig`` or a CTranslate2 plan).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seqgen_cli.bench import ct2
from seqgen_cli.bench.cells import INT8_REFERENCE_NOTE, Entrant, Sample, dtype_name, run_mode
from seqgen_cli.errors import SeqgenError

if TYPE_CHECKING:
    from seqgen_cli.bench.cells import Cell, OnCell, RunOnce, RunResult
    from seqgen_cli.bench.settings import BenchSettings
    from seqgen_cli.generator import Generator

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
BACKENDS = {"seqgen": "seqgen generate", "hf": "transformers script", "ct2": "ctranslate2 script"}

# Run through a small launcher: Linux carries a process's peak RSS across fork/exec, so a child forked
# straight from this (large) process would report at least this process's RSS as its own peak.
_LAUNCHER = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, st, ru = os.wait4(p.pid, 0); "
    "open(sys.argv[1], 'w').write(str(ru.ru_maxrss)); sys.exit(os.waitstatus_to_exitcode(st))"
)


def bench_e2e(
    s: BenchSettings, texts: list[str], log: Callable[[str], None], on_cell: OnCell | None = None
) -> tuple[list[RunResult], list[list[str]], dict[str, Any]]:
    """Run every e2e cell (see :func:`~seqgen_cli.bench.cells.run_mode`) in a temporary folder."""
    import torch

    threads = str(s.threads or torch.get_num_threads())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", threads)

    def ct2_setup(gen: Generator) -> tuple[list[str], ct2.Ct2Plan]:
        """The ct2 script's own arguments: the plan as JSON and the converted model."""
        path = ct2.convert(s.model, Path(s.ct2_cache) if s.ct2_cache else None)
        plan = ct2.plan_for(gen, path)
        return ["--settings", json.dumps(asdict(plan)), "--ct2-model", str(path)], plan

    def cells(beams: int, gen: Generator, ct2_args: list[str] | None) -> Callable[[int, int], Cell]:
        dtype, device = dtype_name(gen), str(gen.loaded.device)
        common = ["--max-source-length", str(gen.max_source_length)] if gen.max_source_length else []
        # Each system's command but the input, output and batch size. seqgen resolves its prefix (the preset's,
        # --prefix, an OPUS-MT >>code<< token) and target language itself; the scripts get them resolved.
        seqgen = [sys.executable, "-m", "seqgen_cli", "generate", "--device", device, "--dtype", dtype, "-q"]
        seqgen += [*(["--preset", s.preset] if s.preset else []), *cli_flags(s.generation_flags(beams))]
        seqgen += ["--backend", s.backend, *(["--prefix", s.prefix] if s.prefix is not None else [])]
        seqgen += [*(["--target-lang", s.target_lang] if s.target_lang else []), *(["--seed", str(s.seed)] if s.seed is not None else [])]
        heads = {"seqgen": seqgen}
        script = [sys.executable, "-m", "seqgen_cli.bench.baselines"]
        script_opts = ["--device", device, "--threads", threads, *(["--prefix", gen.prefix] if gen.prefix else [])]
        if "hf" in s.compare:
            hf_settings = json.dumps(gen.config.to_dict(), default=str)
            hf_dtype = "float32" if dtype == "int8" else dtype  # int8: float32 is the agreement reference
            heads["hf"] = [*script, "hf", *script_opts, "--dtype", hf_dtype, "--settings", hf_settings]
        if ct2_args:
            heads["ct2"] = [*script, "ct2", *script_opts, "--compute-type", dtype, *ct2_args]

        def cell(bs: int, n: int) -> Cell:
            inp = workdir / f"input-{n}.txt"
            inp.write_text("".join(t + "\n" for t in texts[:n]), encoding="utf-8")
            entrants = {}
            for name, head in heads.items():
                out = workdir / f"{name}-b{beams}-bs{bs}.txt"
                io = [str(inp)] if name == "seqgen" else ["--input", str(inp)]
                cmd = [*head, *io, "--model", s.model, "--output", str(out), "--batch-size", str(bs), *common]
                label, notes = BACKENDS[name], []
                if dtype == "int8":  # hf: the float32 reference
                    label += " float32" if name == "hf" else " int8"
                    notes = [INT8_REFERENCE_NOTE] if name == "hf" else []
                entrants[name] = Entrant(
                    _run_once(name, cmd, out, env, workdir), label, "process max rss", notes
                )
            return entrants

        return cell

    with tempfile.TemporaryDirectory(prefix="seqgen-bench-") as tmp:
        workdir = Path(tmp)
        return run_mode("e2e", s, texts, log, on_cell, ct2_setup, cells)


def cli_flags(flags: dict[str, Any]) -> list[str]:
    """Generation settings as ``seqgen generate`` flags."""
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


def _run_once(name: str, cmd: list[str], output: Path, env: dict[str, str], workdir: Path) -> RunOnce:
    """One system's whole process (the warm-up runs it all too), through the launcher: wall time, the
    process's own peak RSS (MiB) and (timed runs) the output file's lines."""
    log_path, rss_file = workdir / f"{name}.log", workdir / f"{name}.rss"

    def run_once(warmup: bool) -> Sample:
        with open(log_path, "w") as logf:
            start = time.perf_counter()
            launch = [sys.executable, "-c", _LAUNCHER, str(rss_file), *cmd]
            rc = subprocess.call(launch, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
            elapsed = time.perf_counter() - start
        if rc != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise SeqgenError(f"bench e2e: {name} exited with {rc}: {' | '.join(tail)}")
        lines = [] if warmup else output.read_text(encoding="utf-8").splitlines()
        return Sample(elapsed, lines, peak_mb=int(rss_file.read_text()) / 1024)  # launcher: ru_maxrss in KiB

    return run_once
