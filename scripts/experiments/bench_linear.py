"""Float32 linear layers on the CPU: MKL's GEMM (``F.linear``) against oneDNN's matmul on the dense weight
(``models/linear_maps.dense``) and on a weight packed once into oneDNN's layout (``models/linear_maps.PackedLinear``,
what the fast backends use), per shape and row count, interleaved, medians in ms.

The shapes are marian-base's and bart-base's decoder linears and LM heads; 32 and 128 rows are a decode step
at 8 x 4 and 32 x 4, 3200 and 12336 rows encoder-sized products (32 CNN/DM sources of ~400 tokens: 12336). See docs/EXPERIMENTS.md ("CPU float32: weights packed
for oneDNN")::

    python scripts/experiments/bench_linear.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from seqgen_cli.models.linear_maps import PACK_AFTER, PackedLinear

SHAPES = [  # (out, in)
    (1536, 512),
    (512, 512),
    (2048, 512),
    (512, 2048),
    (54776, 512),
    (2304, 768),
    (768, 768),
    (3072, 768),
    (768, 3072),
    (50265, 768),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="8,32,64,128,3200")
    ap.add_argument("--no-heads", action="store_true", help="leave out the LM heads (for encoder-sized rows)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"| out x in | {' | '.join(f'{n} rows: MKL / oneDNN / packed ms' for n in rows)} |")
    print(f"|---|{'---|' * len(rows)}")
    with torch.inference_mode():
        for out_f, in_f in SHAPES:
            if args.no_heads and out_f > 10000:
                continue
            w, b = torch.randn(out_f, in_f), torch.randn(out_f)
            packed_linear = PackedLinear(w, b)
            for _ in range(PACK_AFTER + 1):  # packed before it is timed
                packed_linear(torch.randn(2, in_f))
            cells = []
            for n in rows:
                x = torch.randn(n, in_f)
                runs = {
                    "mkl": lambda x=x, w=w, b=b: F.linear(x, w, b),
                    "onednn": lambda x=x, w=w, b=b: torch.ops.mkldnn._linear_pointwise(
                        x, w, b, "none", [], ""
                    ),
                    "packed": lambda x=x, p=packed_linear: p(x),
                }
                times: dict[str, list[float]] = {k: [] for k in runs}
                for _ in range(5 if n * out_f > 10**8 else 30):
                    for name, fn in runs.items():
                        start = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - start)
                mkl, onednn, packed = (statistics.median(times[k]) * 1e3 for k in runs)
                cells.append(f"{mkl:.2f} / {onednn:.2f} / {packed:.2f}")
            print(f"| {out_f} x {in_f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
