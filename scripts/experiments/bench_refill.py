"""Refill vs --no-refill vs CTranslate2 on a variable-length workload, whole processes, interleaved repeats.

The workload: a checkpoint (a random-weight shape of ``make_bench_models.py``) with an EOS bias written into
``final_logits_bias``, bisected so that greedy outputs average ``--mean-length`` new tokens: random weights then
stop at a roughly geometric spread of lengths (reported: the output tokens per input of the ``--no-refill`` run).
Decode steps and lane occupancy (live rows / rows a full batch runs) of both engines come from one extra
in-process run each (``--no-refill``: its backend's steps counted). See docs/EXPERIMENTS.md ("Refill: lanes that
stay full"). From the repository root::

    python scripts/experiments/bench_refill.py ~/.cache/seqgen-bench/marian-base ../shared/data/wmt/en-de/newstest2014.en \\
        --n 256 --batch 16 --repeats 3
    python scripts/experiments/bench_refill.py ~/.cache/seqgen-bench/bart-base ../shared/data/cnndm/summeval.source \\
        --preset cnndm-bart --max-source-length 128 --mean-length 90 --n 64 --batch 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))  # _common lives there

from _common import counted_steps, distribution, generate_ids, interleaved, print_medians, spread_checkpoint  # noqa: E402


def count_steps(
    model: str, texts: list[str], settings: dict[str, Any], batch: int, refill: bool
) -> dict[str, Any]:
    """Decode steps, live row-steps and occupancy of one in-process run (``counted_steps``), and each input's
    output length in tokens."""
    from seqgen_cli.generator import Generator

    gen = Generator(model, device="cpu", refill=refill, lanes=batch, **settings)
    with counted_steps(gen, batch) as counts:
        lengths = [len(seqs[0]) for seqs in generate_ids(gen, texts, batch)]
    counts["lengths"] = lengths
    return counts


def decode_only(model: str, texts: list[str], settings: dict[str, Any], batch: int, repeats: int) -> None:
    """In one process, models loaded and warmed up: ``Generator.generate`` with and without refill, interleaved;
    a markdown table of the seconds and how many outputs are identical."""
    from seqgen_cli.generator import Generator

    gens = {
        name: Generator(model, device="cpu", refill=name == "refill", lanes=batch, **settings)
        for name in ("refill", "no-refill")
    }
    for gen in gens.values():
        gen.generate(texts[:batch], batch_size=batch)  # warm-up
    arms = {name: (lambda gen=gen: gen.generate(texts, batch_size=batch)) for name, gen in gens.items()}
    times, results = interleaved(arms, repeats)
    print(f"load {os.getloadavg()[0]:.2f}")
    print_medians(times, {name: runs[-1] for name, runs in results.items()})


def run(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("source")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--preset", help="a task preset (its settings; --beams still applies)")
    ap.add_argument(
        "--max-new-tokens", type=int, help="default: 150 without --preset, the preset's otherwise"
    )
    ap.add_argument("--max-source-length", type=int)
    ap.add_argument("--mean-length", type=float, default=40.0)
    ap.add_argument("--eos-bias", type=float, help="this EOS bias instead of bisecting for --mean-length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-results/refill")
    ap.add_argument("--systems", default="refill,no-refill,ct2")
    ap.add_argument("--decode-only", action="store_true", help="refill vs --no-refill in one process instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = [line.rstrip("\n") for line in open(args.source, encoding="utf-8")][: args.n]
    inp = out / "input.txt"
    inp.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    max_new = args.max_new_tokens if args.max_new_tokens or args.preset else 150
    settings: dict[str, Any] = {"num_beams": args.beams, "preset": args.preset}
    settings.update({"max_new_tokens": max_new} if max_new else {})
    settings.update({"max_source_length": args.max_source_length} if args.max_source_length else {})
    flags = ["--num-beams", str(args.beams)]
    flags += ["--max-new-tokens", str(max_new)] if max_new else []
    flags += ["--preset", args.preset] if args.preset else []
    flags += ["--max-source-length", str(args.max_source_length)] if args.max_source_length else []
    name = (
        Path(args.model).name
        + (f"-bias{args.eos_bias:g}" if args.eos_bias is not None else f"-eos{args.mean_length:g}")
        + (f"-{args.preset}" if args.preset else "")
    )
    model = spread_checkpoint(args.model, texts[:16], args.mean_length, settings, out / name, args.eos_bias)
    if args.decode_only:
        decode_only(str(model), texts, settings, args.batch, args.repeats)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    # seqgen sets a passive OpenMP wait policy itself (seqgen_cli/openmp.py); CTranslate2 spins unless told
    ct2_env = {"OMP_WAIT_POLICY": "PASSIVE"}
    heads: dict[str, list[str]] = {}
    seqgen = [sys.executable, "-m", "seqgen_cli", "generate", "-m", str(model), str(inp), "-q", *flags]
    seqgen += ["--batch-size", str(args.batch)]
    for system in ("refill", "no-refill"):
        heads[system] = [*seqgen, f"--{system}", "-o", str(out / f"{system}.txt"), "--stats"]
    if "ct2" in args.systems:
        from dataclasses import asdict

        from seqgen_cli.bench import ct2
        from seqgen_cli.generator import Generator

        gen = Generator(str(model), device="cpu", **settings)
        path = ct2.convert(str(model))
        plan = json.dumps(asdict(ct2.plan_for(gen, path)))
        heads["ct2"] = [
            *[sys.executable, "-m", "seqgen_cli.bench.baselines", "ct2", "--threads", str(args.threads)],
            *["--model", str(model), "--ct2-model", str(path), "--settings", plan, "--input", str(inp)],
            *["--output", str(out / "ct2.txt"), "--batch-size", str(args.batch)],
        ]
        if args.max_source_length:
            heads["ct2"] += ["--max-source-length", str(args.max_source_length)]
    counts = out / "counts.json"  # the in-process counts of this --out, reused (delete it to count again)
    if counts.is_file():
        counted = json.loads(counts.read_text())
    else:
        counted = {
            system: count_steps(str(model), texts, settings, args.batch, system == "refill")
            for system in ("refill", "no-refill")
        }
        counts.write_text(json.dumps(counted))
    systems = [s for s in args.systems.split(",") if s in heads]
    seconds: dict[str, list[float]] = {s: [] for s in systems}
    loads: dict[str, list[float]] = {s: [] for s in systems}
    stats: dict[str, dict] = {}
    for rep in range(args.repeats):
        for system in systems if rep % 2 == 0 else systems[::-1]:
            cmd = list(heads[system])
            if system != "ct2":
                cmd.append(str(out / f"stats-{system}.json"))
            load = os.getloadavg()[0]
            secs = run(cmd, {**env, **ct2_env} if system == "ct2" else env)
            seconds[system].append(secs)
            loads[system].append(load)
            print(f"rep {rep} {system}: {secs:.2f} s (load {load:.2f})", file=sys.stderr)
            if system != "ct2":
                stats[system] = json.loads((out / f"stats-{system}.json").read_text())
    lengths = counted["no-refill"].pop("lengths")
    same = (out / "refill.txt").read_bytes() == (out / "no-refill.txt").read_bytes()
    result = {
        "command": " ".join(sys.argv),
        "seconds": seconds,
        "loads": loads,
        "medians": {s: statistics.median(v) for s, v in seconds.items()},
        "refill_stats": stats.get("refill", {}).get("device", {}).get("refill"),
        "steps": {s: {k: v for k, v in c.items() if k != "lengths"} for s, c in counted.items()},
        "generated_tokens": {s: st.get("generated_tokens") for s, st in stats.items()},
        "refill_same_as_no_refill": same,
        "counted_lengths_same": counted["refill"].pop("lengths") == lengths,
        "output_tokens": distribution(lengths),
        "load_end": os.getloadavg(),
    }
    if "ct2" in seconds:
        ours = (out / "no-refill.txt").read_text(encoding="utf-8").splitlines()
        theirs = (out / "ct2.txt").read_text(encoding="utf-8").splitlines()
        result["ct2_same_lines"] = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
