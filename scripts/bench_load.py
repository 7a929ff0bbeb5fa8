"""Load collapse (issue 24, part 8): whole ``seqgen generate`` processes, and CTranslate2's plain script, on a
quiet box and with one competing CPU-bound process per core (``python -c "while True: pass"``, started and
killed by this script), each arm interleaved with the others, medians and spread, ratio loaded / quiet.

Arms: seqgen as shipped (no variable set), and seqgen under OpenMP settings that seqgen leaves alone where
the user set them: ``GOMP_SPINCOUNT=300000`` (libgomp's own default when ``OMP_WAIT_POLICY`` is unset: what
torch ran before seqgen set anything), ``OMP_WAIT_POLICY=PASSIVE``, ``OMP_NUM_THREADS=1``; CTranslate2 with
its defaults. From the repository root (``scripts/make_bench_models.py marian-base`` builds the model)::

    python scripts/bench_load.py ~/.cache/seqgen-bench/marian-base ../shared/data/wmt/en-de/newstest2014.en

The box's load average is logged beside every run (stderr) and summarised in the table: on a shared box the
"quiet" column is not quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# seqgen's arms: environment settings, "VAR=VALUE[,VAR=VALUE]"; "-" runs seqgen with none of OMP_VARS set.
ARMS = ["-", "GOMP_SPINCOUNT=300000", "OMP_WAIT_POLICY=PASSIVE", "OMP_NUM_THREADS=1"]
OMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")


def hogs(n: int) -> list[subprocess.Popen]:
    """``n`` CPU-bound processes (one busy loop each)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def load_avg() -> float:
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint folder")
    ap.add_argument("source", help="text file, one input per line")
    ap.add_argument("--n", type=int, default=32, help="inputs (the first N lines)")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48, help="exactly this many (min = max)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", nargs="*", default=ARMS, help="seqgen's: VAR=VALUE[,VAR=VALUE], - for none")
    ap.add_argument("--no-ct2", action="store_true", help="leave CTranslate2 out")
    ap.add_argument("--hogs", type=int, default=len(os.sched_getaffinity(0)), help="default: one per core")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    flags = ["--num-beams", str(args.beams), "--max-new-tokens", str(args.new_tokens)]
    flags += ["--min-new-tokens", str(args.new_tokens)]
    with tempfile.TemporaryDirectory(prefix="seqgen-load-") as tmp:
        src = Path(tmp, "in.txt")
        with open(args.source, encoding="utf-8") as f:
            src.write_text("".join(next(f) for _ in range(args.n)), encoding="utf-8")
        cmds: dict[str, tuple[list[str], dict[str, str], Path]] = {}
        for arm in args.arms:
            out = Path(tmp, f"out{len(cmds)}.txt")
            seqgen = [sys.executable, "-m", "seqgen_cli", "generate", "-m", args.model, str(src), "-q"]
            settings = dict(kv.split("=", 1) for kv in arm.split(",") if arm != "-")
            name = "seqgen" if arm == "-" else f"seqgen {arm}"
            cmds[name] = ([*seqgen, "-o", str(out), *flags], dict(env, **settings), out)
        if not args.no_ct2:
            cmds["ctranslate2 (its defaults)"] = ct2_command(args, src, Path(tmp, "ct2.txt"), env)
        times: dict[tuple[str, str], list[float]] = {(n, s): [] for n in cmds for s in ("quiet", "loaded")}
        loads: dict[str, list[float]] = {"quiet": [], "loaded": []}
        outputs: dict[str, list[str]] = {}
        names = list(cmds)
        for r in range(args.rounds):
            for state in ("quiet", "loaded") if r % 2 == 0 else ("loaded", "quiet"):
                busy = hogs(args.hogs) if state == "loaded" else []
                try:
                    time.sleep(1.0 if busy else 0.0)
                    for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated per round
                        cmd, run_env, out = cmds[name]
                        loads[state].append(load_avg())
                        start = time.perf_counter()
                        subprocess.run(cmd, env=run_env, check=True, capture_output=True)
                        elapsed = time.perf_counter() - start
                        times[(name, state)].append(elapsed)
                        outputs.setdefault(name, out.read_text(encoding="utf-8").splitlines())
                        print(
                            f"round {r + 1} {state}: {name}: {elapsed:.2f} s (load average {loads[state][-1]:.2f})",
                            file=sys.stderr,
                            flush=True,
                        )
                finally:
                    stop(busy)
    print_table(times, loads, outputs, args)


def ct2_command(
    args: argparse.Namespace, src: Path, out: Path, env: dict[str, str]
) -> tuple[list[str], dict[str, str], Path]:
    """CTranslate2's plain script (``seqgen_cli.bench.baselines ct2``) with the settings seqgen resolves."""
    from seqgen_cli.bench import ct2
    from seqgen_cli.generator import Generator

    gen = Generator(
        args.model, device="cpu", num_beams=args.beams, max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
    )  # fmt: skip
    path = ct2.convert(args.model)
    plan = json.dumps(asdict(ct2.plan_for(gen, path)))
    cmd = [sys.executable, "-m", "seqgen_cli.bench.baselines", "ct2", "--model", args.model]
    cmd += ["--ct2-model", str(path), "--input", str(src), "--output", str(out), "--settings", plan]
    cmd += ["--batch-size", "32"]
    if gen.max_source_length:
        cmd += ["--max-source-length", str(gen.max_source_length)]
    return cmd, env, out


def print_table(
    times: dict[tuple[str, str], list[float]],
    loads: dict[str, list[float]],
    outputs: dict[str, list[str]],
    args: argparse.Namespace,
) -> None:
    names = list(dict.fromkeys(n for n, _ in times))
    first = outputs[names[0]]
    print(f"`python scripts/bench_load.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`  ")
    print(
        f"{args.n} inputs, beam {args.beams}, {args.new_tokens} new tokens, {args.rounds} rounds, "
        f"{args.hogs} competing busy loop(s) when loaded, {len(os.sched_getaffinity(0))} cores; "
        f"load average (1 min) at the runs: quiet {min(loads['quiet']):.1f}-{max(loads['quiet']):.1f}, "
        f"loaded {min(loads['loaded']):.1f}-{max(loads['loaded']):.1f}\n"
    )
    print(
        "| system | quiet median s (min-max) | loaded median s (min-max) | loaded / quiet | outputs = seqgen |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in names:
        quiet, loaded = times[(name, "quiet")], times[(name, "loaded")]
        same = (
            "-"
            if name.startswith("ctranslate2")
            else f"{sum(a == b for a, b in zip(first, outputs[name], strict=True))}/{len(first)}"
        )
        print(
            f"| {name} | {statistics.median(quiet):.2f} ({min(quiet):.2f}-{max(quiet):.2f}) "
            f"| {statistics.median(loaded):.2f} ({min(loaded):.2f}-{max(loaded):.2f}) "
            f"| {statistics.median(loaded) / statistics.median(quiet):.2f} | {same} |"
        )


if __name__ == "__main__":
    main()
