#!/usr/bin/env python
"""Everything the GPU tables need, in one command (``scripts/harness/gpu_bench.sh`` installs seqgen, then calls
this). Sections, each written to ``--out`` as soon as it is done (``results.json``, ``results.md``):

* ``env``: versions and the device;
* ``equiv``: the float32 equivalence harness (``tests/equivalence.py``) on the device: the tiny fixture
  families on the suite's settings, and the bench shapes (bart-large-cnn preset, GPT-2 beam 4);
* ``sync``: (CUDA) one decode under ``torch.cuda.set_sync_debug_mode``: synchronising calls vs host checks;
* ``bart``: bart-large-cnn shape (real config and tokenizer, random weights, seed 0), FastSeq's 128 CNN/DM
  sources truncated to 1024 tokens (recycled to fill larger batches), beam 4, no-repeat 3, length penalty 2,
  exactly 142 new tokens; per dtype and batch size seqgen vs ``generate()``: samples/s, tokens/s, peak memory,
  agreement with float32; on CUDA also seqgen with the decode step captured (CUDA graphs) vs eager, its first
  run (compile and recording) timed on its own, with the capture counts (shapes, compile seconds, steps), and
  with the model's step alone captured (the beam search eager: what the search's graph brings);
* ``long``: one captured float16 backend over 100 batches of 16 (bart-large-cnn shape, 48 new tokens): seconds
  per batch, the first 10 against the last 10, CUDA graphs recorded; then the captured path's synchronising calls;
* ``gpt2``: GPT-2 shape, 512-token prompts (the same articles), beam 4, 128 new tokens, same measures;
* ``refill``: ``Generator(refill=True)`` vs ``refill=False`` in process on the ``bart`` stage's model with an EOS
  bias bisected into ``final_logits_bias`` (greedy mean 90 tokens: outputs spread over lengths), the
  ``cnndm-bart`` preset with its natural stop, 4 x batch inputs (the sources recycled), per dtype and batch size:
  seconds (median, min-max of 3+ interleaved runs after each one's first, compiling, run), decode steps and
  lane occupancy, output tokens per input, whether outputs are identical, the capture path's counts (CUDA);
* ``cli``: ``Generator`` on the device (pinned, non-blocking input copies) and ``device_stats()``;
* ``profile``: the eager step under ``torch.profiler`` per dtype (top operators by device and host time), and a
  short whole process split (device init, ``--verify 0`` against the default);
* ``run``: whole ``seqgen generate`` processes over ``--run-inputs`` CNN/DM lines (the sources recycled),
  ``--preset cnndm-bart``, batch 32: ``--no-capture``, the default (a shape compiled once it pays), ``--capture``
  from empty inductor caches and again on warm ones: wall and generate seconds, shapes compiled, compile seconds.

Each system of a table cell is timed on its own: one that runs out of memory is marked OOM and the others'
figures stay. ``--batches max`` doubles the batch until seqgen's eager step runs out of memory. ``--budget S``
keeps a call under about S seconds: a table cell or stage that would not fit is skipped and listed with the
command that runs it. Calls into the same ``--out`` add up (a table keeps the cells of earlier calls), so the
bench runs as one call per stage, each within a 10-minute limit (on a lent machine, give ``--out`` an ignored
folder such as ``bench-results/gpu``, which stays between calls, and copy it to ``$OUT`` after each):

    scripts/harness/gpu_bench.sh --out DIR                                  # on a GPU machine: everything, one call
    scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages equiv,sync,cli              # in 10-minute calls
    scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages bart --dtypes float16
    scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages bart --dtypes bfloat16
    scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages gpt2
    scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages bart --dtypes float16 --batches 256,max
    scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages refill --dtypes float16
    scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages refill --dtypes bfloat16
    scripts/harness/gpu_bench.sh --out DIR --budget 540 --stages run                       # 512 inputs
    scripts/harness/gpu_bench.sh --device cpu --quick --out DIR             # tiny shapes on the CPU (CI)
    python scripts/harness/gpu_bench.py --stage-shared                      # copy the needed shared files to .gpu-shared/

The shared folder (tokenizers, configs, sources): ``--shared DIR``, else ``$SEQGEN_SHARED``, else ``../shared``,
else ``.gpu-shared`` in the checkout (``../shared`` does not travel to a GPU machine: stage it, then carry
``.gpu-shared``). Only ``equiv`` imports from ``tests/`` (the harness and its fixture models), when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

# The stages live in scripts/harness/gpu_stages/: checks (env, equiv, sync, cli), tables (bart, gpt2), refill; base
# holds what they share (device syncs, models and inputs, --batches, --budget, the table loop).
from _common import STAGED, find_shared, read_sources  # noqa: E402
from gpu_stages.base import Budget, batch_plan  # noqa: E402
from gpu_stages.checks import section_cli, section_env, section_equiv, section_sync  # noqa: E402
from gpu_stages.long import section_long  # noqa: E402
from gpu_stages.profile import section_profile  # noqa: E402
from gpu_stages.refill import refill_md, section_refill  # noqa: E402
from gpu_stages.run import section_run  # noqa: E402
from gpu_stages.tables import SHAPES, section_table, table_md  # noqa: E402
from make_bench_models import build  # noqa: E402

STAGE_FILES = ("tokenizers/bart-large-cnn", "tokenizers/gpt2", "data/cnndm/fastseq128/cnndm_128.txt")
SOURCES = "data/cnndm/fastseq128/cnndm_128.txt"  # FastSeq's 128 CNN/DM test articles
SECTIONS = ("env", "equiv", "sync", "bart", "long", "gpt2", "refill", "cli", "run", "profile")
TABLES = {  # section: its heading and how its rows are shown
    "bart": ("bart-large-cnn shape", table_md),
    "gpt2": ("GPT-2 shape", table_md),
    "refill": ("Refill vs --no-refill, bart-large-cnn shape", refill_md),
}
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
        title, show = TABLES[section]
        self.add(section, data, show(title, data))

    def not_run(self, command: str) -> None:
        """A stage left out for the budget: listed with the command that runs it; earlier results stay."""
        self.data["not_run"].append(command)
        md = ["## Not run within --budget", *(f"- `scripts/harness/gpu_bench.sh {c}`" for c in self.data["not_run"])]
        self.add("not_run", self.data["not_run"], md)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
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
    ap.add_argument("--run-inputs", type=int, help="lines of the run stage (default 512; --quick: 12)")
    ap.add_argument(
        "--budget",
        type=float,
        help="seconds this call may take (e.g. 540 in a 10-minute call): a section or table cell that would not "
        "fit is skipped and listed with the command that runs it",
    )
    ap.add_argument(
        "--stage-shared", action="store_true", help="copy the needed shared files to .gpu-shared/"
    )
    return ap, ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    ap, args = parse_args(argv)
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
    # the equiv stage's fixtures (tests/) read it: the staged files too
    os.environ["SEQGEN_SHARED"] = str(shared)
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
    texts = read_sources(SOURCES, shared)
    t0 = time.perf_counter()
    reps, warmup = (1, False) if quick else (args.reps, True)
    for stage in (s for s in SECTIONS if s in stages and s != "env"):
        if budget.left() <= 0:
            report.not_run(f"--stages {stage}")
        elif stage == "equiv":
            report.add("equiv", *section_equiv(device, quick, models, texts))
        elif stage == "sync":
            report.add("sync", *section_sync(device, models["bart"], texts, quick))
        elif stage == "long":
            report.add("long", *section_long(models["bart"], texts, device, quick, budget))
        elif stage == "cli":
            report.add("cli", *section_cli(device, models["bart"], texts, args.out, quick))
        elif stage == "run":
            inputs = args.run_inputs or (12 if quick else 512)
            report.add("run", *section_run(device, models["bart"], texts, args.out, inputs, budget, quick))
        elif stage == "profile":
            full, small, kwargs = SHAPES["bart"]
            report.add("profile", *section_profile(device, models["bart"], texts, args.out, dtypes,
                                                   small if quick else full, kwargs, quick))  # fmt: skip
        elif stage == "refill":
            refill_reps = 2 if quick else max(3, args.reps)
            report.add_table("refill", section_refill(models["bart"], texts, device, dtypes, plan, args.max_batch,
                                                      quick, refill_reps, budget))  # fmt: skip
        else:
            full, small, kwargs = SHAPES[stage]
            src, new = small if quick else full
            report.add_table(stage, section_table(stage, models[stage], texts, device, dtypes, plan, args.max_batch,
                                                  src, new, kwargs, reps, warmup, budget))  # fmt: skip
    print(f"gpu_bench: done in {time.perf_counter() - t0:.0f}s; results in {args.out}", flush=True)


if __name__ == "__main__":
    main()
