"""Benchmark the fast encoder-decoder backends through seqgen's engine against transformers' ``generate()``.

Measures the wall time of whole calls (beam search with no-repeat n-grams, exactly ``--new-tokens`` new
tokens), the arms interleaved after an untimed warm-up, medians reported, and whether the top beams are
token-identical to the first arm's. Random weights at a real shape (config and tokenizer from
``shared/tokenizers``, optionally shrunk), real sources. See docs/BENCHMARKS.md ("Fast encoder-decoder
decoders"). From the repository root, with the package installed (``pip install -e .``):

    python scripts/bench_encdec.py --shape bart-base --batch 32 --beams 4 --reps 2
    python scripts/bench_encdec.py --shape marian --batch 8 --beams 4 --impls generate fast
"""

from __future__ import annotations

import argparse

import torch
from _common import ENCDEC_SHAPES, encdec_inputs, interleaved, print_medians, timing_args

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import FAST_BACKENDS
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.search import Batch, generate

IMPLS = ("generate", "generic", "fast")


def run(impl: str, model, batch: Batch, kwargs: dict) -> list[list[int]]:
    """One call of ``impl``: the top sequence per input."""
    with torch.inference_mode():
        if impl == "generate":
            out = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs)
            return [row[1:].tolist() for row in out]
        backend = (
            GenericBackend(model) if impl == "generic" else FAST_BACKENDS[model.config.model_type](model)
        )
        config = resolve_generation_config(model.generation_config, None, kwargs)
        return [s[0] for s in generate(backend, batch, config).sequences]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    timing_args(ap, reps=3, threads=2)
    ap.add_argument("--shape", default="bart-base", choices=list(ENCDEC_SHAPES))
    ap.add_argument("--src-len", type=int, default=400)
    ap.add_argument("--no-repeat", type=int, default=3)
    ap.add_argument("--impls", nargs="+", default=["generate", "fast"], choices=IMPLS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, batch = encdec_inputs(args.shape, args.batch, args.src_len)
    kwargs = dict(
        num_beams=args.beams,
        do_sample=False,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        no_repeat_ngram_size=args.no_repeat,
    )
    print(f"{args.shape}, batch {args.batch} x beam {args.beams}, {batch.input_ids.shape[1]} source tokens")
    run(args.impls[-1], model, Batch(batch.input_ids[:1], batch.attention_mask[:1]), kwargs)  # warm-up
    arms = {impl: (lambda impl=impl: run(impl, model, batch, kwargs)) for impl in args.impls}
    times, results = interleaved(arms, args.reps)
    print_medians(times, {name: runs[-1] for name, runs in results.items()})


if __name__ == "__main__":
    main()
