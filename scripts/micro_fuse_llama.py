"""Micro-benchmark: is fusing Llama's q/k/v (and gate/up) projections worth a fused weight? One decode step.

Shape: a Llama-1B-like layer (D=2048, 32 q heads / 8 KV heads of 64, FFN 5632), N=32 rows (8 inputs x 4 beams).

    python scripts/micro_fuse_llama.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(f, n: int) -> str:
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return f"{min(ts) * 1e3:.2f} / {statistics.median(ts) * 1e3:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    N, D, KV, FF = 32, 2048, 512, 5632
    wq, wk, wv = torch.randn(D, D), torch.randn(KV, D), torch.randn(KV, D)
    wg, wu = torch.randn(FF, D), torch.randn(FF, D)
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    x = torch.randn(N, D)
    print(f"min / median of {a.reps}, threads {a.threads}")
    print("q/k/v separate  ", timed(lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)), a.reps))
    print("q/k/v fused     ", timed(lambda: F.linear(x, wqkv).split([D, KV, KV], -1), a.reps))
    print("gate/up separate", timed(lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu), a.reps))
    print(
        "gate/up fused   ",
        timed(lambda: (lambda gu: F.silu(gu[:, :FF]) * gu[:, FF:])(F.linear(x, wgu)), a.reps),
    )


if __name__ == "__main__":
    main()
