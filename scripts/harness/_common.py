"""What the benchmark and profiling scripts share: the shared data folder, random-weight models at real
shapes, source texts, common options and interleaved timing with medians, and the variable-length refill
workload (an EOS-biased checkpoint, a ``Generator``'s token ids as ``seqgen generate`` batches them, decode steps
and lane occupancy counted).

The scripts import the installed package (``pip install -e .`` from the repository root) and this module
(``python scripts/harness/NAME.py`` puts ``scripts/harness/`` on the import path; the scripts of
``scripts/experiments/`` put it there themselves). Tokenizers, configs and sources come from the shared data
folder: ``$SEQGEN_SHARED``, else ``../shared`` next to the repository root, else ``.gpu-shared`` (see
:func:`find_shared`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from seqgen_cli.search import Batch

if TYPE_CHECKING:
    from seqgen_cli.generator import Generator

REPO = Path(__file__).resolve().parents[2]
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


def read_sources(relpath: str, shared: Path | None = None) -> list[str]:
    """The non-empty lines of ``<shared>/<relpath>`` (e.g. ``data/cnndm/summeval.source``), stripped; ``shared``
    defaults to the shared folder found at import (:data:`SHARED`)."""
    lines = ((shared or SHARED) / relpath).read_text(encoding="utf-8").splitlines()
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


# -- the refill workload (scripts/experiments/bench_refill.py, the refill stage of gpu_bench.py) -------------------
def spread_checkpoint(
    base: str,
    texts: list[str],
    mean_length: float,
    settings: dict[str, Any],
    dest: Path,
    bias: float | None,
    device: str = "cpu",
) -> Path:
    """``base`` with the EOS logit biased (by ``bias``, or bisected) so that greedy outputs on ``texts`` average
    ``mean_length`` tokens, saved in float32 to ``dest`` (reused when it exists): random weights then stop at a
    spread of lengths."""
    from seqgen_cli.generator import Generator

    if (dest / "config.json").is_file():
        return dest
    greedy = {"num_beams": 1, "length_penalty": 1.0, "early_stopping": False}  # beam-only settings off
    # eager (capture=False): each bias rebuilds the backend, which would compile its CUDA graphs again
    gen = Generator(base, device=device, dtype="float32", capture=False, **{**settings, **greedy})
    model = gen.model
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    logit_bias = model.final_logits_bias[0]
    lo, hi = (-10.0, 30.0) if bias is None else (bias, bias)
    for _ in range(8 if bias is None else 0):
        mid = (lo + hi) / 2
        logit_bias[eos] = mid
        gen._model_backend = None  # the backend folds the bias in when built
        lengths = [len(s[0]) for s in gen.generate_ids([e.ids for e in gen.encode(texts)])]
        mean = statistics.mean(lengths)
        print(f"bias {mid:.2f}: mean greedy length {mean:.1f}", file=sys.stderr)
        lo, hi = (lo, mid) if mean < mean_length else (mid, hi)
    logit_bias[eos] = (lo + hi) / 2
    reference = gen.loaded.reference  # transformers' model (the same one where the fast engine runs it)
    reference.final_logits_bias[0, eos] = logit_bias[eos]
    reference.save_pretrained(dest)
    gen.tokenizer.save_pretrained(dest)
    return dest


def generate_ids(gen: Generator, texts: list[str], batch: int) -> list[list[list[int]]]:
    """``gen``'s token ids for ``texts`` (per input, its sequences), in input order, batched as
    ``Generator.generate(texts, batch_size=batch)`` batches and runs them (``Generator.batcher`` and
    ``generate_batches``; with refill each look-ahead window runs over the generator's ``lanes``: build it with
    ``lanes=batch``)."""
    from seqgen_cli.batching import text_chunks

    out: dict[int, list[list[int]]] = {}
    batches = gen.batcher(text_chunks(texts, gen.encode), lambda items: None, batch)
    for done in gen.generate_batches(batches):
        for result in done.results:
            if result.error is not None:
                raise RuntimeError(result.error)
            out[result.item.index] = result.sequences
    return [out[i] for i in sorted(out)]


@contextmanager
def counted_steps(gen: Generator, batch: int) -> Iterator[dict[str, Any]]:
    """Decode steps and live row-steps of ``gen``'s runs inside the block; on leaving, the yielded dict holds
    ``steps``, ``live_row_steps``, ``occupancy`` (live rows / ``batch`` x rows per input, a full batch's rows)
    and with refill ``joins`` (from ``gen.refill_stats``). Without refill the engine's ``start`` and ``step`` are
    wrapped: a step feeds the rows still live; ``start`` counts as the first step (every row) only where it
    returns the first logits (decoder-only prefill; an encoder-decoder's first step is a ``step``)."""
    rows = gen.rows_per_input
    counts: dict[str, Any] = {"steps": 0, "live_row_steps": 0}
    engine = gen._engine()
    before = (gen.refill_stats.steps, gen.refill_stats.live_row_steps, gen.refill_stats.joins)
    step, start = engine.step, engine.start

    def counted_step(state: Any, tokens: torch.Tensor) -> torch.Tensor:
        counts["steps"] += 1
        counts["live_row_steps"] += tokens.shape[0]
        return step(state, tokens)

    def counted_start(b: Any, *a: Any, **k: Any) -> Any:
        state, first = start(b, *a, **k)
        if first is not None:
            counts["steps"] += 1
            counts["live_row_steps"] += b.input_ids.shape[0] * rows
        return state, first

    if not gen.refill:
        engine.step, engine.start = counted_step, counted_start
    try:
        yield counts
    finally:
        if not gen.refill:
            engine.step, engine.start = step, start
    if gen.refill:
        st = gen.refill_stats
        counts |= {"steps": st.steps - before[0], "live_row_steps": st.live_row_steps - before[1]}
        counts["joins"] = st.joins - before[2]
    counts["occupancy"] = round(counts["live_row_steps"] / max(1, counts["steps"] * batch * rows), 4)


def distribution(values: list[int]) -> dict[str, float]:
    """min, p10, median, mean, p90 and max of ``values`` (at least two)."""
    q = statistics.quantiles(values, n=10)
    return {"min": min(values), "p10": q[0], "median": statistics.median(values), "mean": round(statistics.mean(values), 1),
            "p90": q[-1], "max": max(values)}  # fmt: skip
