"""Self-attention cache strategies in isolation: 60 decode steps of cache write + attention + beam reorder.

bart-base decoder shape (6 layers, 12 heads x 64), batch 32 x beam 4, random beam reorders every step,
float32. Times only what differs between strategies (the cache's own work and its attention reads).

    PYTHONPATH=. python scripts/bench_kv_cache.py [--batch 32] [--steps 60] [--reps 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from seqgen_cli.models.kv_cache import KV_CACHES


def run(name: str, layers: int, b: int, r: int, h: int, d: int, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    n = b * r
    cache = KV_CACHES[name](layers, b, r, h, steps, d, torch.float32, torch.device("cpu"))
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(n, h, d, generator=g)
    per_step = []
    for t in range(steps):
        t0 = time.perf_counter()
        cache.begin(t)
        for layer in range(layers):
            cache.attend(layer, q, k, k, 0.125)
        if t < steps - 1:
            rows = (torch.arange(n) // r) * r + torch.randint(0, r, (n,), generator=g)
            cache.reorder(rows)
        per_step.append(time.perf_counter() - t0)
    return per_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    totals: dict[str, list[float]] = {name: [] for name in KV_CACHES}
    late: dict[str, list[float]] = {name: [] for name in KV_CACHES}
    with torch.inference_mode():
        for rep in range(args.reps):
            for name in KV_CACHES:
                steps = run(name, 6, args.batch, args.beams, 12, 64, args.steps, seed=rep)
                totals[name].append(sum(steps))
                late[name].append(statistics.median(steps[-10:]))
    for name in KV_CACHES:
        print(
            f"{name:10s} total {statistics.median(totals[name]):6.2f}s over {args.steps} steps "
            f"(runs {[round(x, 2) for x in totals[name]]}); last-10-steps median "
            f"{1e3 * statistics.median(late[name]):6.1f} ms/step"
        )


if __name__ == "__main__":
    main()
