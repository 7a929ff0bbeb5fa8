"""A/B an int8 start-up between checkouts: ``seqgen generate --dtype int8`` on a few lines and one new token,
fresh processes, checkouts interleaved in every round, each run from an empty temporary folder (``python -m``
puts the working directory before ``PYTHONPATH``). Reports per checkout the medians (min-max) over rounds of
``--stats`` ``startup`` (the ``int8 weights`` stage, the first batch since the process started) and the wall time,
and the outputs' hashes. ``--busy`` runs one busy process beside every run (ended by its id)::

    git worktree add --detach /work/base HEAD~1
    python scripts/harness/int8_startup_ab.py ~/.cache/seqgen-bench/marian-base \\
        ../shared/data/wmt/en-de/newstest2014.en /work/base /work/main --rounds 6 [--busy]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(checkout: str, model: str, lines: Path, work: Path) -> dict[str, float | str]:
    """One ``seqgen generate`` process of ``checkout``: its start-up figures, wall time and output hash."""
    out, stats = work / "out.txt", work / "stats.json"
    cmd = [sys.executable, "-m", "seqgen_cli", "generate", str(lines), "-m", model, "--dtype", "int8"]
    cmd += ["--max-new-tokens", "1", "-o", str(out), "--stats", str(stats), "-q"]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=work, check=True)
    wall = time.perf_counter() - start
    startup = json.loads(stats.read_text())["startup"]
    return {
        "int8 weights": startup["stages"]["int8 weights"],
        "first batch": startup["since_process_start"]["first batch"],
        "wall": wall,
        "hash": hashlib.md5(out.read_bytes()).hexdigest()[:10],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("sources")
    ap.add_argument("checkouts", nargs="+")
    ap.add_argument("--lines", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--busy", action="store_true", help="one busy process beside every run")
    args = ap.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    runs: dict[str, list[dict]] = {c: [] for c in args.checkouts}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            lines = Path(tmp) / "in.txt"
            text = Path(args.sources).read_text(encoding="utf-8").splitlines()[: args.lines]
            lines.write_text("\n".join(text) + "\n", encoding="utf-8")
            for r in range(args.rounds):
                for checkout in args.checkouts:
                    runs[checkout].append(one_run(checkout, args.model, lines, Path(tmp)))
                    print(f"round {r + 1} {checkout}: {runs[checkout][-1]}", file=sys.stderr)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    for checkout, rs in runs.items():
        parts = []
        for key in ("int8 weights", "first batch", "wall"):
            values = [x[key] for x in rs]
            parts.append(f"{key} {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"{checkout}: {', '.join(parts)} s; outputs {','.join(sorted({x['hash'] for x in rs}))}")


if __name__ == "__main__":
    main()
