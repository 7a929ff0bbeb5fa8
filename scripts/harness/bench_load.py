"""Load collapse: whole ``seqgen generate`` processes, and CTranslate2's plain script, on a
quiet box and with competing CPU-bound processes (``python -c "while True: pass"``, started and killed by this
script by their pids), the arms interleaved and rotated per round, medians and spread, ratio loaded / quiet.

Arms, each an environment: "-" runs with none of ``OMP_VARS`` set (seqgen as shipped: ``OMP_WAIT_POLICY=PASSIVE``,
``seqgen_cli/openmp.py``; CTranslate2 with its defaults), ``GOMP_SPINCOUNT=300000`` is libgomp's own default
when no wait policy is set (seqgen before the fix: a user's setting is kept), ``OMP_NUM_THREADS=1`` one thread.
Besides wall time: the decode time (seqgen's ``--stats`` ``generate_seconds``; CTranslate2's ``translate_batch``) and every run's CPU time (user +
system, from ``getrusage``; idle OpenMP threads that spin show up there). From the repository root
(``scripts/harness/make_bench_models.py marian-base`` builds the model)::

    python scripts/harness/bench_load.py ~/.cache/seqgen-bench/marian-base ../shared/data/wmt/en-de/newstest2014.en \
        --n 32 --beams 4 --new-tokens 48

NLLB (``make_bench_models.py nllb-600m``): ``--target-lang fra_Latn --hf`` (``generate()`` as a third system).

Variable lengths: ``--eos-bias 1.8`` on ``bart-base`` (no ``--new-tokens``: the checkpoint's 56-142 tokens).

Every run is logged on stderr with the load average (1, 5, 15 min) just before it; on a shared box the
"quiet" column is not quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Arms: environment settings, "VAR=VALUE[,VAR=VALUE]"; "-" runs with none of OMP_VARS set.
SEQGEN_ARMS = ["-", "GOMP_SPINCOUNT=300000", "OMP_NUM_THREADS=1"]
CT2_ARMS = ["-"]
OMP_VARS = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "KMP_BLOCKTIME",
    "MKL_NUM_THREADS",
    "SEQGEN_OMP_SET",
)
STATES = ("quiet", "loaded")


@dataclass
class Arm:
    """One system under one environment: its command, where it writes, and (seqgen) its ``--stats`` file."""

    cmd: list[str]
    env: dict[str, str]
    output: Path
    stats: Path | None = None


@dataclass
class Run:
    """One timed run: wall, decode (seqgen's ``generate_seconds``) and CPU seconds, load averages before."""

    arm: str
    state: str
    round: int
    seconds: float
    decode_seconds: float | None
    cpu_seconds: float
    loadavg: tuple[float, float, float]
    peak_mib: float = 0.0  # the process's peak resident memory


def hogs(n: int) -> list[subprocess.Popen]:
    """``n`` CPU-bound processes (one busy loop each)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill and reap the processes this script started (by their pids)."""
    for p in procs:
        p.kill()
        p.wait()


def arm_env(base: dict[str, str], arm: str) -> dict[str, str]:
    """``base`` with the arm's settings ("VAR=VALUE[,VAR=VALUE]"; "-": none)."""
    return dict(base, **dict(kv.split("=", 1) for kv in arm.split(",") if arm != "-"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint folder")
    ap.add_argument("source", help="text file, one input per line")
    ap.add_argument("--n", type=int, default=32, help="inputs (the first N lines)")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument(
        "--new-tokens", type=int, help="exactly this many (min = max); default: the model's settings"
    )
    ap.add_argument("--batch-size", type=int, default=32, help="both systems")
    ap.add_argument(
        "--dtype", default="float32", help="both systems: float32 or int8 (CTranslate2's compute type)"
    )
    ap.add_argument(
        "--seqgen-dtypes", nargs="*", help="seqgen's dtypes, each its own arm (default: --dtype)"
    )
    ap.add_argument(
        "--max-source-length", type=int, help="both systems: truncate sources to this many tokens"
    )
    ap.add_argument(
        "--eos-bias", type=float,
        help="run the model with this EOS logit bias (final_logits_bias, BART family; built once next to it by "
        "scripts/harness/_common.spread_checkpoint): outputs stop at their own, spread lengths",
    )  # fmt: skip
    ap.add_argument("--target-lang", help="both systems: the target language code (NLLB fra_Latn)")
    ap.add_argument(
        "--hf", action="store_true", help="also generate() as a whole process (seqgen generate --backend hf)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--arms", nargs="*", default=SEQGEN_ARMS, help="seqgen's: VAR=VALUE[,VAR=VALUE], - for none"
    )
    ap.add_argument(
        "--ct2-arms", nargs="*", default=CT2_ARMS, help="CTranslate2's, the same way (none: left out)"
    )
    ap.add_argument("--hogs", type=int, default=1, help="competing busy loops when loaded")
    ap.add_argument("--json", help="write every run here")
    args = ap.parse_args()
    if args.eos_bias is not None:
        from _common import spread_checkpoint

        base = Path(args.model).expanduser().resolve()
        dest = base.parent / f"{base.name}-bias{args.eos_bias:g}"
        args.model = str(spread_checkpoint(str(base), [], 0.0, {}, dest, args.eos_bias))
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="seqgen-load-") as tmp:
        src = Path(tmp, "in.txt")
        with open(args.source, encoding="utf-8") as f:
            src.write_text("".join(line for _, line in zip(range(args.n), f, strict=False)), encoding="utf-8")
        arms = seqgen_arms(args, env, src, tmp)
        if args.ct2_arms:
            arms.update(ct2_arms(args, env, src, tmp))
        runs, outputs = measure(arms, args)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1), encoding="utf-8")
    print_table(runs, outputs, args)


def seqgen_arms(args: argparse.Namespace, env: dict[str, str], src: Path, tmp: str) -> dict[str, Arm]:
    """``seqgen generate`` under each of ``args.arms``."""
    flags = ["--num-beams", str(args.beams), "--batch-size", str(args.batch_size), "-q"]
    flags += ["--max-source-length", str(args.max_source_length)] if args.max_source_length else []
    flags += ["--target-lang", args.target_lang] if args.target_lang else []
    if args.new_tokens:
        flags += ["--max-new-tokens", str(args.new_tokens), "--min-new-tokens", str(args.new_tokens)]
    arms = {}
    dtypes = args.seqgen_dtypes or [args.dtype]
    for i, (dtype, arm) in enumerate((d, a) for d in dtypes for a in args.arms):
        out, stats = Path(tmp, f"seqgen{i}.txt"), Path(tmp, f"seqgen{i}.json")
        cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", args.model, str(src), "-o", str(out)]
        name = "seqgen" + (f" {dtype}" if args.seqgen_dtypes else "") + ("" if arm == "-" else f" {arm}")
        arms[name] = Arm([*cmd, *flags, "--dtype", dtype, "--stats", str(stats)], arm_env(env, arm), out, stats)
    flags += ["--dtype", args.dtype]
    if args.hf:
        out, stats = Path(tmp, "hf.txt"), Path(tmp, "hf.json")
        cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", args.model, str(src), "-o", str(out)]
        cmd += [*flags, "--backend", "hf", "--stats", str(stats)]
        arms["generate() (--backend hf)"] = Arm(cmd, arm_env(env, "-"), out, stats)
    return arms


def ct2_arms(args: argparse.Namespace, env: dict[str, str], src: Path, tmp: str) -> dict[str, Arm]:
    """CTranslate2's plain script (``seqgen_cli.bench.baselines ct2``, as ``seqgen bench --mode e2e`` runs it)
    with the settings seqgen resolves, under each of ``args.ct2_arms``; the conversion is cached."""
    from seqgen_cli.bench import ct2
    from seqgen_cli.generator import Generator

    fixed = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens} if args.new_tokens else {}
    if args.max_source_length:
        fixed["max_source_length"] = args.max_source_length
    gen = Generator(args.model, device="cpu", num_beams=args.beams, target_lang=args.target_lang, **fixed)
    path = ct2.convert(args.model)
    out, stats = Path(tmp, "ct2.txt"), Path(tmp, "ct2.json")
    cmd = [sys.executable, "-m", "seqgen_cli.bench.baselines", "ct2", "--model", args.model]
    cmd += ["--ct2-model", str(path), "--input", str(src), "--output", str(out)]
    cmd += ["--settings", json.dumps(asdict(ct2.plan_for(gen, path))), "--batch-size", str(args.batch_size)]
    cmd += ["--compute-type", args.dtype, "--stats", str(stats)]
    cmd += ["--max-source-length", str(gen.max_source_length)] if gen.max_source_length else []
    cmd += ["--prefix", gen.prefix] if gen.prefix else []
    names = {arm: "ctranslate2" + (" (its defaults)" if arm == "-" else f" {arm}") for arm in args.ct2_arms}
    return {name: Arm(cmd, arm_env(env, arm), out, stats) for arm, name in names.items()}


def measure(arms: dict[str, Arm], args: argparse.Namespace) -> tuple[list[Run], dict[str, list[str]]]:
    """Every arm once per state per round; the state order alternates and the arm order rotates per round.
    Returns the runs and each arm's output lines (from its first run)."""
    runs: list[Run] = []
    outputs: dict[str, list[str]] = {}
    names = list(arms)
    for r in range(args.rounds):
        for state in STATES if r % 2 == 0 else STATES[::-1]:
            busy = hogs(args.hogs) if state == "loaded" else []
            try:
                time.sleep(1.0 if busy else 0.0)  # the busy loops are running
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    runs.append(run_once(arms[name], name, state, r + 1))
                    outputs.setdefault(name, arms[name].output.read_text(encoding="utf-8").splitlines())
                    x = runs[-1]
                    decode = f", decode {x.decode_seconds:.2f} s" if x.decode_seconds is not None else ""
                    print(f"round {r + 1} {state}: {name}: {x.seconds:.2f} s{decode}, CPU {x.cpu_seconds:.2f} s "
                          f"(load average {' '.join(f'{v:.2f}' for v in x.loadavg)})", file=sys.stderr, flush=True)  # fmt: skip
            finally:
                stop(busy)
    return runs, outputs


def run_once(arm: Arm, name: str, state: str, rnd: int) -> Run:
    """One run of ``arm``: its wall, decode and CPU seconds and its peak resident memory (the process's own
    rusage, ``os.wait4``)."""
    load = os.getloadavg()
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(arm.cmd, env=arm.env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        if (code := os.waitstatus_to_exitcode(status)) != 0:
            err.seek(0)
            tail = " | ".join(err.read().decode(errors="replace").strip().splitlines()[-3:])
            raise SystemExit(f"bench_load: {name} exited with {code}: {tail}")
    decode = json.loads(arm.stats.read_text())["generate_seconds"] if arm.stats else None
    cpu = usage.ru_utime + usage.ru_stime
    return Run(name, state, rnd, seconds, decode, cpu, load, usage.ru_maxrss / 1024)


def print_table(runs: list[Run], outputs: dict[str, list[str]], args: argparse.Namespace) -> None:
    """The markdown table; output tokens per input: the outputs' lines tokenized again (special tokens in)."""
    from transformers import AutoTokenizer

    names = list(outputs)
    first = outputs[names[0]]
    loads = {s: [r.loadavg[0] for r in runs if r.state == s] for s in STATES}
    size = f"{args.new_tokens} new tokens" if args.new_tokens else "the model's length settings"
    print(f"`python scripts/harness/bench_load.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`  ")
    print(
        f"{args.n} inputs, beam {args.beams}, {size}, batch {args.batch_size}, {args.rounds} rounds, "
        f"{args.hogs} competing busy loop(s) when loaded, {len(os.sched_getaffinity(0))} cores; 1-min load "
        f"average just before the runs: quiet {min(loads['quiet']):.1f}-{max(loads['quiet']):.1f}, "
        f"loaded {min(loads['loaded']):.1f}-{max(loads['loaded']):.1f}. Seconds: median (min-max).\n"
    )
    print("| system | whole process, quiet | loaded | loaded / quiet | decode, quiet | loaded "
          "| loaded / quiet | CPU s, quiet | loaded | peak MiB | outputs = first row's | output tokens per input |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    for name in names:
        mine = {s: [r for r in runs if r.arm == name and r.state == s] for s in STATES}
        cells = []
        for field in ("seconds", "decode_seconds", "cpu_seconds"):
            t = {s: [getattr(r, field) for r in mine[s]] for s in STATES}
            if None in t["quiet"]:
                cells += ["-", "-"] + (["-"] if field != "cpu_seconds" else [])
                continue
            cells += [_spread(t["quiet"]), _spread(t["loaded"])]
            if field != "cpu_seconds":
                cells.append(f"{statistics.median(t['loaded']) / statistics.median(t['quiet']):.2f}")
        cells.append(f"{statistics.median(r.peak_mib for r in mine['quiet'] + mine['loaded']):.0f}")
        same = sum(a == b for a, b in zip(first, outputs[name], strict=True))
        tokens = statistics.mean(len(tokenizer(line)["input_ids"]) for line in outputs[name])
        print(f"| {name} | {' | '.join(cells)} | {same}/{len(first)} | {tokens:.1f} |")


def _spread(t: list[float]) -> str:
    return f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})"


if __name__ == "__main__":
    main()
