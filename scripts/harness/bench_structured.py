#!/usr/bin/env python
"""Structured outputs' cost: one batch decoded with and without a grammar, the same number of tokens.

    python scripts/harness/make_bench_models.py qwen2.5-0.5b
    python scripts/harness/bench_structured.py --reps 3
    python scripts/harness/bench_structured.py --reps 3 --write-inputs /tmp/structured   # the whole-process files

One ``Generator`` per arm (the same checkpoint): the first ``--batch`` WMT14 English sentences as plain prompts,
greedy, exactly ``--tokens`` new tokens (min = max: EOS banned until then), once without a grammar and once under a
JSON schema whose one string field cannot close within them (``minLength``), so every row's matcher is live at
every step: what the grammar costs per step, not a shorter output. The arms run in turn, A B A B (noise hits both
alike), after one warm-up each; each run is one ``generate_output`` call (tokenised beforehand): the decode, the
prefill included. Prints each arm's seconds (median, min-max) and the pairs' ratios; every constrained output is
checked to be the beginning of a JSON object of the schema.

``--write-inputs DIR`` writes the inputs and the schema for the whole-process pair (README's commands in
docs/BENCHMARKS.md, "Structured outputs").
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _common import interleaved, read_sources

SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string", "minLength": 1000}},
    "required": ["summary"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(Path("~/.cache/seqgen-bench/qwen2.5-0.5b").expanduser()))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--write-inputs", type=Path, default=None)
    args = parser.parse_args()
    texts = read_sources("data/wmt/en-de/newstest2014.en")[: args.batch]
    if args.write_inputs is not None:
        args.write_inputs.mkdir(parents=True, exist_ok=True)
        (args.write_inputs / "inputs.txt").write_text("".join(t + "\n" for t in texts), encoding="utf-8")
        (args.write_inputs / "schema.json").write_text(json.dumps(SCHEMA), encoding="utf-8")

    from seqgen_cli.generator import Generator
    from seqgen_cli.grammars import grammar_spec

    lengths = {"min_new_tokens": args.tokens, "max_new_tokens": args.tokens, "do_sample": False, "num_beams": 1}
    plain = Generator(args.model, **lengths)
    guided = Generator(args.model, grammar=grammar_spec(json_schema=json.dumps(SCHEMA)), **lengths)
    ids = [e.ids for e in plain.encode(texts)]
    arms = {"plain": lambda: plain.generate_output(ids), "json schema": lambda: guided.generate_output(ids)}
    interleaved(arms, 1)  # warm-up: the backends built, the first shapes run
    times, results = interleaved(arms, args.reps)
    outs = guided.detokenise([seqs[0] for seqs in results["json schema"][-1].sequences])
    assert all(o.startswith('{"summary": "') for o in outs), outs[:2]
    tokens = {name: sum(len(s[0]) for s in runs[-1].sequences) for name, runs in results.items()}
    assert tokens["plain"] == tokens["json schema"] == args.tokens * len(texts), tokens
    for name, secs in times.items():
        print(f"{name}: {statistics.median(secs):.2f} s ({min(secs):.2f}-{max(secs):.2f}), {tokens[name]} tokens")
    ratios = [g / p for g, p in zip(times["json schema"], times["plain"], strict=True)]
    print(f"json schema / plain: {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
