"""What a batch whose shape has not paid for compiling costs, on the CPU (eager steps, inductor not involved).

Three arms in one process, models loaded and warmed up, interleaved: ``plain`` (the fast backend, as
``--no-capture`` runs it), ``unpaid`` (``CapturedBackend`` under the amortized default with a compile cost no run
reaches: every batch routed to the plain backend) and ``kept`` (every batch on a kept state, padded to a power of two,
finished inputs idle until a halving, the span bucket attended, the static search; decode and search "compiled" by an
identity, i.e. eager): what an unpaid batch would cost if it ran on capture's static state. ``--loaded``: the same
beside one busy loop. See docs/EXPERIMENTS.md ("Unpaid batches"). From the repository root::

    python scripts/experiments/bench_unpaid.py ~/.cache/seqgen-bench/bart-base-eos90 ../shared/data/cnndm/summeval.source \\
        --preset cnndm-bart --max-source-length 128 --n 48 --batch 16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))  # _common and bench_load live there

from _common import interleaved, print_medians  # noqa: E402
from bench_load import hogs, stop  # noqa: E402


def main() -> None:
    from seqgen_cli.generator import Generator
    from seqgen_cli.models import amortized, capture

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("source")
    ap.add_argument("--preset")
    ap.add_argument("--max-source-length", type=int)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loaded", action="store_true", help="one busy loop beside the runs")
    args = ap.parse_args()
    torch.set_num_threads(2)
    texts = [line.strip() for line in open(args.source, encoding="utf-8") if line.strip()][: args.n]
    settings = {"num_beams": args.beams, "preset": args.preset, "max_source_length": args.max_source_length}
    same = lambda fn: fn  # noqa: E731 - a "compiler" that keeps the step eager
    gens = {name: Generator(args.model, device="cpu", **settings) for name in ("plain", "unpaid", "kept")}
    gens["unpaid"]._model_backend = capture.CapturedBackend(
        gens["unpaid"]._engine(),
        same,
        search_compiler=same,
        amortized=amortized.Amortized(compile_seconds=1e12),
    )
    gens["kept"]._model_backend = capture.CapturedBackend(gens["kept"]._engine(), same, search_compiler=same)
    for gen in gens.values():
        gen.generate(texts[: args.batch], batch_size=args.batch)  # warm-up
    busy = hogs(1) if args.loaded else []
    try:
        arms = {
            name: (lambda gen=gen: gen.generate(texts, batch_size=args.batch)) for name, gen in gens.items()
        }
        times, results = interleaved(arms, args.repeats)
    finally:
        stop(busy)
    print(
        f"`python scripts/experiments/bench_unpaid.py {' '.join(sys.argv[1:])}`, 1-min load {os.getloadavg()[0]:.2f} after"
    )
    print_medians(times, {name: runs[-1] for name, runs in results.items()})


if __name__ == "__main__":
    main()
