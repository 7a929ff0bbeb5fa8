"""What the GPU bench's stages share: device syncs and peak memory, models and inputs on the device, the
``--batches`` plan, the ``--budget`` and the loop that runs a table's cells."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from seqgen_cli.search import Batch


# -- the device ------------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_sites(fn: Any) -> dict[str, int]:
    """``fn()`` under CUDA's sync debug mode: synchronising calls per source line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{Path(w.filename).name}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    return sites


def synced(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``fn`` and then a device sync (CUDA), so that timing it counts the work queued."""

    def run() -> Any:
        result = fn()
        sync(device)
        return result

    return run


def peak_mb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# -- models and inputs -----------------------------------------------------------------------------------------
def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = (
        AutoModelForSeq2SeqLM if AutoConfig.from_pretrained(path).is_encoder_decoder else AutoModelForCausalLM
    )
    return auto.from_pretrained(path, dtype=dtype).to(device).eval()


def encode(path: Path, texts: list[str], max_len: int, device: torch.device, encoder_decoder: bool) -> Batch:
    """Tokenise ``texts`` truncated to ``max_len`` tokens: right-padded sources or left-padded prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "right" if encoder_decoder else "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    return Batch(enc["input_ids"].to(device), enc["attention_mask"].to(device))  # [B, S]


def recycled(texts: list[str], n: int) -> list[str]:
    """``n`` inputs: ``texts`` repeated as often as needed (a batch larger than the sources still runs ``n``)."""
    return [texts[i % len(texts)] for i in range(n)]


# -- the tables: batch sizes, budget, cells --------------------------------------------------------------------
class Budget:
    """Seconds this call may still spend (``--budget``; None: no limit): a cell or section whose estimate does not
    fit is skipped and listed with the command that runs it."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.t0 = seconds, time.perf_counter()

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - (time.perf_counter() - self.t0)

    def allows(self, estimate: float) -> bool:
        return estimate <= self.left()


def batch_plan(spec: str, quick: bool) -> tuple[list[int], bool]:
    """``--batches``: sizes to run and whether to go on doubling after the last until seqgen runs out of memory
    (``max``, alone or last: ``32,64,max``; alone it starts at 32, or 2 with ``--quick``)."""
    parts = [p for p in spec.split(",") if p]
    grow = parts[-1:] == ["max"]
    sizes = [int(p) for p in parts[:-1] if p] if grow else [int(p) for p in parts]
    if not sizes:
        sizes = [2] if quick else [32]
    if any(b < 1 for b in sizes):
        raise ValueError(f"batch sizes must be positive: {spec}")
    return sizes, grow


def table_sizes(sizes: list[int], grow: bool, cap: int) -> Iterator[int]:
    """The batch sizes of a table: ``sizes``, then doubling up to ``cap`` when ``grow`` (the caller stops
    iterating at seqgen's first OOM)."""
    yield from sizes
    size = sizes[-1]
    while grow and size * 2 <= cap:
        size *= 2
        yield size


def table_rows(
    sizes: Iterator[int],
    budget: Budget,
    skipped: list[str],
    command: str,
    cell: Callable[[int], dict],
    show: Callable[[dict], str],
    last_key: str,
) -> list[dict]:
    """A table's rows, one ``cell(batch size)`` each, printed as they come: a cell whose time (estimated linearly
    from the last one) would overrun ``budget`` ends the table, listed in ``skipped`` as ``command --batches N``;
    a row holding ``last_key`` (an out-of-memory error) is the last."""
    rows: list[dict] = []
    last: tuple[int, float] | None = None  # (batch size, seconds) of the last cell
    for batch_size in sizes:
        estimate = 0.0 if last is None else last[1] * batch_size / last[0]
        if not budget.allows(estimate):
            skipped.append(f"{command} --batches {batch_size}")
            break
        t0 = time.perf_counter()
        row = cell(batch_size)
        last = (batch_size, time.perf_counter() - t0)
        row["cell_s"] = round(last[1], 1)
        rows.append(row)
        print(show(row), flush=True)
        if last_key in row:
            break
    return rows


def sorted_rows(rows: list[dict]) -> list[dict]:
    """A table's rows by dtype, in the order the dtypes were first run, then by batch size."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    return sorted(rows, key=lambda r: (dtypes.index(r["dtype"]), r["batch"]))


def skipped_md(data: dict) -> list[str]:
    """A table's cells left out for the budget, each with the command that runs it."""
    if not data["skipped"]:
        return []
    return ["", "not run within --budget (run each as its own call):", *(f"- `{c}`" for c in data["skipped"])]
