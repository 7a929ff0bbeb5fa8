#!/usr/bin/env python
"""Where a CPU decode goes, per component and dtype: the self time of every operator of a whole ``generate``,
attributed to the part of the step that called it, in milliseconds per decode round.

    python scripts/harness/profile_cpu_step.py ~/.cache/seqgen-bench/marian-base \\
        ../shared/data/wmt/en-de/newstest2014.en --n 32 --beams 4 --new-tokens 60 --threads 1 \\
        --dtypes float32 bfloat16 int8

Each dtype: a ``Generator`` (beam ``--beams``, exactly ``--new-tokens`` new tokens, no-repeat 3, one batch of the
first ``--n`` lines), one warm-up ``generate``, then one under ``torch.profiler`` (``with_stack``: each operator's
Python callers). One thread by default, so an operator's self time is the thread's CPU time in it. A decode round
is one call of the backend's ``step``; the encoder (or the decoder-only prefill) is reported apart. The components
(``COMPONENTS``) follow the operator's innermost callers in the package: the linear maps' products (the LM head:
those the backend's ``logits`` or ``decode`` calls directly), attention's products, its casts and the rest of it,
the cast of the logits, the log-softmax with the score add and the logits processors, top-k, the caches' writes.
Operators only: the Python around them (the interpreter's own time) is the wall time's remainder.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED  # noqa: E402

COMPONENTS = (
    "decoder layers' linear maps",
    "LM head product",
    "linear maps: around the products (quantizing, block copies)",
    "attention: score and value products",
    "attention: casts",
    "attention: softmax, scale, mask",
    "logits cast to float32",
    "log-softmax, score add, processors",
    "top-k",
    "cache writes",
    "rest (norms, embeddings, residuals, search bookkeeping)",
)
PRODUCTS = {"mkldnn::_linear_pointwise", "quantized::linear_dynamic", "aten::addmm", "aten::mm", "aten::bmm"}
CASTS = {"aten::_to_copy", "aten::to", "aten::copy_"}
FRAME = re.compile(r"seqgen_cli/(?P<file>[\w/]+\.py)\(\d+\): (?P<func>\S+)")


def frames(event: Any) -> list[tuple[str, str]]:
    """The package's Python frames above ``event``, innermost first: (file under seqgen_cli/, function)."""
    out, parent = [], event.cpu_parent
    while parent is not None:
        m = FRAME.search(parent.name)
        if m:
            out.append((m["file"], m["func"]))
        parent = parent.cpu_parent
    return out


def component(op: str, stack: list[tuple[str, str]]) -> str | None:
    """The component of operator ``op`` called from ``stack`` (:func:`frames`); None: the encoder or prefill."""
    files = {f for f, _ in stack}
    funcs = {g for _, g in stack}
    if files & {"models/source.py", "models/prefill.py"}:
        return None
    inner = stack[0] if stack else ("", "")
    caller = next(((f, g) for f, g in stack if f != "models/linear_maps.py"), ("", ""))
    head = caller[1] == "logits" or caller == ("models/decoder_only.py", "decode")
    if op in PRODUCTS:
        if inner[0] == "models/attention.py":
            return "attention: score and value products"
        return "LM head product" if head else "decoder layers' linear maps"
    if inner[0] == "models/linear_maps.py":
        return "linear maps: around the products (quantizing, block copies)"
    if inner[0] == "models/attention.py":
        return "attention: casts" if op in CASTS else "attention: softmax, scale, mask"
    if op in CASTS and (head or "_accumulated_log_probs" in funcs or caller == ("search/greedy.py", "advance")):
        return "logits cast to float32"
    if funcs & {"wide_topk", "pick_topk"} or op in {"aten::topk", "aten::argmax"}:
        return "top-k"
    if "_accumulated_log_probs" in funcs or files & {"search/processors.py", "search/ngram.py"}:
        return "log-softmax, score add, processors"
    if op == "aten::_log_softmax":
        return "log-softmax, score add, processors"
    if inner[0] in {"models/kv_cache.py", "models/kv_store.py"}:
        return "cache writes"
    return "rest (norms, embeddings, residuals, search bookkeeping)"


def profile(args: argparse.Namespace, dtype: str, texts: list[str]) -> dict[str, Any]:
    from seqgen_cli.generator import Generator

    gen = Generator(
        str(args.model), dtype=dtype, num_beams=args.beams, max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens, no_repeat_ngram_size=3, target_lang=args.target_lang,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    gen.generate(texts, batch_size=len(texts))  # warm-up: packing, first-call costs
    t0 = time.perf_counter()
    with torch.profiler.profile(with_stack=True) as prof:
        outputs = gen.generate(texts, batch_size=len(texts))
    wall = time.perf_counter() - t0
    torch.set_num_threads(threads)
    ms: Counter[str] = Counter()
    rounds = 0
    for event in prof.events():
        if FRAME.search(event.name):
            rounds += event.name.endswith(": step") and "models/" in event.name and "coder" in event.name
            continue
        if event.name.startswith("<built-in") or ".py(" in event.name:
            continue  # the interpreter's own frames
        part = component(event.name, frames(event))
        ms[part or "encoder / prefill"] += event.self_cpu_time_total / 1e3
    if not rounds:
        raise SystemExit(f"{args.model}: no decode step of a fast decoder ran (the generic backend is not profiled)")
    per_round = {part: round(ms[part] / rounds, 2) for part in COMPONENTS}
    return {
        "dtype": dtype,
        "rounds": rounds,
        "wall_s_profiled": round(wall, 2),
        "ms_per_round": per_round,
        "round_ms": round(sum(per_round.values()), 2),
        "encoder_or_prefill_ms": round(ms["encoder / prefill"], 1),
        "outputs": [o[0] for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("sources", type=Path, nargs="?", default=SHARED / "data/wmt/en-de/newstest2014.en")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target-lang", default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    lines = [s.strip() for s in args.sources.read_text(encoding="utf-8").splitlines() if s.strip()][: args.n]
    results = [profile(args, dtype, lines) for dtype in args.dtypes]
    from seqgen_cli.models.linear_maps import cpu_isa

    print(f"CPU: {cpu_isa()}; {args.threads} thread(s); {len(lines)} inputs x beam {args.beams}, {args.new_tokens} tokens")
    first = results[0]["outputs"]

    def row(label: str, cells: list[str]) -> None:
        print(f"| {label} | " + " | ".join(cells) + " |")

    row("component, ms per round", [r["dtype"] for r in results])
    print("| --- |" + " ---: |" * len(results))
    for part in COMPONENTS:
        row(part, [f"{r['ms_per_round'][part]:.1f}" for r in results])
    row("**round**", [f"**{r['round_ms']:.1f}**" for r in results])
    row("encoder or prefill, ms (whole batch)", [f"{r['encoder_or_prefill_ms']:.0f}" for r in results])
    row("rounds; profiled wall s", [f"{r['rounds']}; {r['wall_s_profiled']:.1f}" for r in results])
    same = [sum(a == b for a, b in zip(r["outputs"], first, strict=True)) for r in results]
    row("outputs = the first dtype's", [f"{k}/{len(first)}" for k in same])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
