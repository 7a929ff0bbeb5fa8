"""What losing a node costs a ``--workers`` run: the same job on a Ray cluster of a head node and three worker nodes
of one CPU each (``tests/pipeline/cluster_nodes.py``, a fresh cluster per run), with no fault and with the node of
the first worker seen mid-shard removed, interleaved, quiet and beside a busy process. Prints, per arm and state, the
driver's seconds (connect to merged) and the whole process's, median [min-max], and checks each output against one
process's bytes. See docs/BENCHMARKS.md ("A node lost")::

    python scripts/harness/node_loss.py MODEL INPUT [--repeats 3] [--shard-size 40] [--new-tokens 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import hogs, stop  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def one_process(model: str, src: str, out: Path, new_tokens: int) -> bytes:
    cmd = [
        sys.executable,
        "-m",
        "seqgen_cli",
        "generate",
        "-m",
        model,
        src,
        "-o",
        str(out),
        "--max-new-tokens",
        str(new_tokens),
        "--batch-size",
        "1",
        "-q",
    ]
    subprocess.run(cmd, check=True, cwd=REPO)
    return out.read_bytes()


def run(args: argparse.Namespace, fault: str, out: Path) -> tuple[float, float, dict]:
    cmd = [
        sys.executable,
        "-m",
        "tests.pipeline.cluster_nodes",
        args.model,
        args.input,
        str(out),
        "--fault",
        fault,
        "--shard-size",
        str(args.shard_size),
        "--new-tokens",
        str(args.new_tokens),
    ]
    t0 = time.perf_counter()
    res = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, check=True
    )
    whole = time.perf_counter() - t0
    result = json.loads(res.stdout.decode().strip().splitlines()[-1])
    return result["seconds"], whole, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("input")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-size", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="node-loss-"))
    reference = one_process(args.model, args.input, tmp / "reference.txt", args.new_tokens)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    retried: dict[tuple[str, str], list[int]] = {}
    for state in ("quiet", "loaded"):
        for rnd in range(args.repeats):
            for fault in ("none", "remove"):
                busy = hogs(1) if state == "loaded" else []
                try:
                    out = tmp / f"{state}-{fault}-{rnd}.txt"
                    driver, whole, result = run(args, fault, out)
                finally:
                    stop(busy)
                assert result["error"] is None and out.read_bytes() == reference, result
                times.setdefault((fault, state), []).append((driver, whole))
                retried.setdefault((fault, state), []).append(result.get("retried", 0))
    print(
        f"{len(os.sched_getaffinity(0))} cores; 1-min load {os.getloadavg()[0]:.2f} at the end; outputs identical"
    )
    for (fault, state), pairs in sorted(
        times.items(), key=lambda kv: (kv[0][1] != "quiet", kv[0][0] != "none")
    ):
        cells = []
        for k, what in ((0, "driver"), (1, "process")):
            xs = [p[k] for p in pairs]
            cells.append(f"{what} {statistics.median(xs):.1f} s [{min(xs):.1f}-{max(xs):.1f}]")
        print(f"{fault:<7} {state:<7} {'  '.join(cells)}  retried shards {retried[(fault, state)]}")


if __name__ == "__main__":
    main()
