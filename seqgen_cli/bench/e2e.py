"""End-to-end mode: the whole process from input file to output file, each system a fresh subprocess
(``python -m seqgen_cli generate`` against the plain scripts in ``seqgen_cli.bench.baselines``).

The settings every system gets are resolved once here, by a ``Generator`` exactly as ``seqgen generate``
resolves them, and handed to the baselines as JSON (a ``GenerationConfig`` or a CTranslate2 plan).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seqgen_cli.bench import ct2
from seqgen_cli.bench.cells import SYSTEMS, OnCell, RunOnce, RunResult, Sample, run_cell, run_result
from seqgen_cli.errors import SeqgenError

if TYPE_CHECKING:
    from seqgen_cli.bench import BenchSettings

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
BACKENDS = {"seqgen": "seqgen generate", "hf": "transformers script", "ct2": "ctranslate2 script"}

# Run through a small launcher: Linux carries a process's peak RSS across fork/exec, so a child forked
# straight from this (large) process would report at least this process's RSS as its own peak.
_LAUNCHER = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, st, ru = os.wait4(p.pid, 0); "
    "open(sys.argv[1], 'w').write(str(ru.ru_maxrss)); sys.exit(os.waitstatus_to_exitcode(st))"
)


def bench_e2e(
    s: BenchSettings,
    texts: list[str],
    workdir: Path,
    log: Callable[[str], None],
    on_cell: OnCell | None = None,
) -> tuple[list[RunResult], list[list[str]], dict[str, Any]]:
    """Time whole processes, files to files: ``seqgen generate`` vs plain-transformers/CTranslate2 scripts."""
    import torch

    from seqgen_cli.generator import Generator

    results: list[RunResult] = []
    schedules: list[list[str]] = []
    meta: dict[str, Any] = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    threads = s.threads or torch.get_num_threads()
    env.setdefault("OMP_NUM_THREADS", str(threads))
    want_ct2 = "ct2" in s.compare and ct2.ct2_available() is None
    if "ct2" in s.compare and not want_ct2:
        meta["ct2_skipped"] = ct2.ct2_available()
    ct2_path = None
    for beams in s.num_beams:
        flags = s.generation_flags(beams)
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
                ct2_path = ct2_path or ct2.convert(s.model, Path(s.ct2_cache) if s.ct2_cache else None)
                ct2_settings = json.dumps(asdict(ct2.plan_for(gen, ct2_path)))
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
                    "-q", *(["--preset", s.preset] if s.preset else []), *common, *cli_flags(flags),
                ],
            }  # fmt: skip
            base = [sys.executable, "-m", "seqgen_cli.bench.baselines"]
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
            cell, schedule = run_cell(
                {name: _run_once(name, cmd, outs[name], env, workdir) for name, cmd in cmds.items()},
                s.repeats,
                s.warmup,
                log,
            )
            schedules.append(schedule)
            for name in cmds:
                results.append(
                    run_result(
                        cell[name],
                        mode="e2e",
                        system=name,
                        backend=BACKENDS[name],
                        batch_size=bs,
                        num_beams=beams,
                        n=n,
                        peak_mem_kind="process max rss",
                        count_tokens=False,
                    )
                )
            if on_cell:
                on_cell(results, schedules, meta)
    return results, schedules, meta


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
    """One system's whole process (the warm-up runs it all too); outputs are the output file's lines."""
    log_path = workdir / f"{name}.log"

    def run_once(warmup: bool) -> Sample:
        elapsed, rss, rc = spawn(cmd, env, log_path)
        if rc != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise SeqgenError(f"bench e2e: {name} exited with {rc}: {' | '.join(tail)}")
        lines = [] if warmup else output.read_text(encoding="utf-8").splitlines()
        return Sample(elapsed, lines, peak_mb=rss)

    return run_once


def spawn(cmd: list[str], env: dict[str, str], log_path: Path) -> tuple[float, float, int]:
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
