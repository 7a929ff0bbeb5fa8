"""``--workers`` across nodes: a Ray cluster of a head node (the driver's) and worker nodes on this machine, each
raylet with its own CPUs, object store and temporary folder, on loopback (``tests/pipeline/cluster_nodes.py``, run
in a process of its own: a process holds one Ray). Two nodes write the bytes one process writes; a node removed
mid-run (its raylet, workers and object store killed) loses nothing: its shard reruns on another node; the driver's
node cut off for a while resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")  # the ray extra (installed by the test extra)

from tests.helpers import REPO, seqgen, shuffled, write_lines  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster of four raylets and its worker processes

NEW_TOKENS = 6


def one_process(model: Path, src: Path, out: Path) -> bytes:
    res = seqgen(
        "generate",
        "-m",
        str(model),
        str(src),
        "-o",
        str(out),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--batch-size",
        "1",
        "-q",
    )
    assert res.exit_code == 0, res.stderr
    return out.read_bytes()


def on_nodes(model: Path, src: Path, out: Path, *args: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "tests.pipeline.cluster_nodes",
        str(model),
        str(src),
        str(out),
        "--new-tokens",
        str(NEW_TOKENS),
        *args,
    ]
    res = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=600
    )
    lines = res.stdout.decode().strip().splitlines()
    assert res.returncode == 0 and lines, res.stderr.decode()[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def job(tiny_models, tmp_path_factory) -> tuple[Path, Path, bytes]:
    """240 inputs of shuffled lengths on the tiny Marian and the bytes one process writes for them."""
    tmp = tmp_path_factory.mktemp("nodes")
    model = tiny_models("marian")
    src = write_lines(tmp / "in.txt", shuffled(240, seed=21))
    return model, src, one_process(model, src, tmp / "reference.txt")


def test_a_node_removed_mid_run_loses_nothing(job, tmp_path: Path) -> None:
    model, src, reference = job
    out = tmp_path / "out.txt"
    result = on_nodes(model, src, out, "--fault", "remove", "--shard-size", "20")
    assert result["error"] is None, result
    assert "at" in result["fault"], "no worker was seen mid-shard"
    assert out.read_bytes() == reference
    assert result["retried"] >= 1  # the removed node's shard ran again on another node
    (lost,) = [w for w in result["workers"] if w["nodes"][0] == result["fault"]["node"]]
    assert lost["restarts"] == 1  # Ray restarts it on the spare node, should the run last that long


def test_the_drivers_node_cut_off_for_a_while_resumes(job, tmp_path: Path) -> None:
    """The driver's node silent for 20 s (its raylet stopped, the driver waiting), past the cluster's health checks
    (about 5 s here): the cluster takes the node for dead and ends the run's workers; the driver stops with one
    line, its merged outputs written, and ``--resume`` on a new cluster finishes the bytes one process writes.
    (Should the node be back in time, the run goes on: the same bytes.)"""
    model, src, reference = job
    out = tmp_path / "out.txt"
    result = on_nodes(model, src, out, "--fault", "pause", "--pause", "20", "--shard-size", "20")
    assert "at" in result["fault"], result
    if result["error"] is not None:
        assert "took this driver's node for dead" in result["error"] and "--resume" in result["error"], result
        written = out.read_bytes()
        assert written and reference.startswith(written)  # nothing merged is lost
        result = on_nodes(model, src, out, "--resume", "--shard-size", "20")
        assert result["error"] is None, result
    assert out.read_bytes() == reference
