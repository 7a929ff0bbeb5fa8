"""Benchmark the fast GPT-2 backend against ``model.generate()``: beam search over long prompts.

Measures the wall time of whole ``generate`` calls, the arms interleaved, medians reported, and whether the
top beams are token-identical to the first arm's. The real gpt2 config and tokenizer (``shared/tokenizers/
gpt2``) with random weights (speed only, never quality); prompts are CNN/DM articles (``shared/data/cnndm/
summeval.source``) cut to 200..400 tokens, left-padded. See docs/EXPERIMENTS.md ("Fast decoder-only
decoders"). From the repository root, with the package installed (``pip install -e .``):

    python scripts/harness/bench_deconly.py --batch 8 --beams 4 --new-tokens 60 --reps 3
    python scripts/harness/bench_deconly.py --arms generic,fast      # the engine over transformers' forward vs fast
"""

from __future__ import annotations

import argparse
import random

import torch
from _common import interleaved, print_medians, random_model, read_sources, timing_args

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import fast_backend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.search import Batch, generate


def prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> Batch:
    """``n`` articles cut to a random length in [lo, hi] tokens, left-padded."""
    rng = random.Random(seed)
    ids = [tok(line).input_ids for line in read_sources("data/cnndm/summeval.source")]
    ids = [x[: rng.randint(lo, hi)] for x in ids if len(x) >= lo][:n]
    width = max(map(len, ids))
    pad = tok.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # [B, P]
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])  # [B, P]
    return Batch(input_ids, mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    timing_args(ap)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--arms", default="hf,fast", help="comma list of hf (generate()), generic, fast")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tok = random_model("gpt2", dtype=dtype)
    batch = prompts(tok, args.batch, args.min_len, args.max_len)
    kw = dict(
        num_beams=args.beams,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        early_stopping=True,
    )
    config = resolve_generation_config(model.generation_config, None, kw)
    lens = batch.attention_mask.sum(-1).tolist()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dtype}, prompts {lens}, {kw}")

    def run_hf() -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
                **kw,
            )
        width = batch.input_ids.shape[1]
        return [out[b, width:].tolist() for b in range(args.batch)]

    def run_engine(backend) -> list[list[int]]:
        return [s[0] for s in generate(backend, batch, config).sequences]

    arms = {
        "generate()": ("hf", run_hf),
        "seqgen generic": ("generic", lambda: run_engine(GenericBackend(model))),
        "seqgen fast gpt2": ("fast", lambda: run_engine(fast_backend(model))),
    }
    chosen = args.arms.split(",")
    times, results = interleaved({name: fn for name, (key, fn) in arms.items() if key in chosen}, args.reps)
    print_medians(times, {name: runs[-1] for name, runs in results.items()})


if __name__ == "__main__":
    main()
