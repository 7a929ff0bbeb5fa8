"""Profile the fast encoder-decoder path: ``start()`` vs bare backend steps vs the engine's total, then a
torch.profiler table of 10 steps.

Same models and inputs as ``bench_encdec.py`` (beam 4, sources cut to 400 tokens, 60 new tokens with
no-repeat 3-grams, 2 threads). See docs/BENCHMARKS.md ("Where the time goes"). From the repository root,
with the package installed (``pip install -e .``):

    python scripts/profile_encdec.py --shape bart-base --batch 32
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import ENCDEC_SHAPES, encdec_inputs
from torch.profiler import profile

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import FAST_BACKENDS
from seqgen_cli.search import Batch, generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="bart-base", choices=list(ENCDEC_SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    bsz, r, new = args.batch, 4, 60
    torch.set_num_threads(2)
    model, batch = encdec_inputs(args.shape, bsz)
    backend = FAST_BACKENDS[model.config.model_type](model)
    kw = dict(num_beams=r, do_sample=False, max_new_tokens=new, min_new_tokens=new, no_repeat_ngram_size=3)
    cfg = resolve_generation_config(model.generation_config, None, kw)
    tokens = torch.full((bsz * r,), 2)  # [N]
    rows = (torch.arange(bsz * r) // r) * r  # [N]: every row continues its input's beam 0
    with torch.inference_mode():
        generate(backend, Batch(batch.input_ids[:1], batch.attention_mask[:1]), cfg)  # warm-up
        t0 = time.perf_counter()
        state, _ = backend.start(batch, r, new)
        t1 = time.perf_counter()
        for _ in range(new):
            backend.step(state, tokens)
            backend.reorder(state, rows)
        t2 = time.perf_counter()
        generate(backend, batch, cfg)
        t3 = time.perf_counter()
        print(
            f"{args.shape} {bsz}x{r}: start {t1 - t0:.2f}s, {new} bare steps {t2 - t1:.2f}s, "
            f"engine total {t3 - t2:.2f}s"
        )
        state, _ = backend.start(batch, r, new)
        with profile() as prof:
            for _ in range(10):
                backend.step(state, tokens)
                backend.reorder(state, rows)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
