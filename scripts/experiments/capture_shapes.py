#!/usr/bin/env python
"""How many CUDA-graph shapes a real CNN/DM run compiles: old vs new width buckets.

No model runs: the CNN/DM sources in the shared folder (FastSeq's 128, SummEval's and REALSumm's 100 each)
are recycled to ``--inputs`` lines, tokenised with bart-large-cnn's tokenizer (truncated to its 1,024
positions) and batched as ``seqgen generate`` batches them (``batching.plan_batches`` over windows of
``default_window(batch_size)`` inputs, beams as rows). Each batch's shape is ``(rows bucket, width bucket,
positions)`` as ``models/capture.py`` pads it; as inputs finish, the running ones are compacted to fewer lanes
(``shapes.compacted``; checked every 4 steps, the GPU cadence). When an input finishes is taken from bart-large-cnn's
real output lengths for FastSeq's 128 articles (``expected_bart_output.hypo``, cycled; clipped to the
preset's 56..142 tokens): a proxy, since beam search may run past the best hypothesis's length.

    python scripts/experiments/capture_shapes.py [--inputs 2000] [--batch-size 32] [--caps 8,16,32]

Printed per bucketing: distinct shapes at batch start and with compaction, input lanes run per running input
(what idle rows cost), and the share of decode steps that a first-come cap of K compiled shapes captures
(``CapturedBackend`` compiles shapes in the order they come, up to its cap). See docs/EXPERIMENTS.md ("Compiled
step on the CPU").
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "harness"), str(Path(__file__).resolve().parents[2])]

from _common import SHARED  # noqa: E402

from seqgen_cli.batching import default_window, plan_batches  # noqa: E402
from seqgen_cli.shapes import compacted, graph_positions, graph_width, power_of_two  # noqa: E402

SOURCES = ("data/cnndm/fastseq128/cnndm_128.txt", "data/cnndm/summeval.source", "data/cnndm/realsumm.source")
OUTPUTS = "data/cnndm/fastseq128/expected_bart_output.hypo"
LIMIT, BEAMS, MIN_NEW, MAX_NEW, SYNC_EVERY = 1024, 4, 56, 141, 4  # bart-large-cnn's preset (max_length 142)

Shape = tuple[int, int, int]  # (physical rows, padded width, new-token positions)
Width = Callable[[int], int]  # widest source -> padded width
Compact = Callable[[int, int], int]  # (running inputs, start lanes) -> lanes
BUCKETINGS: dict[str, tuple[Width, Compact]] = {
    "old (widths: multiples of 64; compaction: every power of two)": (
        lambda n: -(-n // 64) * 64,
        lambda running, start: power_of_two(running),
    ),
    "new (widths: powers of two, 64..limit; compaction: at most two halvings)": (
        lambda n: graph_width(n, LIMIT),
        compacted,
    ),
}


def token_lengths(tokenizer: object, lines: list[str], limit: int | None) -> list[int]:
    ids = tokenizer(lines, truncation=limit is not None, max_length=limit)["input_ids"]  # type: ignore[operator]
    return [len(x) for x in ids]


Run = tuple[Shape, int, int]  # a shape, the decode steps run at it, and its input-lane steps (lanes x steps)


def batch_steps(width: int, out_lengths: list[int], compact: Compact) -> tuple[list[Run], int]:
    """The shapes one batch runs through (steps and input-lane steps at each), compacting as
    ``CapturedBackend`` does; and the input steps of the inputs still running (the work that is not idle)."""
    positions = graph_positions(MAX_NEW)
    start = phys = power_of_two(len(out_lengths))
    runs: list[Run] = []
    steps = busy = 0
    for t in range(1, MAX_NEW + 1):
        steps += 1
        busy += sum(n >= t for n in out_lengths)
        if t % SYNC_EVERY:
            continue
        running = sum(n > t for n in out_lengths)
        if running == 0:
            break
        if compact(running, start) < phys:
            runs.append(((phys * BEAMS, width, positions), steps, steps * phys))
            phys, steps = compact(running, start), 0
    runs.append(((phys * BEAMS, width, positions), steps, steps * phys))
    return runs, busy


def simulate(
    lengths: list[int], outs: list[int], batch_size: int, bucketing: Width, compact: Compact
) -> tuple[list[list[Run]], int]:
    """Per batch, in run order, its runs; and the busy input steps of all batches."""
    window = default_window(batch_size)
    runs, busy, padded, widest = [], 0, 0, 0
    for start in range(0, len(lengths), window):
        part = lengths[start : start + window]
        for idx in plan_batches(
            part, batch_size, None, rows=BEAMS, buckets=False
        ):  # as encoder-decoder runs batch
            width = bucketing(max(part[i] for i in idx))
            batch, n = batch_steps(width, [outs[start + i] for i in idx], compact)
            runs.append(batch)
            busy += n
            padded, widest = padded + width, widest + max(part[i] for i in idx)
    print(f"  padded width / widest source, mean over batches: {padded / widest:.2f}")
    return runs, busy


def report(runs: list[list[Run]], busy: int, caps: list[int]) -> None:
    starts = {batch[0][0] for batch in runs}
    steps: Counter[Shape] = Counter()
    order: list[Shape] = []
    lane_steps = 0
    for batch in runs:
        for shape, n, lanes in batch:
            if shape not in steps:
                order.append(shape)
            steps[shape] += n
            lane_steps += lanes
    total = sum(steps.values())
    widths = sorted({s[1] for s in order})
    print(f"  {len(runs)} batches, {total} decode steps")
    print(f"  distinct shapes at batch start: {len(starts)}; with compaction: {len(order)}")
    print(f"  widths ({len(widths)}): {widths}")
    print(f"  input lanes run per running input (idle rows): {lane_steps / busy:.2f}")
    for cap in caps:
        captured = sum(steps[s] for s in order[:cap])
        print(f"  first-come cap {cap:>2}: {100 * captured / total:5.1f} % of steps captured")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--caps", default="8,16,32")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers/bart-large-cnn")
    lines = [
        x.strip() for rel in SOURCES for x in (SHARED / rel).read_text("utf-8").splitlines() if x.strip()
    ]
    lines = [lines[i % len(lines)] for i in range(args.inputs)]
    hypos = [x.replace("</s>", "").replace("<s>", "").replace("<pad>", "").strip()
             for x in (SHARED / OUTPUTS).read_text("utf-8").splitlines()]  # fmt: skip
    out_lengths = [min(max(n, MIN_NEW), MAX_NEW) for n in token_lengths(tok, hypos, None)]
    outs = [out_lengths[i % len(out_lengths)] for i in range(args.inputs)]
    lengths = token_lengths(tok, lines, LIMIT)
    print(f"{args.inputs} inputs ({len(set(lines))} distinct articles), source tokens "
          f"{min(lengths)}..{max(lengths)}, batch size {args.batch_size}, beams {BEAMS}")  # fmt: skip
    caps = [int(c) for c in args.caps.split(",")]
    for name, (bucketing, compact) in BUCKETINGS.items():
        print(name)
        report(*simulate(lengths, outs, args.batch_size, bucketing, compact), caps)


if __name__ == "__main__":
    main()
