"""Time to the first output line, to line ``--line`` and to the last, of whole ``seqgen generate`` processes.

Each round runs every checkout once (``PYTHONPATH=<checkout>``, interleaved), reading stdout as it comes: the
seconds from the process start to its first output line, to line ``--line`` (100: every input before it done; the
first line alone is early whenever input 1 is short) and to its exit. Medians and spread over rounds. See
docs/EXPERIMENTS.md ("Time to the first lines")::

    python scripts/experiments/bench_first_line.py MODEL INPUT --rounds 3 /work/base /work/main -- --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def one_run(
    checkout: str, model: str, src: str, flags: list[str], nth: int
) -> tuple[float, float, float, int]:
    """(seconds to the first output line, to line ``nth``, to exit; output lines)."""
    env = {**os.environ, "PYTHONPATH": checkout}
    model, src = os.path.abspath(model), os.path.abspath(src)
    cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", model, src, "-q", *flags]
    t0 = time.perf_counter()
    # cwd: ``python -m`` puts the working directory first on sys.path, before PYTHONPATH
    proc = subprocess.Popen(cmd, env=env, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = at_nth = 0.0
    lines = 0
    for _ in proc.stdout:
        lines += 1
        if lines == 1:
            first = time.perf_counter() - t0
        if lines == nth:
            at_nth = time.perf_counter() - t0
    if proc.wait() != 0:
        raise SystemExit(f"{checkout}: seqgen exited {proc.returncode}")
    return first, at_nth, time.perf_counter() - t0, lines


def main() -> None:
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("input")
    ap.add_argument("checkouts", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--line", type=int, default=100, help="also time this output line (default 100)")
    args = ap.parse_args(argv)
    runs: dict[str, list[tuple[float, float, float, int]]] = {c: [] for c in args.checkouts}
    for _ in range(args.rounds):
        for c in args.checkouts:
            runs[c].append(one_run(c, args.model, args.input, flags, args.line))
    print(f"| checkout | first line, s | line {args.line}, s | whole run, s | lines |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for c, rs in runs.items():
        cells = []
        for k in range(3):
            xs = [r[k] for r in rs]
            cells.append(f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})")
        print(f"| {c} | {' | '.join(cells)} | {rs[0][3]} |")


if __name__ == "__main__":
    main()
