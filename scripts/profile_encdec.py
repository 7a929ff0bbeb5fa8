"""Profile the fast enc-dec path: start() vs bare decoder steps vs engine total, and torch.profiler of 10 steps.

PYTHONPATH=. python scripts/profile_encdec.py bart-base 32
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).parent))
from bench_encdec import build  # noqa: E402

from seqgen_cli.models import FAST_DECODERS  # noqa: E402
from seqgen_cli.search import Batch, generate, merge_generation_config  # noqa: E402


def main() -> None:
    shape, bsz, r = sys.argv[1], int(sys.argv[2]), 4
    torch.set_num_threads(2)
    model, tok, lines = build(shape)
    enc = tok(lines[:bsz], padding=True, truncation=True, max_length=400, return_tensors="pt")
    batch = Batch(enc["input_ids"], enc["attention_mask"])
    dec = FAST_DECODERS[model.config.model_type](model)
    kw = dict(num_beams=r, do_sample=False, max_new_tokens=60, min_new_tokens=60, no_repeat_ngram_size=3)
    cfg = merge_generation_config(model.generation_config, **kw)
    with torch.inference_mode():
        generate(dec, Batch(batch.input_ids[:1], batch.attention_mask[:1]), cfg)  # warm-up
        t0 = time.perf_counter()
        state, _ = dec.start(batch, r, 60)
        t1 = time.perf_counter()
        tokens = torch.full((bsz * r,), 2)
        rows = (torch.arange(bsz * r) // r) * r
        for _ in range(60):
            dec.step(state, tokens)
            dec.reorder(state, rows)
        t2 = time.perf_counter()
        generate(dec, batch, cfg)
        t3 = time.perf_counter()
        print(
            f"{shape} {bsz}x{r}: start {t1 - t0:.2f}s, 60 bare steps {t2 - t1:.2f}s, engine total {t3 - t2:.2f}s"
        )
        state, _ = dec.start(batch, r, 60)
        with profile() as prof:
            for _ in range(10):
                dec.step(state, tokens)
                dec.reorder(state, rows)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
