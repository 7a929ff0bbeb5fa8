"""What identifying a checkpoint by content costs (``seqgen_cli/digests.py``): hashing its files with an empty
digest cache against a warm one, in process and as whole ``seqgen generate`` processes (one input, one new token;
the hashing runs in a thread while the model loads), interleaved, medians and spread. ``--loaded``: the same
beside one busy process. See docs/EXPERIMENTS.md ("Checkpoint digests")::

    python scripts/harness/bench_digests.py ~/.cache/seqgen-bench/bart-large-cnn ../shared/data/cnndm/summeval.source
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY = "while True: pass"


def in_process(model: str, cache: Path) -> float:
    """Seconds of ``folder_digests(model)`` in a fresh interpreter with ``cache`` as the digest cache."""
    code = (
        "import sys, time; from seqgen_cli.digests import folder_digests; t = time.perf_counter(); "
        "folder_digests(sys.argv[1]); print(time.perf_counter() - t)"
    )
    env = dict(os.environ, SEQGEN_CACHE=str(cache))
    out = subprocess.run(
        [sys.executable, "-c", code, model], check=True, capture_output=True, text=True, env=env
    )
    return float(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint folder")
    ap.add_argument("source", help="text file; its first line is the one input")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loaded", action="store_true", help="run one busy process beside")
    args = ap.parse_args()
    size = sum(p.stat().st_size for p in Path(args.model).iterdir() if p.is_file())
    busy = subprocess.Popen([sys.executable, "-c", BUSY]) if args.loaded else None
    times: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            one, out, warm = Path(tmp, "one.txt"), Path(tmp, "out.txt"), Path(tmp, "warm")
            with open(args.source, encoding="utf-8") as f:
                one.write_text(f.readline(), encoding="utf-8")
            in_process(args.model, warm)  # fills the warm cache (and the page cache)
            cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", args.model, str(one), "-o", str(out)]
            cmd += ["--max-new-tokens", "1", "-q"]
            for _ in range(args.rounds):
                for arm in ("empty", "warm"):
                    cache = warm if arm == "warm" else Path(tmp, "empty")
                    shutil.rmtree(Path(tmp, "empty"), ignore_errors=True)
                    times.setdefault(f"hash in process, digest cache {arm}", []).append(
                        in_process(args.model, cache)
                    )
                    shutil.rmtree(Path(tmp, "empty"), ignore_errors=True)
                    out.unlink(missing_ok=True)
                    t0 = time.perf_counter()
                    env = dict(os.environ, SEQGEN_CACHE=str(cache))
                    subprocess.run(cmd, check=True, capture_output=True, env=env)
                    times.setdefault(f"seqgen generate, digest cache {arm}", []).append(
                        time.perf_counter() - t0
                    )
                    print(
                        f"  {arm}: {times[f'seqgen generate, digest cache {arm}'][-1]:.2f} s", file=sys.stderr
                    )
    finally:
        if busy is not None:
            busy.kill()
    print(f"{args.model}: {size / 1e9:.2f} GB; {'beside one busy process' if args.loaded else 'quiet'}")
    print("| what | median s | min-max s |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f}-{max(ts):.2f} |")


if __name__ == "__main__":
    main()
