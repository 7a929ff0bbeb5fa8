"""int8 linear maps on the CPU: seqgen's (fbgemm dynamic quantization, one activation scale per tensor: a row's
output depends on the other rows of its batch) against per-row symmetric activation quantization over
``torch._int_mm`` (int8 x int8 -> int32; a row's output is its own), per decoder shape and row count, interleaved,
medians in ms; and whether a row's output is the same alone and in the batch. See docs/EXPERIMENTS.md
("CPU int8: per-row scales and torchao")::

    python scripts/experiments/bench_int8_rows.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from seqgen_cli.models.linear_maps import int8_linear

SHAPES = [
    (1536, 512),
    (2048, 512),
    (512, 2048),
    (2304, 768),
    (3072, 768),
    (768, 3072),
]  # (out, in): Marian, BART


class PerRow:
    """``x @ w.T + b`` with w per output channel and x per row symmetric int8, accumulated in int32."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
        self.scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
        self.wq_t = (
            (w / self.scale[:, None]).round().clamp(-127, 127).to(torch.int8).t().contiguous()
        )  # [in, out]
        self.b = b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sx = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127  # [rows, 1]
        xq = (x / sx).round().clamp(-127, 127).to(torch.int8)
        return torch._int_mm(xq, self.wq_t).float() * sx * self.scale + self.b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="32,128")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"| out x in | {' | '.join(f'{n} rows: per tensor / per row ms' for n in rows)} | alone = in batch |"
    )
    print(f"|---|{'---|' * len(rows)}---|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for out_f, in_f in SHAPES:
            w, b = torch.randn(out_f, in_f), torch.randn(out_f)
            per_tensor, per_row = int8_linear(w, b), PerRow(w, b)
            cells = []
            for n in rows:
                x = torch.randn(n, in_f)
                times: dict[str, list[float]] = {"tensor": [], "row": []}
                for _ in range(30):
                    for name, fn in (("tensor", per_tensor), ("row", per_row)):
                        start = time.perf_counter()
                        fn(x)
                        times[name].append(time.perf_counter() - start)
                cells.append(" / ".join(f"{statistics.median(times[k]) * 1e3:.3f}" for k in times))
            x = torch.randn(max(rows), in_f)
            same = [
                torch.equal(f(x)[:17], f(x[:17])) for f in (per_tensor, per_row)
            ]  # 17: not a multiple of 8
            print(f"| {out_f} x {in_f} | {' | '.join(cells)} | per tensor {same[0]}, per row {same[1]} |")


if __name__ == "__main__":
    main()
