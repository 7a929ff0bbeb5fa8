"""Where does a decoding step go? seqgen's engine (generic backend) vs transformers ``generate()``.

A random BART-shaped model (6+6 layers, d_model 512, vocab 50265), batch 8 x beam 4, CNN/DM-like
settings (no_repeat_ngram_size 3, length_penalty 2.0). Times model forward calls (encoder, decoder steps),
cache reordering and everything else (search + logits processors) per step, for both. Also checks the
two produce the same tokens. Needs no shared data (synthetic inputs). See docs/EXPERIMENTS.md ("Decoding
engine profile"). From the repository root, with the package installed (``pip install -e .``):

    python scripts/harness/profile_engine.py [--batch 8] [--beams 4] [--steps 40] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from _common import bart_shape
from transformers import AutoModelForSeq2SeqLM, BartConfig, EncoderDecoderCache

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.search import Batch, generate


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.sync()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.total[name] += time.perf_counter() - t
            self.calls[name] += 1
            return out

        return timed


def build_model(device: torch.device) -> AutoModelForSeq2SeqLM:
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=50265, max_position_embeddings=1024, forced_eos_token_id=2, **bart_shape(512, 6, 8, 2048)
    )
    return AutoModelForSeq2SeqLM.from_config(config).to(device).eval()


def make_batch(n: int, device: torch.device) -> Batch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(100, 400, (n,), generator=g).tolist()
    ids = torch.ones((n, max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        ids[i, :length] = torch.randint(4, 50000, (length,), generator=g)
        mask[i, :length] = 1
    return Batch(ids.to(device), mask.to(device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build_model(device)
    batch = make_batch(args.batch, device)
    kwargs = dict(
        num_beams=args.beams,
        no_repeat_ngram_size=3,
        length_penalty=2.0,
        min_new_tokens=10,
        max_new_tokens=args.steps,
        early_stopping=True,
    )
    config = resolve_generation_config(model.generation_config, None, kwargs)

    with torch.inference_mode():  # warm-up (allocator, kernels)
        model.generate(
            batch.input_ids[:2], attention_mask=batch.attention_mask[:2], num_beams=2, max_new_tokens=2
        )

    # seqgen: time the backend's calls; the rest of generate() is search + processors.
    ours = Timer(device)
    backend = GenericBackend(model)
    backend.start = ours.wrap("encoder", backend.start)
    backend.step = ours.wrap("decoder step", backend.step)
    backend.reorder = ours.wrap("cache reorder", backend.reorder)
    backend.keep = ours.wrap("drop finished", backend.keep)
    ours.sync()
    t = time.perf_counter()
    out = generate(backend, batch, config)
    ours.sync()
    ours_total = time.perf_counter() - t
    ours_steps = ours.calls["decoder step"]

    # transformers: hooks around the encoder and the full model's forward (one call per decoding step).
    theirs = Timer(device)
    encoder = model.get_encoder()
    enc_forward, model_forward = encoder.forward, model.forward
    encoder.forward = theirs.wrap("encoder", enc_forward)
    model.forward = theirs.wrap("decoder step", model_forward)
    reorder = EncoderDecoderCache.reorder_cache
    EncoderDecoderCache.reorder_cache = theirs.wrap("cache reorder", reorder)  # self- and cross-attention
    theirs.sync()
    t = time.perf_counter()
    with torch.inference_mode():
        hf = model.generate(batch.input_ids, attention_mask=batch.attention_mask, **kwargs)
    theirs.sync()
    theirs_total = time.perf_counter() - t
    encoder.forward, model.forward = enc_forward, model_forward
    EncoderDecoderCache.reorder_cache = reorder
    theirs_steps = theirs.calls["decoder step"]

    hf_rows = hf[:, 1:].tolist()
    same = sum(
        1
        for a, h in zip((s[0] for s in out.sequences), hf_rows, strict=True)
        if a == h[: len(a)] and all(x == model.generation_config.pad_token_id for x in h[len(a) :])
    )

    def row(name: str, a: float | None, b: float | None, per: bool = True) -> None:
        def cell(x: float | None, steps: int) -> str:
            if x is None:
                return "-"
            text = f"{1000 * x:.1f}"
            return f"{text} ({1000 * x / max(steps, 1):.2f})" if per else text

        print(f"| {name:<26} | {cell(a, ours_steps):>24} | {cell(b, theirs_steps):>24} |")

    o, h = ours.total, theirs.total
    ours_other = ours_total - sum(o.values())
    theirs_other = theirs_total - sum(h.values())
    print(
        f"BART-shaped 6+6 x d512, vocab 50265, batch {args.batch} x beam {args.beams}, "
        f"{args.steps} max new tokens, {args.threads} thread(s), {device}"
    )
    print(
        f"decoding steps: seqgen {ours_steps}, generate() {theirs_steps}; identical outputs {same}/{args.batch}"
    )
    print(f"| {'phase':<26} | {'seqgen ms (per step)':>24} | {'generate() ms (per step)':>24} |")
    print(f"|{'-' * 28}|{'-' * 25}:|{'-' * 25}:|")
    row("encoder", o["encoder"], h["encoder"], per=False)
    row("decoder forward", o["decoder step"], h["decoder step"])
    row("cache reorder", o["cache reorder"], h["cache reorder"])
    row("drop finished inputs", o["drop finished"], None)
    row("search + processors (rest)", ours_other, theirs_other)  # generate(): incl. input preparation
    row("total", ours_total, theirs_total)


if __name__ == "__main__":
    main()
