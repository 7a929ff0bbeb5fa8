"""Time to the first output line and to the last, of whole ``seqgen generate`` processes, per checkout.

Each round runs every checkout once (``PYTHONPATH=<checkout>``, interleaved), reading stdout as it comes: the
seconds from the process start to its first output line and to its exit. Medians and spread over rounds::

    python scripts/bench_first_line.py MODEL INPUT --rounds 3 /work/base /work/main -- --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def one_run(checkout: str, model: str, src: str, flags: list[str]) -> tuple[float, float, int]:
    """(seconds to the first output line, seconds to exit, output lines)."""
    env = {**os.environ, "PYTHONPATH": checkout}
    cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", model, src, "-q", *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    first, lines = None, 0
    for _ in proc.stdout:
        lines += 1
        if first is None:
            first = time.perf_counter() - t0
    if proc.wait() != 0:
        raise SystemExit(f"{checkout}: seqgen exited {proc.returncode}")
    return first or 0.0, time.perf_counter() - t0, lines


def main() -> None:
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("input")
    ap.add_argument("checkouts", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    runs: dict[str, list[tuple[float, float, int]]] = {c: [] for c in args.checkouts}
    for _ in range(args.rounds):
        for c in args.checkouts:
            runs[c].append(one_run(c, args.model, args.input, flags))
    print("| checkout | first line, s (min-max) | whole run, s (min-max) | lines |")
    print("| --- | ---: | ---: | ---: |")
    for c, rs in runs.items():
        first, total = [r[0] for r in rs], [r[1] for r in rs]
        print(
            f"| {c} | {statistics.median(first):.1f} ({min(first):.1f}-{max(first):.1f}) | "
            f"{statistics.median(total):.1f} ({min(total):.1f}-{max(total):.1f}) | {rs[0][2]} |"
        )


if __name__ == "__main__":
    main()
