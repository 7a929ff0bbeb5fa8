"""A/B of ``beam.wide_topk`` on the scores a real bf16 search gives it: this checkout against a commit's.

    python scripts/harness/tied_topk_ab.py ~/.cache/seqgen-bench/marian-base --before a84895a --threads 1

Captures the [B, K * V] scores of the first ``--steps`` steps of a bf16 beam search (``--n`` WMT lines, beam 4,
no-repeat 3), checks both versions give ``torch.topk``'s indices, then times each per step, interleaved with
``torch.topk`` and the no-tie-check path (float32's cost), ``--repeats`` rounds: median (min-max) ms per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from seqgen_cli.generator import Generator
from seqgen_cli.search import beam

WMT = Path(__file__).resolve().parents[3] / "shared/data/wmt/en-de/newstest2014.en"


def beam_at(commit: str) -> object:
    """``seqgen_cli/search/beam.py`` as it was at ``commit``, imported apart."""
    show = ["git", "show", f"{commit}:seqgen_cli/search/beam.py"]
    text = subprocess.run(show, capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "beam_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("beam_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["beam_before"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--before", required=True)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    lines = WMT.read_text(encoding="utf-8").splitlines()[: args.n]
    captured: list[torch.Tensor] = []
    wide = beam.wide_topk

    def capture(scores: torch.Tensor, k: int, ties: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if len(captured) < args.steps:
            captured.append(scores.clone())
        return wide(scores, k, ties)

    gen = Generator(args.model, dtype="bfloat16", num_beams=4, max_new_tokens=args.steps, no_repeat_ngram_size=3)
    with mock.patch.object(beam, "wide_topk", capture):
        list(gen.generate(lines))
    torch.set_num_threads(args.threads)
    before, k = beam_at(args.before), 8  # 2 x beam 4 candidates
    for s in captured:
        want = torch.topk(s, k).indices
        assert torch.equal(before.wide_topk(s, k)[1], want) and torch.equal(beam.wide_topk(s, k)[1], want)
    tied = sum(int((torch.topk(s, k + 1).values.diff(dim=1) == 0).any(1).sum()) for s in captured)
    arms = {
        "before": lambda s: before.wide_topk(s, k),
        "after": lambda s: beam.wide_topk(s, k),
        "torch.topk": lambda s: torch.topk(s, k),
        "no tie check": lambda s: beam.wide_topk(s, k, ties=False),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, fn in arms.items():
            start = time.perf_counter()
            for s in captured:
                fn(s)
            times[name].append((time.perf_counter() - start) / len(captured) * 1e3)
    rows = len(captured) * captured[0].shape[0]
    print(f"{len(captured)} steps of {tuple(captured[0].shape)}, {tied} of {rows} rows tied; indices: torch.topk's")
    for name, v in times.items():
        print(f"{name}: {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}) ms per step")


if __name__ == "__main__":
    main()
