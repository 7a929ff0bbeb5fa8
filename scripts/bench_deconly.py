"""Benchmark: seqgen's fast GPT-2 decoder vs ``model.generate()``, beam search, long prompts.

Real gpt2 config + tokenizer from ``../shared/tokenizers/gpt2`` (random weights: speed only, never quality),
CNN/DM articles from ``../shared/data/cnndm/summeval.source`` cut to 200..400 tokens.

    python scripts/bench_deconly.py --batch 8 --beams 4 --new 60 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seqgen_cli.models import fast_backend  # noqa: E402
from seqgen_cli.models.generic import GenericBackend  # noqa: E402
from seqgen_cli.search import Batch, generate, merge_generation_config  # noqa: E402

SHARED = Path(os.environ.get("SEQGEN_SHARED", ROOT.parent / "shared"))


def prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> Batch:
    """``n`` articles cut to a random length in [lo, hi] tokens, left-padded."""
    rng = random.Random(seed)
    lines = (SHARED / "data/cnndm/summeval.source").read_text().splitlines()
    ids = [tok(line).input_ids for line in lines]
    ids = [x[: rng.randint(lo, hi)] for x in ids if len(x) >= lo][:n]
    P = max(map(len, ids))
    pad = tok.eos_token_id
    input_ids = torch.tensor([[pad] * (P - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in ids])
    return Batch(input_ids, mask)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--new", type=int, default=60)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--arms", default="hf,fast", help="comma list of hf (generate()), generic, fast")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (the dev machine is shared: 1 is steadier)"
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    src = SHARED / "tokenizers/gpt2"
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=dtype).eval()
    batch = prompts(tok, args.batch, args.min_len, args.max_len)
    kw = dict(num_beams=args.beams, max_new_tokens=args.new, min_new_tokens=args.new, early_stopping=True)
    config = merge_generation_config(model.generation_config, None, **kw)
    lens = batch.attention_mask.sum(-1).tolist()
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dtype}, prompts {lens}, {kw}",
        flush=True,
    )

    def run_hf() -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
                **kw,
            )
        P = batch.input_ids.shape[1]
        return [out[b, P:].tolist() for b in range(args.batch)]

    def run_fast() -> list[list[int]]:
        out = generate(fast_backend(model), batch, config)
        return [s[0] for s in out.sequences]

    def run_generic() -> list[list[int]]:  # seqgen's engine over transformers' own forward + DynamicCache
        out = generate(GenericBackend(model), batch, config)
        return [s[0] for s in out.sequences]

    arms = {
        "generate()": ("hf", run_hf),
        "seqgen generic": ("generic", run_generic),
        "seqgen fast gpt2": ("fast", run_fast),
    }
    arms = {name: fn for name, (key, fn) in arms.items() if key in args.arms.split(",")}
    times: dict[str, list[float]] = {name: [] for name in arms}
    outs = {}
    for _ in range(args.repeats):  # interleaved, so that machine noise hits all arms alike
        for name, fn in arms.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
    ref = next(iter(outs))
    base = statistics.median(times[ref])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{name:18s} median {med:7.2f} s  ({', '.join(f'{t:.2f}' for t in ts)})  speed-up x{base / med:.2f}"
        )
    for name in list(outs)[1:]:
        same = sum(a == b for a, b in zip(outs[ref], outs[name], strict=True))
        print(f"top beam of {name} identical to {ref} for {same}/{args.batch} inputs")


if __name__ == "__main__":
    main()
