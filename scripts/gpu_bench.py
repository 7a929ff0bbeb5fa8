#!/usr/bin/env python
"""Everything issue 10's GPU table needs, in one command (``scripts/gpu_bench.sh`` installs seqgen, then calls
this). Sections, each written to ``--out`` as soon as it is done (``results.json``, ``results.md``):

* ``env``: versions and the device;
* ``equiv``: the float32 equivalence harness (``tests/equivalence.py``) on the device: the tiny fixture
  families on the suite's settings, and the bench shapes (bart-large-cnn preset, GPT-2 beam 4);
* ``sync``: (CUDA) one decode under ``torch.cuda.set_sync_debug_mode``: synchronising calls vs host checks;
* ``bart``: bart-large-cnn shape (real config and tokenizer, random weights, seed 0), FastSeq's 128 CNN/DM
  sources truncated to 1024 tokens (recycled to fill larger batches), beam 4, no-repeat 3, length penalty 2,
  exactly 142 new tokens; per dtype and batch size seqgen vs ``generate()``: samples/s, tokens/s, peak memory,
  agreement with float32; on CUDA also seqgen with the decode step captured (CUDA graphs) vs eager, its first
  run (compile and recording) timed on its own, with the capture counts (shapes, compile seconds, steps);
* ``gpt2``: GPT-2 shape, 512-token prompts (the same articles), beam 4, 128 new tokens, same measures;
* ``refill``: ``Generator(refill=True)`` vs ``refill=False`` in process on the ``bart`` stage's model with an EOS
  bias bisected into ``final_logits_bias`` (greedy mean 90 tokens: outputs spread over lengths), the
  ``cnndm-bart`` preset with its natural stop, 4 x batch inputs (the sources recycled), per dtype and batch size:
  seconds (median, min-max of 3+ interleaved runs after each one's first, compiling, run), decode steps and
  slot occupancy, output tokens per input, whether outputs are identical, the capture path's counts (CUDA);
* ``cli``: ``Generator`` on the device (pinned, non-blocking input copies) and ``device_stats()``.

Each system of a table cell is timed on its own: one that runs out of memory is marked OOM and the others'
figures stay. ``--batches max`` doubles the batch until seqgen's eager step runs out of memory. ``--budget S``
keeps a call under about S seconds: a table cell or stage that would not fit is skipped and listed with the
command that runs it. Calls into the same ``--out`` add up (a table keeps the cells of earlier calls), so the
bench runs as one call per stage, each within a 10-minute limit (on a lent machine, give ``--out`` an ignored
folder such as ``bench-results/gpu``, which stays between calls, and copy it to ``$OUT`` after each):

    scripts/gpu_bench.sh --out DIR                                  # on a GPU machine: everything, one call
    scripts/gpu_bench.sh --out DIR --budget 540 --stages equiv,sync,cli              # in 10-minute calls
    scripts/gpu_bench.sh --out DIR --budget 540 --stages bart --dtypes float16
    scripts/gpu_bench.sh --out DIR --budget 540 --stages bart --dtypes bfloat16
    scripts/gpu_bench.sh --out DIR --budget 540 --stages gpt2
    scripts/gpu_bench.sh --out DIR --budget 540 --stages bart --dtypes float16 --batches 256,max
    scripts/gpu_bench.sh --out DIR --budget 540 --stages refill --dtypes float16
    scripts/gpu_bench.sh --out DIR --budget 540 --stages refill --dtypes bfloat16
    scripts/gpu_bench.sh --device cpu --quick --out DIR             # tiny shapes on the CPU (CI)
    python scripts/gpu_bench.py --stage-shared                      # copy the needed shared files to .gpu-shared/

The shared folder (tokenizers, configs, sources): ``--shared DIR``, else ``$SEQGEN_SHARED``, else ``../shared``,
else ``.gpu-shared`` in the checkout (``../shared`` does not travel to a GPU machine: stage it, then carry
``.gpu-shared``). Only ``equiv`` imports from ``tests/`` (the harness and its fixture models), when it runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import (  # noqa: E402
    REPO,
    STAGED,
    counted_steps,
    distribution,
    find_shared,
    generate_ids,
    interleaved,
    spread_checkpoint,
)
from make_bench_models import build  # noqa: E402

from seqgen_cli.batching import is_oom  # noqa: E402
from seqgen_cli.config import resolve_generation_config  # noqa: E402
from seqgen_cli.models import get_backend  # noqa: E402
from seqgen_cli.models.capture import CapturedBackend, capture  # noqa: E402
from seqgen_cli.search import Batch, generate  # noqa: E402

STAGE_FILES = ("tokenizers/bart-large-cnn", "tokenizers/gpt2", "data/cnndm/fastseq128/cnndm_128.txt")
SOURCES = "data/cnndm/fastseq128/cnndm_128.txt"  # FastSeq's 128 CNN/DM test articles
TESTED_TRANSFORMERS = "5.23.0"  # the CI's version; the equivalence suite's generate() reference
SECTIONS = ("env", "equiv", "sync", "bart", "gpt2", "refill", "cli")
TABLES = {
    "bart": "bart-large-cnn shape",
    "gpt2": "GPT-2 shape",
    "refill": "Refill vs --no-refill, bart-large-cnn shape",
}
REF_INPUTS = 32  # float32 reference outputs: the first inputs of every batch
TINY_BART = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "num_hidden_layers": 2}
TINY_BART |= {"encoder_attention_heads": 4, "decoder_attention_heads": 4}
TINY_BART |= {"encoder_ffn_dim": 128, "decoder_ffn_dim": 128}
TINY_GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4}


def stage_shared(shared: Path) -> Path:
    """Copy the files the bench needs from ``shared`` into ``.gpu-shared`` (ignored; carry it to the GPU)."""
    for rel in STAGE_FILES:
        src, dst = shared / rel, STAGED / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)
    size = sum(f.stat().st_size for f in STAGED.rglob("*") if f.is_file()) / 2**20
    print(f"staged {len(STAGE_FILES)} paths ({size:.1f} MiB) into {STAGED}: carry '.gpu-shared'")
    return STAGED


class Report:
    """Results so far: ``out/results.json`` and ``out/results.md``, rewritten after every section. A later call
    into the same ``--out`` adds to them (one GPU call per stage): a section replaces its earlier version, and a
    table keeps the earlier rows of other (dtype, batch) cells."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out = out
        path = out / "results.json"
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.data.setdefault("commands", []).append(" ".join(sys.argv))
        self.data["args"] = {k: str(v) for k, v in vars(args).items()}
        self.data.setdefault("markdown", {})
        self.data["not_run"] = []  # this call's: stages left out for the budget
        self.data["markdown"].pop("not_run", None)
        self.t0 = time.perf_counter()

    def add(self, section: str, data: Any, md: list[str]) -> None:
        self.data[section] = data
        if isinstance(data, dict):
            data["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.t0 = time.perf_counter()
        self.data["markdown"][section] = md
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.data, indent=2) + "\n")
        order = [*SECTIONS, "not_run"]
        lines = [
            line for s in order if s in self.data["markdown"] for line in [*self.data["markdown"][s], ""]
        ]
        (self.out / "results.md").write_text("\n".join(lines))
        print("\n".join(md), flush=True)

    def add_table(self, section: str, data: dict[str, Any]) -> None:
        """A table section; rows of an earlier call with the same settings stay unless this call re-ran them."""
        old = self.data.get(section)
        if isinstance(old, dict) and old.get("settings") == data["settings"]:
            done = {(r["dtype"], r["batch"]) for r in data["rows"]}
            data["rows"] = [r for r in old["rows"] if (r["dtype"], r["batch"]) not in done] + data["rows"]
        self.add(section, data, (refill_md if section == "refill" else table_md)(TABLES[section], data))

    def not_run(self, command: str) -> None:
        """A stage left out for the budget: listed with the command that runs it; earlier results stay."""
        self.data["not_run"].append(command)
        md = ["## Not run within --budget", *(f"- `scripts/gpu_bench.sh {c}`" for c in self.data["not_run"])]
        self.add("not_run", self.data["not_run"], md)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# -- env -------------------------------------------------------------------------------------------------------
def section_env(device: torch.device) -> tuple[dict, list[str]]:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "cuda": torch.version.cuda,
        "bf16_supported": bool(device.type == "cuda" and torch.cuda.is_bf16_supported()),
    }
    from packaging.version import Version

    if Version(transformers.__version__) < Version(TESTED_TRANSFORMERS):
        env["warning"] = (
            f"transformers {transformers.__version__} < {TESTED_TRANSFORMERS}, the version the equivalence suite "
            "is defined against (5.17 penalises left padding under repetition_penalty): carry its wheel in .whl/"
        )
    return env, ["## Environment", "", *(f"- {k}: {v}" for k, v in env.items())]


# -- equivalence -----------------------------------------------------------------------------------------------
def section_equiv(
    device: torch.device, quick: bool, models: dict[str, Path], texts: list[str]
) -> tuple[dict, list[str]]:
    import tests.equivalence as eq
    from tests.engine_models import load, text_batch
    from tests.tiny_models import FAMILIES, cached_build

    families = ("bart",) if quick else FAMILIES
    settings = ("greedy", "beam4_ngram3_lp2_minmax_es") if quick else tuple(eq.SETTINGS)
    rows, notes = {}, []
    for family in families:
        loaded = load(cached_build(family))
        model = copy.deepcopy(loaded.model).to(device)
        cpu_batch = text_batch(loaded, 4 if quick else 16)
        batch = Batch(cpu_batch.input_ids.to(device), cpu_batch.attention_mask.to(device))
        rows[family] = {}
        for name in settings:
            r = eq.check_equivalence(model, get_backend, batch, eq.SETTINGS[name])
            rows[family][name] = {
                "agreement": r.agreement,
                "near_ties": len(r.near_ties),
                "unexplained": r.mismatches,
            }
            notes += [f"{family} {name}: {x}" for x in r.near_ties + r.mismatches]
        del model
    # The bench shapes, float32, on real text: bart-large-cnn's own generation config, GPT-2 beam 4.
    shapes = {
        "bart-large-cnn shape": (
            models["bart"],
            {} if not quick else {"max_length": 20, "min_length": 6},
            256,
        ),
        "gpt2 shape": (models["gpt2"], {"num_beams": 4, "max_new_tokens": 8 if quick else 64}, 128),
    }
    for name, (path, kwargs, src_len) in shapes.items():
        model = load_model(path, torch.float32, device)
        batch = encode(path, texts[: 4 if quick else 8], src_len, device, model.config.is_encoder_decoder)
        r = eq.check_equivalence(model, get_backend, batch, kwargs, keep_dtype=True)
        rows[name] = {
            "bench-shape": {
                "agreement": r.agreement,
                "near_ties": len(r.near_ties),
                "unexplained": r.mismatches,
            }
        }
        notes += [f"{name}: {x}" for x in r.near_ties + r.mismatches]
        del model
    md = ["## float32 equivalence with generate() on " + str(device), ""]
    cols = sorted({s for per in rows.values() for s in per}, key=lambda s: (s == "bench-shape", s))
    md += ["| family | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for family, per in rows.items():
        cells = [
            f"{per[c]['agreement']:.1f} %" + (f" ({per[c]['near_ties']} tie)" if per[c]["near_ties"] else "")
            if c in per
            else ""
            for c in cols
        ]
        md.append(f"| {family} | " + " | ".join(cells) + " |")
    ok = all(not v["unexplained"] for per in rows.values() for v in per.values())
    md += ["", f"all identical but for near-ties: {ok}", *notes]
    return {"rows": rows, "ok": ok, "notes": notes}, md


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


# -- sync audit ------------------------------------------------------------------------------------------------
def section_sync(device: torch.device, path: Path, texts: list[str], quick: bool) -> tuple[dict, list[str]]:
    """One fp16/bf16 decode with ``sync_every=4`` under CUDA's sync debug mode: every synchronising call warns."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}, ["## Host syncs (CUDA sync debug mode): skipped, needs CUDA"]
    model = load_model(path, torch.bfloat16, device)
    batch = encode(path, texts[:8], 256, device, True)
    steps = 16 if quick else 48
    config = resolve_generation_config(
        model.generation_config, None, dict(min_new_tokens=steps, max_new_tokens=steps)
    )
    backend = get_backend(model)
    generate(backend, batch, config, sync_every=4)  # warm-up: allocator, kernels
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            generate(backend, batch, config, sync_every=4)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{Path(w.filename).name}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    data = {
        "steps": steps,
        "host_checks": steps // 4,
        "synchronising_calls": sum(sites.values()),
        "sites": sites,
    }
    md = [
        "## Host syncs (CUDA sync debug mode)",
        "",
        f"{steps} steps, sync_every 4 ({steps // 4} checks): {data['synchronising_calls']} synchronising calls",
        *(f"- {k}: {v}" for k, v in sorted(sites.items(), key=lambda kv: -kv[1])),
    ]
    return data, md


# -- the table -------------------------------------------------------------------------------------------------
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


def recycled(texts: list[str], n: int) -> list[str]:
    """``n`` inputs: ``texts`` repeated as often as needed (a batch larger than the sources still runs ``n``)."""
    return [texts[i % len(texts)] for i in range(n)]


def timed(
    fn: Callable[[], Any], device: torch.device, reps: int, warmup: bool
) -> tuple[list[float], Any, float | None]:
    """Seconds of ``reps`` runs (after a warm-up run if ``warmup``), the last result and the peak memory (MiB)."""
    if warmup:
        fn()
    times, result = [], None
    reset_peak(device)
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, result, peak_mb(device)


def run_system(
    name: str,
    fn: Callable[[], Any],
    device: torch.device,
    reps: int,
    warmup: bool,
    size: int,
    new_tokens: int,
) -> tuple[dict[str, Any], Any]:
    """One system's timings in a cell (``<name>_s``, ``_s_median``, ``_samples_per_s``, ``_tokens_per_s``,
    ``_peak_mb``) and its last result; out of memory: ``<name>_error`` (the other systems' cells stay)."""
    try:
        times, result, peak = timed(fn, device, reps, warmup)
    except Exception as err:  # noqa: BLE001 - out of memory only
        if not is_oom(err):
            raise
        del err
        reset_peak(device)
        return {f"{name}_error": "out of memory"}, None
    median = statistics.median(times)
    return {
        f"{name}_s": times,
        f"{name}_s_median": median,
        f"{name}_samples_per_s": size / median,
        f"{name}_tokens_per_s": size * new_tokens / median,
        f"{name}_peak_mb": peak,
    }, result


def measure_cell(
    model: torch.nn.Module,
    batch: Batch,
    config: Any,
    device: torch.device,
    reps: int,
    warmup: bool,
    new_tokens: int,
    reference: list,
) -> dict[str, Any]:
    """One table cell: seqgen (eager step, and captured where it can be: its first run, which compiles, timed on
    its own with the capture counts) and ``generate()`` on ``batch``, each timed on its own (an OOM in one
    leaves the others' figures); agreement with the float32 reference on its first inputs."""
    size = batch.input_ids.shape[0]
    row: dict[str, Any] = {}
    backend = get_backend(model)
    ours_row, ours = run_system(
        "seqgen", lambda: generate(backend, batch, config).sequences, device, reps, warmup, size, new_tokens
    )
    row |= ours_row
    captured, row["step_path"] = capture(get_backend(model), device, True)
    if isinstance(captured, CapturedBackend):
        row |= first_run(lambda: generate(captured, batch, config).sequences, device)
        cap_row, cap = run_system(
            "captured",
            lambda: generate(captured, batch, config).sequences,
            device,
            reps,
            False,
            size,
            new_tokens,
        )
        row |= cap_row | captured.stats()
        row["step_path"] = captured.path
        if cap is not None and ours is not None:
            row["captured_speedup"] = row["seqgen_s_median"] / row["captured_s_median"]
            row["captured_same_as_eager"] = sum(a == b for a, b in zip(cap, ours, strict=True)) / size
    hf_row, hf = run_system(
        "generate",
        lambda: model.generate(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, generation_config=config
        ),
        device, reps, warmup, size, new_tokens,
    )  # fmt: skip
    row |= hf_row
    if ours is not None:
        n = len(reference)
        row["same_as_float32"] = sum(a == b for a, b in zip(ours[:n], reference, strict=True)) / n
    if ours is not None and hf is not None:
        start = 1 if model.config.is_encoder_decoder else batch.input_ids.shape[1]
        hf_seqs = [[ids[start:].tolist()] for ids in hf]
        ours_first = [[per[0][:new_tokens]] for per in ours]
        row["speedup"] = row["generate_s_median"] / row["seqgen_s_median"]
        row["same_as_generate"] = sum(a == b for a, b in zip(ours_first, hf_seqs, strict=True)) / size
    return row


def first_run(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """The captured arm's first run (compiles and records its shapes), timed on its own: ``captured_first_s``;
    an OOM there: ``captured_error``."""
    try:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
    except Exception as err:  # noqa: BLE001 - out of memory only
        if not is_oom(err):
            raise
        del err
        reset_peak(device)
        return {"captured_error": "out of memory (first run)"}
    return {"captured_first_s": time.perf_counter() - t0}


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


def section_table(
    stage: str,
    path: Path,
    texts: list[str],
    device: torch.device,
    dtypes: list[str],
    plan: tuple[list[int], bool],
    max_batch: int,
    src_len: int,
    new_tokens: int,
    kwargs: dict,
    reps: int,
    warmup: bool,
    budget: Budget,
) -> dict[str, Any]:
    """seqgen vs generate() per dtype and batch size (inputs recycled to fill any size); agreement of each
    dtype with seqgen in float32 on the first inputs. With ``max`` the sizes double until seqgen's eager step
    runs out of memory (or reaches ``max_batch``); cells that would overrun the budget are skipped, listed
    with the command that runs them."""
    fixed = dict(kwargs, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    ref_model = load_model(path, torch.float32, device)
    encdec = ref_model.config.is_encoder_decoder
    config = resolve_generation_config(ref_model.generation_config, None, fixed)
    ref_inputs = min(plan[0][0], REF_INPUTS)
    ref_batch = encode(path, recycled(texts, ref_inputs), src_len, device, encdec)
    reference = generate(get_backend(ref_model), ref_batch, config).sequences  # float32, the first inputs
    del ref_model
    reset_peak(device)
    rows: list[dict] = []
    skipped: list[str] = []
    for dtype_name in dtypes:
        model = load_model(path, getattr(torch, dtype_name), device)

        def cell(batch_size: int, dtype_name: str = dtype_name, model: Any = model) -> dict:
            batch = encode(path, recycled(texts, batch_size), src_len, device, encdec)
            row = {"dtype": dtype_name, "batch": batch_size}
            return row | measure_cell(model, batch, config, device, reps, warmup, new_tokens, reference)

        command = f"--stages {stage} --dtypes {dtype_name}"
        # a row with seqgen's OOM: seqgen's largest batch is behind, no larger size
        rows += table_rows(
            table_sizes(*plan, max_batch), budget, skipped, command, cell, table_row, "seqgen_error"
        )
        del model
        reset_peak(device)
    return {
        "title": f"beam {config.num_beams}, no-repeat {config.no_repeat_ngram_size or '-'}, {src_len}-token inputs, "
        f"{new_tokens} new tokens, on {device}",
        "settings": {k: str(v) for k, v in fixed.items()},
        "src_len": src_len,
        "reference_inputs": ref_inputs,
        "rows": rows,
        "skipped": skipped,
    }


def _cell(row: dict, key: str, fmt: str, system: str) -> str:
    if f"{system}_error" in row:
        return "OOM"
    return format(row[key], fmt) if row.get(key) is not None else "-"


def table_row(row: dict) -> str:
    cells = [
        row["dtype"],
        str(row["batch"]),
        _cell(row, "seqgen_s_median", ".2f", "seqgen"),
        _cell(row, "generate_s_median", ".2f", "generate"),
        _cell(row, "speedup", ".2f", "seqgen") + ("x" if row.get("speedup") else ""),
        _cell(row, "seqgen_samples_per_s", ".1f", "seqgen"),
        _cell(row, "seqgen_tokens_per_s", ".0f", "seqgen"),
        _cell(row, "generate_samples_per_s", ".1f", "generate"),
        _cell(row, "seqgen_peak_mb", "", "seqgen"),
        _cell(row, "generate_peak_mb", "", "generate"),
        f"{100 * row['same_as_float32']:.0f} %" if "same_as_float32" in row else "-",
        f"{100 * row['same_as_generate']:.0f} %" if "same_as_generate" in row else "-",
        _cell(row, "captured_s_median", ".2f", "captured") if "captured_first_s" in row or "captured_error" in row
        else row["step_path"],
        _cell(row, "captured_first_s", ".1f", "captured"),
        _cell(row, "compile_seconds", ".1f", "captured"),
        _cell(row, "captured_speedup", ".2f", "captured"),
        f"{100 * row['captured_same_as_eager']:.0f} %" if "captured_same_as_eager" in row else "-",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def table_md(name: str, data: dict) -> list[str]:
    dtypes = list(dict.fromkeys(r["dtype"] for r in data["rows"]))  # in the order they were first run
    md = [
        f"## {name}: {data['title']}",
        "",
        "| dtype | batch | seqgen s | generate() s | speed-up | seqgen samples/s | seqgen tokens/s | "
        "generate() samples/s | seqgen peak MiB | generate() peak MiB | = float32 | = generate() | "
        "captured s | captured first run s | compile s | captured speed-up | = eager |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *map(table_row, sorted(data["rows"], key=lambda r: (dtypes.index(r["dtype"]), r["batch"]))),
        "",
        "median of the timed runs; OOM: that system ran out of memory (the others' figures stand); `= float32`: "
        f"outputs identical to seqgen in float32 on the first {data['reference_inputs']} inputs; `= generate()`: "
        "identical to generate() in the same dtype; captured: the decode step replayed as CUDA graphs "
        "(`models/capture.py`; seqgen s is the eager step); its first run compiles and records (compile s: "
        "the capture path's own count), then its speed-up over the eager step and agreement with it.",
    ]
    return md + skipped_md(data)


def skipped_md(data: dict) -> list[str]:
    """A table's cells left out for the budget, each with the command that runs it."""
    if not data["skipped"]:
        return []
    return ["", "not run within --budget (run each as its own call):", *(f"- `{c}`" for c in data["skipped"])]


# -- refill ----------------------------------------------------------------------------------------------------
REFILL_SYSTEMS = ("refill", "no_refill")
INPUTS_PER_SLOT = 4  # a refill cell runs 4 x its batch of inputs (sources recycled): slots get refilled
MEAN_LENGTH = {False: 90.0, True: 12.0}  # the greedy mean length the EOS bias is bisected for (--quick: True)


def refill_settings(quick: bool) -> dict[str, Any]:
    """The ``cnndm-bart`` preset (beam 4, no-repeat 3, length penalty 2, 56-142 tokens, early stopping), natural
    stopping; ``--quick``: 64-token sources and 4-24 tokens."""
    if quick:
        return {"preset": "cnndm-bart", "max_source_length": 64, "min_length": 4, "max_length": 24}
    return {"preset": "cnndm-bart", "max_source_length": 1024}


def spread_model(base: Path, texts: list[str], device: torch.device, quick: bool) -> tuple[Path, float]:
    """``base`` with an EOS bias in ``final_logits_bias`` bisected so that greedy outputs on the first 16 sources
    average ``MEAN_LENGTH`` tokens (``_common.spread_checkpoint``; built once next to ``base``), and that bias."""
    from safetensors import safe_open
    from transformers import AutoConfig

    mean = MEAN_LENGTH[quick]
    dest = base.parent / f"{base.name}-eos{mean:g}"
    path = spread_checkpoint(str(base), texts[:16], mean, refill_settings(quick), dest, None, str(device))
    eos = AutoConfig.from_pretrained(path).eos_token_id
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return path, float(f.get_tensor("final_logits_bias")[0, eos])


def synced(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``fn`` and then a device sync (CUDA), so that timing it counts the work queued."""

    def run() -> Any:
        result = fn()
        sync(device)
        return result

    return run


def refill_cell(
    path: Path, texts: list[str], device: torch.device, dtype: str, batch: int, settings: dict, reps: int
) -> dict[str, Any]:
    """One cell: ``Generator(refill=True)`` and ``Generator(refill=False)`` on ``texts`` with ``batch_size=batch``
    (refill: ``batch`` slots). Each first runs once on its own (compiles where captured; timed as ``_first_s``),
    its decode steps and occupancy counted (``_common.counted_steps``), the memory it adds over what was
    allocated before it (``_run_peak_mb``); then ``reps`` interleaved timed runs each. Out of memory:
    ``error``."""
    from seqgen_cli.generator import Generator

    row: dict[str, Any] = {}
    gens: dict[str, Generator] = {}
    first: dict[str, list] = {}
    try:
        for system in REFILL_SYSTEMS:
            gen = gens[system] = Generator(
                str(path), device=str(device), dtype=dtype, refill=system == "refill", **settings
            )
            reset_peak(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            sync(device)
            t0 = time.perf_counter()
            with counted_steps(gen, batch) as counts:
                first[system] = generate_ids(gen, texts, batch)
            sync(device)
            row[f"{system}_first_s"] = round(time.perf_counter() - t0, 2)
            peak = peak_mb(device)
            row[f"{system}_run_peak_mb"] = None if peak is None else round(peak - before / 2**20, 1)
            row |= {f"{system}_{k}": v for k, v in counts.items()}
        arms = {s: synced(lambda g=gen: generate_ids(g, texts, batch), device) for s, gen in gens.items()}
        times, results = interleaved(arms, reps)
    except Exception as err:  # noqa: BLE001 - out of memory only
        if not is_oom(err):
            raise
        del err
        gens.clear()
        reset_peak(device)
        return {"error": "out of memory"}
    for system, ts in times.items():
        row |= {f"{system}_s": ts, f"{system}_s_median": statistics.median(ts)}
        row |= {f"{system}_s_min": min(ts), f"{system}_s_max": max(ts)}
        stats = gens[system].device_stats()
        row[f"{system}_step_path"] = stats["step_path"]
        row |= {f"{system}_{k}": stats[k] for k in ("shapes_compiled", "compile_seconds", "captured_steps",
                                                      "eager_steps") if k in stats}  # fmt: skip
    row["refill_engine"] = gens["refill"].refill  # False: the refill engine does not run this model here
    row["speedup"] = row["no_refill_s_median"] / row["refill_s_median"]
    row["steps_ratio"] = row["refill_steps"] / row["no_refill_steps"]
    ours, theirs = first["refill"], first["no_refill"]
    row["same_as_no_refill"] = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(texts)
    row["repeats_same"] = all(r == first[s] for s, runs in results.items() for r in runs)
    lengths = [len(seqs[0]) for seqs in theirs]
    row["output_tokens"] = distribution(lengths)
    row["generated_tokens"] = sum(lengths)
    return row


def section_refill(
    base: Path,
    texts: list[str],
    device: torch.device,
    dtypes: list[str],
    plan: tuple[list[int], bool],
    max_batch: int,
    quick: bool,
    reps: int,
    budget: Budget,
) -> dict[str, Any]:
    """Refill vs ``--no-refill`` per dtype and batch size on the spread workload (:func:`spread_model`):
    ``INPUTS_PER_SLOT`` x batch inputs per cell; cells that would overrun the budget are skipped, listed with
    the command that runs them, and sizes stop at the first out-of-memory cell."""
    path, bias = spread_model(base, texts, device, quick)
    settings = refill_settings(quick)
    rows: list[dict] = []
    skipped: list[str] = []
    for dtype_name in dtypes:

        def cell(batch_size: int, dtype_name: str = dtype_name) -> dict:
            inputs = INPUTS_PER_SLOT * batch_size
            row = {"dtype": dtype_name, "batch": batch_size, "inputs": inputs}
            row |= refill_cell(path, recycled(texts, inputs), device, dtype_name, batch_size, settings, reps)
            reset_peak(device)
            return row

        command = f"--stages refill --dtypes {dtype_name}"
        rows += table_rows(table_sizes(*plan, max_batch), budget, skipped, command, cell, refill_row, "error")
    limits = f"{settings.get('min_length', 56)}-{settings.get('max_length', 142)} tokens"
    return {
        "title": f"cnndm-bart preset (beam 4, no-repeat 3, length penalty 2, {limits}, early stopping), natural "
        f"stop, EOS bias {bias:.2f} in final_logits_bias (greedy mean {MEAN_LENGTH[quick]:g} tokens), "
        f"{settings['max_source_length']}-token sources, {INPUTS_PER_SLOT} x batch inputs, on {device}",
        "settings": {k: str(v) for k, v in settings.items()} | {"eos_bias": f"{bias:.4f}", "reps": str(reps)},
        "rows": rows,
        "skipped": skipped,
    }


def _span(row: dict, system: str) -> str:
    return f"{row[f'{system}_s_median']:.2f} ({row[f'{system}_s_min']:.2f}-{row[f'{system}_s_max']:.2f})"


def refill_row(row: dict) -> str:
    head = [row["dtype"], str(row["batch"]), str(row["inputs"])]
    if "error" in row:
        return "| " + " | ".join(head + ["OOM"] + ["-"] * 11) + " |"
    out = row["output_tokens"]
    cells = [
        _span(row, "refill"),
        _span(row, "no_refill"),
        f"{row['speedup']:.2f}x",
        f"{row['refill_steps']} / {row['no_refill_steps']} ({row['steps_ratio']:.2f})",
        f"{row['refill_occupancy']:.2f} / {row['no_refill_occupancy']:.2f}",
        str(row["refill_joins"]),
        f"{100 * row['same_as_no_refill']:.0f} %",
        f"{out['p10']:g} / {out['median']:g} / {out['p90']:g} ({out['min']}-{out['max']})",
        f"{row['refill_first_s']:.1f} / {row['no_refill_first_s']:.1f}",
        row["refill_step_path"],
        f"{row.get('refill_shapes_compiled', '-')} / {row.get('no_refill_shapes_compiled', '-')}",
        f"{row['refill_run_peak_mb'] or '-'} / {row['no_refill_run_peak_mb'] or '-'}",
    ]
    return "| " + " | ".join(head + cells) + " |"


def refill_md(name: str, data: dict) -> list[str]:
    dtypes = list(dict.fromkeys(r["dtype"] for r in data["rows"]))
    md = [
        f"## {name}: {data['title']}",
        "",
        "| dtype | batch | inputs | refill s | no-refill s | speed-up | steps refill / no-refill | occupancy "
        "refill / no-refill | joins | = no-refill | output tokens p10 / median / p90 (min-max) | first run s "
        "refill / no-refill | step path (refill) | shapes compiled refill / no-refill | run peak MiB refill / "
        "no-refill |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        *map(refill_row, sorted(data["rows"], key=lambda r: (dtypes.index(r["dtype"]), r["batch"]))),
        "",
        "in-process `Generator(refill=True/False).generate(inputs, batch_size=batch)`'s batching (refill: `batch` "
        "slots over each look-ahead window); seconds: median (min-max) of the interleaved timed runs after each "
        "system's first run (which compiles where the step is captured); speed-up: no-refill s / refill s; "
        "steps: decode steps of the first run, occupancy: live rows / (steps x batch x beams); = no-refill: "
        "inputs whose outputs are token-identical; output tokens: per input, best sequence; run peak: the "
        "most memory the first run adds to what was allocated before it (CUDA).",
    ]
    return md + skipped_md(data)


# -- Generator and CLI on the device ----------------------------------------------------------------------------
def section_cli(
    device: torch.device, path: Path, texts: list[str], out: Path, quick: bool
) -> tuple[dict, list[str]]:
    """``Generator`` (pinned, non-blocking input copies; ``device_stats``) and ``seqgen generate`` on the device."""
    import subprocess

    from seqgen_cli.generator import Generator

    dtype = "float32" if device.type == "cpu" else "auto"
    new = "8" if quick else "32"
    gen = Generator(str(path), device=str(device), dtype=dtype, num_beams=4, max_new_tokens=int(new))
    reset_peak(device)
    outputs = gen.generate(texts[:8], batch_size=4)
    stats = gen.device_stats()
    api_ok = len(outputs) == 8 and all(len(o) == 1 for o in outputs)
    del gen
    src, dst, stats_file = out / "cli_input.txt", out / "cli_output.txt", out / "cli_stats.json"
    src.write_text("\n".join(texts[:8]) + "\n", encoding="utf-8")
    cmd = [
        sys.executable,
        "-m",
        "seqgen_cli",
        "generate",
        "-m",
        str(path),
        "--device",
        str(device),
        "--dtype",
        dtype,
    ]
    cmd += [
        "--num-beams",
        "4",
        "--max-new-tokens",
        new,
        "--batch-size",
        "4",
        "-q",
        "--stats",
        str(stats_file),
    ]
    proc = subprocess.run([*cmd, str(src), "-o", str(dst)], capture_output=True, text=True, cwd=REPO)
    lines = dst.read_text(encoding="utf-8").splitlines() if dst.exists() else []
    cli_ok = proc.returncode == 0 and len(lines) == 8
    cli_stats = json.loads(stats_file.read_text()) if stats_file.exists() else None
    data = {"api_ok": api_ok, "device_stats": stats, "cli_ok": cli_ok, "cli_stderr": proc.stderr[-2000:]}
    data["cli_stats"] = cli_stats
    md = ["## Generator and `seqgen generate` on the device", "", f"- API, 8 inputs: {api_ok}; {stats}"]
    md.append(
        f"- CLI (`{' '.join(cmd[1:4])} ...`), 8 lines: {cli_ok}"
        + ("" if cli_ok else f": {proc.stderr[-500:]}")
    )
    return data, md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for results.json and results.md")
    ap.add_argument("--device", default="auto", help="auto (CUDA if any), cuda, cuda:N or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few runs (CI on the CPU)")
    ap.add_argument(
        "--shared", type=Path, help="shared folder (default: $SEQGEN_SHARED, ../shared, .gpu-shared)"
    )
    ap.add_argument(
        "--models", type=Path, default=Path("~/.cache/seqgen-bench").expanduser(), help="checkpoints"
    )
    ap.add_argument("--stages", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument(
        "--batches",
        help="batch sizes, e.g. 32,64,128 (the default; --quick: 2,4); 'max' last or alone (then from 32, --quick 2): "
        "go on doubling until seqgen runs out of memory",
    )
    ap.add_argument("--max-batch", type=int, default=4096, help="largest size 'max' tries")
    ap.add_argument("--reps", type=int, default=2, help="timed runs per arm (after one warm-up run)")
    ap.add_argument(
        "--budget",
        type=float,
        help="seconds this call may take (e.g. 540 in a 10-minute call): a section or table cell that would not "
        "fit is skipped and listed with the command that runs it",
    )
    ap.add_argument(
        "--stage-shared", action="store_true", help="copy the needed shared files to .gpu-shared/"
    )
    args = ap.parse_args(argv)
    shared = find_shared(args.shared)
    if args.stage_shared:
        if shared is None or shared == STAGED:
            ap.error("no shared folder to stage from (give --shared DIR or set SEQGEN_SHARED)")
        stage_shared(shared)
        return
    if args.out is None:
        ap.error("--out DIR is required")
    if shared is None:
        ap.error("no shared folder: give --shared DIR, set SEQGEN_SHARED, or stage .gpu-shared first")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(sorted(unknown))}")
    quick = args.quick
    try:
        plan = batch_plan(args.batches or ("2,4" if quick else "32,64,128"), quick)
    except ValueError as err:
        ap.error(f"--batches: {err}")
    dtypes = args.dtypes.split(",")
    budget = Budget(args.budget)
    torch.set_num_threads(1 if device.type == "cpu" else torch.get_num_threads())
    from seqgen_cli.loading import quiet_transformers

    quiet_transformers()
    report = Report(args.out, args)
    report.add("env", *section_env(device))
    print(f"shared folder: {shared}", flush=True)
    tag = "-quick" if quick else ""
    models = {
        "bart": build("bart-large-cnn", args.models, overrides=TINY_BART if quick else None, shared=shared,
                      target_name=f"bart-large-cnn{tag}"),
        "gpt2": build("gpt2", args.models, overrides=TINY_GPT2 if quick else None, shared=shared,
                      target_name=f"gpt2{tag}"),
    }  # fmt: skip
    texts = [
        line.strip() for line in (shared / SOURCES).read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    t0 = time.perf_counter()
    reps, warmup = (1, False) if quick else (args.reps, True)
    tables = {
        "bart": (models["bart"], (64, 8) if quick else (1024, 142),
                 dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, early_stopping=True)),
        "gpt2": (models["gpt2"], (64, 8) if quick else (512, 128), dict(num_beams=4)),
    }  # fmt: skip
    for stage in (s for s in SECTIONS if s in stages and s != "env"):
        if budget.left() <= 0:
            report.not_run(f"--stages {stage}")
        elif stage == "equiv":
            report.add("equiv", *section_equiv(device, quick, models, texts))
        elif stage == "sync":
            report.add("sync", *section_sync(device, models["bart"], texts, quick))
        elif stage == "cli":
            report.add("cli", *section_cli(device, models["bart"], texts, args.out, quick))
        elif stage == "refill":
            refill_reps = 2 if quick else max(3, args.reps)
            report.add_table("refill", section_refill(models["bart"], texts, device, dtypes, plan, args.max_batch,
                                                      quick, refill_reps, budget))  # fmt: skip
        else:
            path, (src, new), kwargs = tables[stage]
            report.add_table(stage, section_table(stage, path, texts, device, dtypes, plan, args.max_batch, src, new,
                                                  kwargs, reps, warmup, budget))  # fmt: skip
    print(f"gpu_bench: done in {time.perf_counter() - t0:.0f}s; results in {args.out}", flush=True)


if __name__ == "__main__":
    main()
