"""A large int8 weight (a big vocabulary's LM head) as one fbgemm product or as ``block_rows``-row blocks
(``linear_maps.BlockedInt8Linear``): packing it, and a product at 8 and 128 rows, the two interleaved, medians
(min-max), and whether the outputs are the same bits. From the repository root::

    python scripts/experiments/bench_int8_blocks.py --rows 256206 --cols 1024 --repeats 5 [--busy]

``--busy``: one ``python -c "while True: pass"`` beside the runs (started and killed by this script, by its pid).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from seqgen_cli.models.linear_maps import BlockedInt8Linear, block_rows, dynamic_linear, quantize_weight


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256206)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--busy", action="store_true")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    qweight = quantize_weight(torch.randn(args.rows, args.cols, generator=g) * 0.02)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])] if args.busy else []
    times: dict[str, list[float]] = {}
    try:
        whole, blocked = dynamic_linear(qweight, None), BlockedInt8Linear(qweight, None)
        inputs = {n: torch.randn(n, args.cols, generator=g) for n in (8, 128)}
        same = all(torch.equal(whole(x), blocked(x)) for x in inputs.values())
        for _ in range(args.repeats):
            for name, build in (("one", lambda: dynamic_linear(qweight, None)),
                                ("blocks", lambda: BlockedInt8Linear(qweight, None))):  # fmt: skip
                times.setdefault(f"pack, {name}", []).append(seconds(build))
            for n, x in inputs.items():
                for name, m in (("one", whole), ("blocks", blocked)):
                    times.setdefault(f"product {n} rows, {name}", []).append(seconds(lambda m=m, x=x: m(x)))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"`python scripts/experiments/bench_int8_blocks.py {' '.join(sys.argv[1:])}`  ")
    print(f"{args.rows} x {args.cols} int8, blocks of {block_rows(args.cols)} rows, {torch.get_num_threads()} threads, "
          f"{'beside a busy process' if busy else 'quiet'}; same bits: {same}\n")  # fmt: skip
    print("| what | seconds, median (min-max) |\n| --- | ---: |")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) |")


if __name__ == "__main__":
    main()
