"""seqgen's engine and CTranslate2 in one process, alternating per round on the same batches of token ids
(Marian: WMT14 en-de sources; bart-base: CNN/DM cut to 400 tokens), beam 4, 60 forced new tokens,
no-repeat 3, 2 threads; medians over rounds. ``--profile`` instead prints a torch.profiler table of one seqgen
pass. ``--encoder`` times the encoder side only: seqgen's ``start`` (the model's encoder, each layer's
cross-attention K/V) and one greedy step, against CTranslate2's ``translate_batch`` with beam 1 and
``max_decoding_length=1`` (its encoder, and one decoder step that projects the cross K/V). See docs/EXPERIMENTS.md ("CPU float32: what the step does, and what each choice measured"). From the repository root::

    python scripts/experiments/bench_vs_ct2.py ~/.cache/seqgen-bench/marian-base ../shared/data/wmt/en-de/newstest2014.en \\
        --batch 32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from seqgen_cli.batching import plan_batches
from seqgen_cli.bench.systems import Ct2System, SeqgenSystem
from seqgen_cli.generator import Generator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("source")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-source-length", type=int, default=400)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--encoder", action="store_true", help="the encoder and one step only (see above)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    texts = [line.rstrip("\n") for line in open(args.source, encoding="utf-8")][: args.n]
    kw = dict(num_beams=4, max_new_tokens=60, min_new_tokens=60, no_repeat_ngram_size=3)
    gen = Generator(args.model, device="cpu", max_source_length=args.max_source_length, **kw)
    ids = [e.ids for e in gen.encode(texts)]
    batches = [[ids[i] for i in b] for b in plan_batches([len(x) for x in ids], args.batch, None)]
    systems = [SeqgenSystem(gen)]
    if not args.profile:
        ct2 = Ct2System(args.model, None, gen, 2, print)
        ct2.use(gen)
        systems.append(ct2)
    if args.encoder:
        encoders(gen, systems, batches, args.rounds)
        return
    prepared = {s.name: [s.prepare(b) for b in batches] for s in systems}
    for s in systems:  # warm-up
        s.run(prepared[s.name][0][:8])
    if args.profile:
        from torch.profiler import profile

        with torch.inference_mode(), profile() as p:
            for b in prepared["seqgen"]:
                systems[0].run(b)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        return
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for s in systems if r % 2 == 0 else systems[::-1]:
            start = time.perf_counter()
            outputs[s.name] = [y for b in prepared[s.name] for y in s.run(b)]
            times[s.name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.2f} s ({', '.join(f'{t:.2f}' for t in ts)})")
    print(f"seqgen / ct2 speed: {statistics.median(times['ct2']) / statistics.median(times['seqgen']):.2f}x")


def encoders(gen: Generator, systems: list, batches: list[list[list[int]]], rounds: int) -> None:
    """``--encoder``: seqgen's start + one step against CTranslate2's encoder + one step, alternating per round."""
    backend = gen._engine()
    pads = [gen.pad(b) for b in batches]
    ct2 = systems[1].engine
    tokens = [systems[1].prepare(b) for b in batches]

    def seqgen() -> None:
        with torch.inference_mode():
            for batch in pads:
                state, _ = backend.start(batch, 1, 1)
                backend.step(state, torch.full((batch.input_ids.shape[0],), gen.config.decoder_start_token_id))

    def ctranslate2() -> None:
        for toks in tokens:
            ct2.translate_batch(toks, beam_size=1, max_decoding_length=1)

    runs = {"seqgen": seqgen, "ct2": ctranslate2}
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name in runs if r % 2 == 0 else list(runs)[::-1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name} encoder + 1 step: median {statistics.median(ts):.3f} s ({', '.join(f'{t:.3f}' for t in ts)})")
    print(f"seqgen / ct2 speed: {statistics.median(times['ct2']) / statistics.median(times['seqgen']):.2f}x")


if __name__ == "__main__":
    main()
