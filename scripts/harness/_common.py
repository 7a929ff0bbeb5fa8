"""What the benchmark scripts share: the shared data folder, source texts, interleaved timing, and the
variable-length refill workload (an EOS-biased checkpoint, a ``Generator``'s token ids as ``seqgen generate``
batches them, decode steps and lane occupancy counted).

The scripts import the installed package (``pip install -e .`` from the repository root) and this module
(``python scripts/harness/NAME.py`` puts ``scripts/harness/`` on the import path). Tokenizers, configs and sources
come from the shared data folder: ``$SEQGEN_SHARED``, else ``../shared`` next to the repository root, else
``.gpu-shared`` (see :func:`find_shared`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

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


def read_sources(relpath: str, shared: Path | None = None) -> list[str]:
    """The non-empty lines of ``<shared>/<relpath>`` (e.g. ``data/cnndm/summeval.source``), stripped; ``shared``
    defaults to the shared folder found at import (:data:`SHARED`)."""
    lines = ((shared or SHARED) / relpath).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


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


# -- the refill workload (the refill stage of gpu_bench.py) ----------------------------------------------------
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
    and with refill ``joins`` (from ``gen.refill_stats``). Without refill the backend's ``start`` and ``step`` are
    wrapped: a step feeds the rows still live; ``start`` counts as the first step (every row) only where it
    returns the first logits (decoder-only prefill; an encoder-decoder's first step is a ``step``)."""
    rows = gen.rows_per_input
    counts: dict[str, Any] = {"steps": 0, "live_row_steps": 0}
    backend = gen.model_backend()
    before = (gen.refill_stats.steps, gen.refill_stats.live_row_steps, gen.refill_stats.joins)
    step, start = backend.step, backend.start

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
        backend.step, backend.start = counted_step, counted_start
    try:
        yield counts
    finally:
        if not gen.refill:
            backend.step, backend.start = step, start
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
