"""Refill vs --no-refill vs CTranslate2 on a variable-length workload, whole processes, interleaved repeats.

The workload: a checkpoint (default the ``marian-base`` shape of ``make_bench_models.py``) with an EOS bias written
into ``final_logits_bias``, bisected so that greedy outputs average ``--mean-length`` tokens: random weights then
stop at a roughly geometric spread of lengths (reported). See docs/BENCHMARKS.md ("Refill"). From the repository
root::

    python scripts/bench_refill.py ~/.cache/seqgen-bench/marian-base ../shared/data/wmt/en-de/newstest2014.en \\
        --n 64 --batch 16 --repeats 3
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

import torch


def spread_checkpoint(base: str, texts: list[str], mean_length: float, max_new: int, dest: Path) -> Path:
    """``base`` with the EOS logit biased so that greedy outputs on ``texts`` average ``mean_length`` tokens."""
    from seqgen_cli.generator import Generator

    if (dest / "config.json").is_file():
        return dest
    gen = Generator(base, device="cpu", num_beams=1, max_new_tokens=max_new)
    model = gen.model
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    bias = model.final_logits_bias[0]
    lo, hi = -10.0, 30.0
    for _ in range(10):
        mid = (lo + hi) / 2
        bias[eos] = mid
        gen._model_backend = None  # the backend folds the bias in when built
        lengths = [len(s[0]) for s in gen.generate_ids([e.ids for e in gen.encode(texts)])]
        mean = statistics.mean(lengths)
        print(f"bias {mid:.2f}: mean greedy length {mean:.1f}", file=sys.stderr)
        lo, hi = (lo, mid) if mean < mean_length else (mid, hi)
    bias[eos] = (lo + hi) / 2
    model.save_pretrained(dest)
    gen.tokenizer.save_pretrained(dest)
    return dest


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
    ap.add_argument("--max-new-tokens", type=int, default=150)
    ap.add_argument("--mean-length", type=float, default=40.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-results/refill")
    ap.add_argument("--systems", default="refill,no-refill,ct2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = [line.rstrip("\n") for line in open(args.source, encoding="utf-8")][: args.n]
    inp = out / "input.txt"
    inp.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    name = Path(args.model).name + f"-eos{args.mean_length:g}"
    model = spread_checkpoint(args.model, texts[:16], args.mean_length, args.max_new_tokens, out / name)
    flags = ["--num-beams", str(args.beams), "--max-new-tokens", str(args.max_new_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    heads: dict[str, list[str]] = {}
    seqgen = [sys.executable, "-m", "seqgen_cli", "generate", "-m", str(model), str(inp), "-q", *flags]
    seqgen += ["--batch-size", str(args.batch)]
    for system in ("refill", "no-refill"):
        heads[system] = [*seqgen, f"--{system}", "-o", str(out / f"{system}.txt"), "--stats"]
    if "ct2" in args.systems:
        from dataclasses import asdict

        from seqgen_cli.bench import ct2
        from seqgen_cli.generator import Generator

        gen = Generator(str(model), device="cpu", num_beams=args.beams, max_new_tokens=args.max_new_tokens)
        path = ct2.convert(str(model))
        plan = json.dumps(asdict(ct2.plan_for(gen, path)))
        heads["ct2"] = [
            *[sys.executable, "-m", "seqgen_cli.bench.baselines", "ct2", "--threads", str(args.threads)],
            *["--model", str(model), "--ct2-model", str(path), "--settings", plan, "--input", str(inp)],
            *["--output", str(out / "ct2.txt"), "--batch-size", str(args.batch)],
        ]
    systems = [s for s in args.systems.split(",") if s in heads]
    seconds: dict[str, list[float]] = {s: [] for s in systems}
    stats: dict[str, dict] = {}
    for rep in range(args.repeats):
        for system in systems if rep % 2 == 0 else systems[::-1]:
            cmd = list(heads[system])
            if system != "ct2":
                cmd.append(str(out / f"stats-{system}.json"))
            load = os.getloadavg()[0]
            secs = run(cmd, env)
            seconds[system].append(secs)
            print(f"rep {rep} {system}: {secs:.2f} s (load {load:.2f})", file=sys.stderr)
            if system != "ct2":
                stats[system] = json.loads((out / f"stats-{system}.json").read_text())
    lengths = [len(line.split()) for line in (out / "no-refill.txt").read_text(encoding="utf-8").splitlines()]
    same = (out / "refill.txt").read_bytes() == (out / "no-refill.txt").read_bytes()
    result = {
        "command": " ".join(sys.argv),
        "seconds": seconds,
        "medians": {s: statistics.median(v) for s, v in seconds.items()},
        "refill": stats.get("refill", {}).get("device", {}).get("refill"),
        "generated_tokens": {s: st.get("generated_tokens") for s, st in stats.items()},
        "refill_same_as_no_refill": same,
        "output_words": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
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
