"""What the benchmark and profiling scripts share: the shared data folder, random-weight models at real
shapes, source texts, common options and interleaved timing with medians.

The scripts import the installed package (``pip install -e .`` from the repository root) and this module
(``python scripts/NAME.py`` puts ``scripts/`` on the import path). Tokenizers, configs and sources come from
the shared data folder: ``$SEQGEN_SHARED``, else ``../shared`` next to the repository root, else ``.gpu-shared``
(see :func:`find_shared`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from seqgen_cli.search import Batch

REPO = Path(__file__).resolve().parents[1]
STAGED = REPO / ".gpu-shared"  # the few shared files copied into the checkout for a GPU machine (ignored)


def find_shared(explicit: Path | None = None) -> Path | None:
    """The shared data folder: ``explicit`` (``--shared DIR``), else ``$SEQGEN_SHARED``, else ``../shared``
    next to the repository root, else the staged copy ``.gpu-shared`` in the checkout; None if none exists."""
    env = os.environ.get("SEQGEN_SHARED")
    candidates = [explicit, Path(env) if env else None, REPO.parent / "shared", STAGED]
    return next((c for c in candidates if c is not None and (c / "tokenizers").is_dir()), None)


SHARED = find_shared() or REPO.parent / "shared"


def bart_shape(d_model: int, layers: int, heads: int, ffn: int) -> dict[str, int]:
    """BART config fields for a symmetric shape (same layer count, heads and FFN width on both sides)."""
    return {
        "d_model": d_model,
        "encoder_layers": layers,
        "decoder_layers": layers,
        "encoder_attention_heads": heads,
        "decoder_attention_heads": heads,
        "encoder_ffn_dim": ffn,
        "decoder_ffn_dim": ffn,
    }


def random_model(
    folder: str, overrides: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, Any]:
    """A model with random weights (seed 0) at the shape of ``shared/tokenizers/<folder>``'s config (with
    ``overrides``), and that folder's tokenizer. Speed only: the outputs are meaningless text."""
    path = SHARED / "tokenizers" / folder
    cfg = AutoConfig.from_pretrained(path)
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    auto = AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(cfg, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)


def read_sources(relpath: str) -> list[str]:
    """The non-empty lines of ``shared/<relpath>`` (e.g. ``data/cnndm/summeval.source``), stripped."""
    lines = (SHARED / relpath).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


ENCDEC_SHAPES = {
    # name: (tokenizer/config folder in shared/tokenizers, config overrides, sources in shared/)
    "bart-base": ("bart-large-cnn", bart_shape(768, 6, 12, 3072), "data/cnndm/summeval.source"),
    "bart-large-cnn": ("bart-large-cnn", {}, "data/cnndm/summeval.source"),
    "marian": ("opus-mt-tc-big-en-pt", {}, "data/wmt/en-de/newstest2014.en"),
}


def encdec_inputs(shape: str, batch: int, src_len: int = 400) -> tuple[torch.nn.Module, Batch]:
    """The random-weight model of ``ENCDEC_SHAPES[shape]`` and its first ``batch`` sources, tokenised and
    truncated to ``src_len`` tokens (right-padded)."""
    folder, overrides, sources = ENCDEC_SHAPES[shape]
    model, tok = random_model(folder, overrides)
    enc = tok(
        read_sources(sources)[:batch], padding=True, truncation=True, max_length=src_len, return_tensors="pt"
    )
    return model, Batch(enc["input_ids"], enc["attention_mask"])  # [B, S]


def timing_args(
    parser: argparse.ArgumentParser, batch: int = 8, beams: int = 4, reps: int = 3, threads: int = 1
) -> None:
    """Options every model benchmark takes: ``--batch --beams --new-tokens --reps --threads``."""
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--beams", type=int, default=beams)
    parser.add_argument("--new-tokens", type=int, default=60, help="exactly this many (min = max)")
    parser.add_argument("--reps", type=int, default=reps, help="timed runs of each arm, interleaved")
    parser.add_argument(
        "--threads", type=int, default=threads, help="torch threads (1 is steadier on a shared box)"
    )


def interleaved(
    arms: dict[str, Callable[[], Any]], reps: int
) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Run each arm once per repetition, in turn (noise hits all alike): seconds and results per run."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    results: dict[str, list] = {name: [] for name in arms}
    for _ in range(reps):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            results[name].append(fn())
            times[name].append(time.perf_counter() - t0)
            print(f"  {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    return times, results


def print_medians(times: dict[str, list[float]], outputs: dict[str, list[list[int]]] | None = None) -> None:
    """A markdown table: median and all runs per arm, speed-up over the first arm and, given each arm's
    outputs (one token list per input), how many inputs are identical to the first arm's."""
    first = next(iter(times))
    base = statistics.median(times[first])
    print(f"| arm | median s | runs s | speed-up vs {first} | identical to {first} |")
    print("| --- | ---: | --- | ---: | ---: |")
    for name, ts in times.items():
        med = statistics.median(ts)
        same = "-"
        if outputs is not None:
            ref, out = outputs[first], outputs[name]
            same = f"{sum(a == b for a, b in zip(ref, out, strict=True))}/{len(ref)}"
        runs = ", ".join(f"{t:.2f}" for t in ts)
        print(f"| {name} | {med:.2f} | {runs} | {base / med:.2f}x | {same} |")
