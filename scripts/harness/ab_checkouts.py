"""A/B the engine of two or more checkouts on one cell, interleaved, each run in a fresh process.

Each round runs every checkout once (``PYTHONPATH=<checkout>``): load the model, encode the first ``--n``
sources, one warm-up batch, then time every batch of ``--batch`` inputs (``--beams`` 4, ``--new-tokens`` forced
new tokens, no-repeat 3), cut from the sources sorted by length, or with ``--batcher`` as ``Generator.generate``
cuts them (its sort window and, where a checkout has them, width buckets). It reports, per checkout, the medians over rounds of the process CPU time (robust to a
busy machine when ``--threads 1``), wall time and minor page faults, and a hash of the outputs so that a change
that alters any token shows. Make the checkouts with ``git worktree add --detach DIR COMMIT``::

    python scripts/harness/ab_checkouts.py ~/.cache/seqgen-bench/marian-base ../shared/data/wmt/en-de/newstest2014.en \\
        --n 16 --batch 16 --rounds 3 --threads 1 /work/base /work/main
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RUN_ONE = """
import hashlib, json, resource, sys, time
import torch
from seqgen_cli.generator import Generator
model, src = sys.argv[1], sys.argv[2]
n, bs, new, threads, beams, batcher = map(int, sys.argv[3:9])
dtype = sys.argv[9]
torch.set_num_threads(threads)
texts = [line.strip() for line in open(src, encoding="utf-8") if line.strip()][:n]
gen = Generator(model, device="cpu", dtype=dtype, max_source_length=400, num_beams=beams, max_new_tokens=new,
                min_new_tokens=new, no_repeat_ngram_size=3)
ids = sorted((e.ids for e in gen.encode(texts)), key=len)
batches = [ids[i : i + bs] for i in range(0, len(ids), bs)]
gen.generate_ids(batches[0][:4])
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cpu, wall = time.process_time(), time.perf_counter()
out = gen.generate(texts, batch_size=bs) if batcher else [gen.generate_ids(b) for b in batches]
print(json.dumps({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                  "hash": hashlib.md5(repr(out).encode()).hexdigest()[:10]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("sources")
    ap.add_argument("checkouts", nargs="+")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--batcher", action="store_true", help="batches as Generator.generate cuts them")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or int8")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {c: [] for c in args.checkouts}
    for r in range(args.rounds):
        for checkout in args.checkouts:
            cmd = [sys.executable, "-c", RUN_ONE, args.model, args.sources]
            cmd += [str(x) for x in (args.n, args.batch, args.new_tokens, args.threads, args.beams)]
            cmd += [str(int(args.batcher)), args.dtype]
            path = os.path.abspath(
                checkout
            )  # also the working directory: `python -c` imports from there first
            env = {**os.environ, "PYTHONPATH": path}
            out = subprocess.run(cmd, env=env, cwd=path, capture_output=True, text=True, check=True).stdout
            runs[checkout].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1} {checkout}: {runs[checkout][-1]}", file=sys.stderr)
    for checkout, rs in runs.items():

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(x[key] for x in rs)

        cpu = [round(x["cpu"], 2) for x in rs]
        hashes = sorted({x["hash"] for x in rs})
        print(
            f"{checkout}: cpu median {med('cpu'):.2f} s {cpu}, wall median {med('wall'):.2f} s, "
            f"faults median {med('faults'):.0f}, outputs {','.join(hashes)}"
        )


if __name__ == "__main__":
    main()
