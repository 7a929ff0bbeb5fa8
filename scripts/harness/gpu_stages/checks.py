"""The stages that check rather than time: ``env`` (versions and the device), ``equiv`` (the float32 equivalence
harness on the device), ``sync`` (synchronising calls of one decode, CUDA) and ``cli`` (``Generator`` and
``seqgen generate`` on the device). Each returns its results and its Markdown lines."""

from __future__ import annotations

import copy
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
from _common import REPO

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import get_backend
from seqgen_cli.search import Batch, generate

from .base import encode, load_model, reset_peak, sync, sync_sites

TESTED_TRANSFORMERS = "5.23.0"  # the CI's version; the equivalence suite's generate() reference


def section_env(device: torch.device) -> tuple[dict, list[str]]:
    import transformers
    from packaging.version import Version

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "cuda": torch.version.cuda,
        "bf16_supported": bool(device.type == "cuda" and torch.cuda.is_bf16_supported()),
    }
    if Version(transformers.__version__) < Version(TESTED_TRANSFORMERS):
        env["warning"] = (
            f"transformers {transformers.__version__} < {TESTED_TRANSFORMERS}, the version the equivalence suite "
            "is defined against (5.17 penalises left padding under repetition_penalty): carry its wheel in .whl/"
        )
    return env, ["## Environment", "", *(f"- {k}: {v}" for k, v in env.items())]


def section_equiv(
    device: torch.device, quick: bool, models: dict[str, Path], texts: list[str]
) -> tuple[dict, list[str]]:
    """``tests/equivalence.py`` on the device: the tiny fixture families on the suite's settings, then the bench
    shapes on real text (bart-large-cnn's own generation config, GPT-2 beam 4), float32."""
    import tests.equivalence as eq
    from tests.tiny_models import FAMILIES, cached_build, load, text_batch

    families = ("bart",) if quick else FAMILIES
    settings = ("greedy", "beam4_ngram3_lp2_minmax_es") if quick else tuple(eq.SETTINGS)
    rows: dict[str, dict] = {}
    notes: list[str] = []

    def check(
        name: str, setting: str, model: torch.nn.Module, batch: Batch, kwargs: dict, **kw: bool
    ) -> None:
        r = eq.check_equivalence(model, get_backend, batch, kwargs, **kw)
        cell = {"agreement": r.agreement, "near_ties": len(r.near_ties), "unexplained": r.mismatches}
        rows.setdefault(name, {})[setting] = cell
        prefix = name if setting == "bench-shape" else f"{name} {setting}"
        notes.extend(f"{prefix}: {x}" for x in r.near_ties + r.mismatches)

    for family in families:
        loaded = load(cached_build(family))
        model = copy.deepcopy(loaded.model).to(device)
        cpu_batch = text_batch(loaded, 4 if quick else 16)
        batch = Batch(cpu_batch.input_ids.to(device), cpu_batch.attention_mask.to(device))
        for name in settings:
            check(family, name, model, batch, eq.SETTINGS[name])
        del model
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
        check(name, "bench-shape", model, batch, kwargs, keep_dtype=True)
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
    sites = sync_sites(lambda: generate(backend, batch, config, sync_every=4))
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


def section_cli(
    device: torch.device, path: Path, texts: list[str], out: Path, quick: bool
) -> tuple[dict, list[str]]:
    """``Generator`` (pinned, non-blocking input copies; ``device_stats``) and ``seqgen generate`` on the device."""
    from seqgen_cli.bench.e2e import cli_flags
    from seqgen_cli.generator import Generator

    dtype = "float32" if device.type == "cpu" else "auto"
    new = 8 if quick else 32
    gen = Generator(str(path), device=str(device), dtype=dtype, num_beams=4, max_new_tokens=new)
    reset_peak(device)
    outputs = gen.generate(texts[:8], batch_size=4)
    stats = gen.device_stats()
    api_ok = len(outputs) == 8 and all(len(o) == 1 for o in outputs)
    del gen
    src, dst, stats_file = out / "cli_input.txt", out / "cli_output.txt", out / "cli_stats.json"
    src.write_text("\n".join(texts[:8]) + "\n", encoding="utf-8")
    flags = {"device": str(device), "dtype": dtype, "num_beams": 4, "max_new_tokens": new, "batch_size": 4}
    cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", str(path), *cli_flags(flags)]
    cmd += ["-q", "--stats", str(stats_file)]
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
