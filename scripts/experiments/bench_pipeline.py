"""Benchmark the I/O pipeline: pipelined vs a synchronous read-generate-write loop, and the effect of
length sorting + a token budget on padding and throughput.

Measures samples per second, padding and per-stage seconds of whole files-to-file runs: one model load,
variants interleaved per repeat, medians reported; checks the sync loop and the pipeline write the same
bytes. See docs/EXPERIMENTS.md ("I/O pipeline"). From the repository root, with the package installed
(``pip install -e .``):

    python scripts/experiments/bench_pipeline.py -m MODEL INPUT [--limit N] [--repeats 3] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))  # _common lives there

from _common import interleaved  # noqa: E402

from seqgen_cli.batching import plan_batches
from seqgen_cli.generator import Generator
from seqgen_cli.pipeline.records import read_records
from seqgen_cli.pipeline.run import RunOptions, run
from seqgen_cli.pipeline.sinks import FileSink
from seqgen_cli.pipeline.writer import format_output


def sync_loop(gen: Generator, path: str, out: str, batch_size: int, window: int) -> dict:
    """The synchronous baseline: read a window, tokenise, sort, generate, detokenise, write; repeat."""
    t0 = time.perf_counter()
    real = padded = n = 0
    records = read_records([path])
    with open(out, "w", encoding="utf-8") as fh:
        while chunk := list(islice(records, window)):
            live = [r for r in chunk if r.text.strip()]
            enc = [e.ids for e in gen.encode([r.text for r in live])]
            outs: dict[int, list[str]] = {}
            for idx in plan_batches([len(e) for e in enc], batch_size, None):
                real += sum(len(enc[i]) for i in idx)
                padded += max(len(enc[i]) for i in idx) * len(idx)
                for i, seqs in zip(idx, gen.generate_ids([enc[i] for i in idx]), strict=True):
                    outs[live[i].index] = gen.decode(seqs)
            for r in chunk:
                fh.write(format_output(r, outs.get(r.index, [""]), "text", "output"))
            n += len(chunk)
    secs = time.perf_counter() - t0
    padding = 1 - real / padded if padded else 0.0
    return {"samples_per_s": n / secs, "padding": padding, "seconds": secs, "stages": "(serial)"}


def pipelined(gen: Generator, path: str, out: str, **opts) -> dict:
    Path(f"{out}.seqgen-index").unlink(missing_ok=True)
    s = run(gen, read_records([path]), FileSink(out, {}), RunOptions(**opts))
    return {
        "samples_per_s": s.samples_per_second,
        "padding": s.padding_ratio,
        "seconds": s.seconds,
        "stages": f"{s.read_seconds + s.tokenise_seconds:.2f} / {s.generate_seconds:.2f} / {s.write_seconds:.2f}",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("input")
    ap.add_argument("--limit", type=int, default=0, help="first N lines only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--num-beams", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    args = ap.parse_args()
    gen = Generator(args.model, max_new_tokens=args.max_new_tokens, num_beams=args.num_beams)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    src = args.input
    if args.limit:
        src = str(tmp / "input.txt")
        with open(args.input, encoding="utf-8") as fh, open(src, "w", encoding="utf-8") as out:
            out.writelines(islice(fh, args.limit))
    bs, window = args.batch_size, max(16 * args.batch_size, 2048)
    variants = {
        "sync loop, sorted window, batch size": lambda o: sync_loop(gen, src, o, bs, window),
        "pipeline, sorted window, batch size": lambda o: pipelined(gen, src, o, batch_size=bs),
        "pipeline, input order (no sort), batch size": lambda o: pipelined(
            gen, src, o, batch_size=bs, sort_window=0
        ),
        "pipeline, sorted + token budget": lambda o: pipelined(
            gen, src, o, batch_size=4 * bs, batch_tokens=args.batch_tokens
        ),
    }
    gen.generate_ids([gen.encode(["warm up"])[0].ids])
    out = str(tmp / "out.txt")
    _, runs = interleaved(
        {name: lambda fn=fn: (fn(out), Path(out).read_bytes()) for name, fn in variants.items()}, args.repeats
    )
    results = {name: [stats for stats, _ in rs] for name, rs in runs.items()}
    outputs = {name: rs[-1][1] for name, rs in runs.items()}
    lines = sum(1 for _ in open(src, encoding="utf-8"))
    print(
        f"{args.input} ({lines} lines), {args.model}, max_new_tokens={args.max_new_tokens}, "
        f"beams={args.num_beams}, batch size {bs}, budget {args.batch_tokens}, {args.repeats} repeats"
    )
    print("| variant | samples/s (median) | all repeats | padding | read+tokenise / generate / write s |")
    print("| --- | ---: | --- | ---: | --- |")
    for name, rs in results.items():
        rates = [r["samples_per_s"] for r in rs]
        print(
            f"| {name} | {statistics.median(rates):.1f} | {', '.join(f'{r:.1f}' for r in rates)} | "
            f"{100 * rs[0]['padding']:.1f}% | {rs[-1]['stages']} |"
        )
    same = outputs["sync loop, sorted window, batch size"] == outputs["pipeline, sorted window, batch size"]
    print(f"sync loop and pipeline outputs identical: {same}")


if __name__ == "__main__":
    main()
