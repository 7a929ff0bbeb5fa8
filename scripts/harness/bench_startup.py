"""Start-up: ``seqgen generate`` on one input with one new token against a bare transformers load (import,
``AutoTokenizer`` + ``AutoModelForSeq2SeqLM/CausalLM.from_pretrained``, nothing generated), each a fresh
process, interleaved, wall-clock medians and spread. The bar: seqgen within 1.1x of the bare load.
See docs/BENCHMARKS.md ("Start-up")::

    python scripts/harness/bench_startup.py ~/.cache/seqgen-bench/marian-base ../shared/data/wmt/en-de/newstest2014.en
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = """
import sys
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
path = sys.argv[1]
auto = AutoModelForSeq2SeqLM if AutoConfig.from_pretrained(path).is_encoder_decoder else AutoModelForCausalLM
AutoTokenizer.from_pretrained(path)
auto.from_pretrained(path).eval()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint folder")
    ap.add_argument("source", help="text file; its first line is the one input")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp, "one.txt")
        with open(args.source, encoding="utf-8") as f:
            one.write_text(f.readline(), encoding="utf-8")
        seqgen = [sys.executable, "-m", "seqgen_cli", "generate", "-m", args.model, str(one)]
        runs = {
            "bare transformers load": [sys.executable, "-c", BARE, args.model],
            "seqgen generate (1 input, 1 token)": [
                *seqgen,
                "-o",
                str(Path(tmp, "out.txt")),
                "--max-new-tokens",
                "1",
            ],
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, cmd in runs.items():
                start = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True)
                times[name].append(time.perf_counter() - start)
    bare = statistics.median(times["bare transformers load"])
    print("| process | median s | min-max s | vs bare load |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {min(ts):.2f}-{max(ts):.2f} | {med / bare:.2f}x |")


if __name__ == "__main__":
    main()
