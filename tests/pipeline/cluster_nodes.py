"""A Ray cluster of several nodes on this machine for ``--workers``' node faults (``tests/pipeline/test_nodes.py``,
``scripts/harness/node_loss.py``): ``ray.cluster_utils.Cluster`` starts a head node with no CPUs (the driver's
node: no worker runs beside it) and worker nodes of one CPU each, every raylet with its own object store and
temporary folder, every address on loopback. Run apart from other Ray tests (a process has one Ray):

    python -m tests.pipeline.cluster_nodes MODEL INPUT OUTPUT --fault remove|pause|none [--nodes 3]

runs ``seqgen generate --workers 2`` as its driver and prints one JSON line: the run's summary (retried shards,
workers, seconds) and what the fault did. ``remove``: the node of the first worker seen mid-shard is removed (its
raylet, its workers and its object store killed); ``pause``: the driver's node goes silent for ``--pause`` seconds
once a shard is merged (its raylet stopped with ``SIGSTOP``, the driver's loop waiting), then continues (past about
5 s the cluster takes it for dead: :data:`HEALTH_CHECKS`); ``none``: no fault. Every process stopped or killed is
one this script's cluster started, by its id.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback addresses (read at Ray's import)

import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from seqgen_cli.generator import GeneratorSpec  # noqa: E402
from seqgen_cli.pipeline.cluster import ClusterOptions  # noqa: E402
from seqgen_cli.pipeline.driver import generate_distributed  # noqa: E402
from seqgen_cli.pipeline.job import JobOptions, check_job  # noqa: E402

OBJECT_STORE = 80 << 20  # per node: parts are small
# The GCS takes a node for dead after this many missed health checks, this often: about 5 s (Ray's defaults: 5
# every 3 s), so a pause of --pause 15 is a node cut off.
HEALTH_CHECKS = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 5,
}


def raylet_pid(node: Any) -> int:
    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def start(nodes: int, root: Path, health_checks: dict[str, int]) -> Cluster:
    """The head (the driver's node, no CPUs) and ``nodes`` worker nodes, each in its own temporary folder."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=0,
            object_store_memory=OBJECT_STORE,
            include_dashboard=False,
            _system_config=health_checks,
            temp_dir=str(root / "ray"),
        ),  # RAY_TMPDIR/ray: its "current cluster" file
    )
    for i in range(nodes):
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE, temp_dir=str(root / f"node{i}"))
    cluster.wait_for_nodes()
    return cluster


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="seqgen-nodes-"))
    os.environ["RAY_TMPDIR"] = str(root)  # Ray's "current cluster" file too: not the machine's /tmp/ray
    cluster = start(args.nodes, root, HEALTH_CHECKS)
    fault: dict[str, Any] = {"kind": args.fault}

    def events(kind: str, info: dict[str, Any]) -> None:
        if args.fault == "remove" and kind == "progress" and info["done"] > 0 and "at" not in fault:
            raylet = parent_pid(info["pid"])  # a worker process is its node's raylet's child
            node = next(n for n in cluster.worker_nodes if raylet_pid(n) == raylet)
            fault.update(at=time.monotonic() - t0, node=node.node_id, seq=info["seq"])
            cluster.remove_node(node, allow_graceful=False)
        if (
            args.fault == "pause" and kind == "merged" and "at" not in fault
        ):  # the node silent: raylet and driver
            pid = raylet_pid(cluster.head_node)
            fault.update(at=time.monotonic() - t0, seconds=args.pause)
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(args.pause)  # the driver's loop waits here: it hears nothing either
            finally:
                os.kill(pid, signal.SIGCONT)

    opts = JobOptions(batch_size=args.batch_size, resume=args.resume)
    spec = GeneratorSpec(model=args.model, generation={"max_new_tokens": args.new_tokens})
    options = ClusterOptions(workers=2, address=cluster.address, shard_size=args.shard_size)
    t0 = time.monotonic()
    try:
        summary = generate_distributed(
            spec, check_job([args.input], args.output, opts), options, events=events
        )
        result = dict(
            error=summary.error,
            seconds=time.monotonic() - t0,
            inputs=summary.inputs,
            retried=summary.distributed["retried_shards"],
            workers=summary.distributed["workers"],
        )
    except Exception as err:  # noqa: BLE001 - told to the test as data
        result = dict(error=f"{type(err).__name__}: {err}", seconds=time.monotonic() - t0)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return {**result, "fault": fault}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--fault", choices=["remove", "pause", "none"], default="none")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--shard-size", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    logging.getLogger("ray").setLevel(logging.ERROR)
    print(json.dumps(run(args)), file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
