"""Benchmark the fast encoder-decoder backends through seqgen's engine against transformers' ``generate()``.

Random weights at a real shape (config from ``shared/tokenizers``, optionally shrunk), real tokenizer and
sources, fixed output length (min_new_tokens = max_new_tokens), beam search with no-repeat n-grams.
Implementations run interleaved, ``--reps`` times each; medians are reported.

    python scripts/bench_encdec.py --shape bart-base --batch 32 --beams 4 --reps 2
    python scripts/bench_encdec.py --shape marian --batch 8 --beams 4 --impls generate fast
    python scripts/bench_encdec.py --batch 8 --impls fast fast-backptr fast-copy   # cache strategies

(run with PYTHONPATH=. from the repository root)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

from seqgen_cli.models import FAST_BACKENDS
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.search import Batch, generate, merge_generation_config

SHARED = Path("/work/shared")
SHAPES = {
    # name: (tokenizer/config dir, config overrides, sources)
    "bart-base": (
        "bart-large-cnn",
        dict(
            d_model=768,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=12,
            decoder_attention_heads=12,
            encoder_ffn_dim=3072,
            decoder_ffn_dim=3072,
        ),
        "data/cnndm/summeval.source",
    ),
    "bart-large-cnn": ("bart-large-cnn", {}, "data/cnndm/summeval.source"),
    "marian": ("opus-mt-tc-big-en-pt", {}, "data/wmt/en-de/newstest2014.en"),
}


def build(shape: str) -> tuple[torch.nn.Module, object, list[str]]:
    folder, overrides, sources = SHAPES[shape]
    cfg = AutoConfig.from_pretrained(SHARED / "tokenizers" / folder)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(cfg).eval()
    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / folder)
    lines = [line.strip() for line in (SHARED / sources).read_text().splitlines() if line.strip()]
    return model, tok, lines


def run(impl: str, model, batch: Batch, kwargs: dict) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        if impl == "generate":
            out = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs)
            seqs = [row[1:].tolist() for row in out]
        else:
            if impl == "generic":
                dec = GenericBackend(model)
            else:
                cache = impl.removeprefix("fast-") if impl.startswith("fast-") else "beam-mask"
                dec = FAST_BACKENDS[model.config.model_type](model, cache=cache)
            config = merge_generation_config(model.generation_config, **kwargs)
            seqs = [s[0] for s in generate(dec, batch, config).sequences]
    return time.perf_counter() - t0, seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="bart-base", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--src-len", type=int, default=400)
    ap.add_argument("--no-repeat", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--impls", nargs="+", default=["generate", "fast"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, lines = build(args.shape)
    enc = tok(
        lines[: args.batch], padding=True, truncation=True, max_length=args.src_len, return_tensors="pt"
    )
    batch = Batch(enc["input_ids"], enc["attention_mask"])
    kwargs = dict(
        num_beams=args.beams,
        do_sample=False,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        no_repeat_ngram_size=args.no_repeat,
    )
    times: dict[str, list[float]] = {impl: [] for impl in args.impls}
    outputs: dict[str, list[list[int]]] = {}
    run(args.impls[-1], model, Batch(batch.input_ids[:1], batch.attention_mask[:1]), kwargs)  # warm-up
    for _ in range(args.reps):
        for impl in args.impls:
            sec, seqs = run(impl, model, batch, kwargs)
            times[impl].append(sec)
            print(f"{impl}: {sec:.1f}s", file=sys.stderr, flush=True)
            outputs[impl] = seqs
    base = statistics.median(times[args.impls[0]])
    ref = outputs[args.impls[0]]
    for impl in args.impls:
        med = statistics.median(times[impl])
        same = sum(a == b for a, b in zip(outputs[impl], ref, strict=True))
        print(
            json.dumps(
                {
                    "shape": args.shape,
                    "batch": args.batch,
                    "beams": args.beams,
                    "src_tokens": int(batch.input_ids.shape[1]),
                    "impl": impl,
                    "median_s": round(med, 2),
                    "runs": [round(t, 2) for t in times[impl]],
                    "speedup_vs_" + args.impls[0]: round(base / med, 2),
                    "identical_to_first": f"{same}/{len(ref)}",
                }
            )
        )


if __name__ == "__main__":
    main()
