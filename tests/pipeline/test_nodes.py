"""``--workers`` across nodes: a Ray cluster of a head node (the driver's) and worker nodes on this machine, each
raylet with its own CPUs, object store and temporary folder, on loopback (``tests/pipeline/cluster_nodes.py``, run
in a process of its own: a process holds one Ray). Two nodes write the bytes one process writes; a node removed
mid-run (its raylet, workers and object store killed) loses nothing: its shard reruns on another node; the driver's
node paused for a while goes on where it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")  # the ray extra (installed by the test extra)

from tests.helpers import REPO, seqgen, write_lines  # noqa: E402
from tests.pipeline.test_cluster import shuffled  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster of four raylets and its worker processes

NEW_TOKENS = 6


def one_process(model: Path, src: Path, out: Path) -> bytes:
    res = seqgen("generate", "-m", str(model), str(src), "-o", str(out), "--max-new-tokens", str(NEW_TOKENS),
                 "--batch-size", "1", "-q")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    return out.read_bytes()


def on_nodes(model: Path, src: Path, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "tests.pipeline.cluster_nodes", str(model), str(src), str(out),
           "--new-tokens", str(NEW_TOKENS), *args]  # fmt: skip
    res = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=600)
    lines = res.stdout.decode().strip().splitlines()
    assert res.returncode == 0 and lines, res.stderr.decode()[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def job(tiny_models, tmp_path_factory) -> tuple[Path, Path, bytes]:
    """480 inputs of shuffled lengths on the tiny Marian and the bytes one process writes for them."""
    tmp = tmp_path_factory.mktemp("nodes")
    model = tiny_models("marian")
    src = write_lines(tmp / "in.txt", shuffled(480, seed=21))
    return model, src, one_process(model, src, tmp / "reference.txt")


def test_a_node_removed_mid_run_loses_nothing(job, tmp_path: Path) -> None:
    model, src, reference = job
    out = tmp_path / "out.txt"
    result = on_nodes(model, src, out, "--fault", "remove", "--shard-size", "40")
    assert result["error"] is None, result
    assert "at" in result["fault"], "no worker was seen mid-shard"
    assert out.read_bytes() == reference
    assert result["retried"] >= 1  # the removed node's shard ran again on another node
    nodes = {w["node"] for w in result["workers"]}
    assert len(nodes) >= 2 and result["fault"]["node"] in nodes


def test_the_drivers_node_paused_for_a_while_goes_on(job, tmp_path: Path) -> None:
    model, src, reference = job
    out = tmp_path / "out.txt"
    result = on_nodes(model, src, out, "--fault", "pause", "--pause", "3", "--shard-size", "40")
    assert result["error"] is None and "at" in result["fault"], result
    assert out.read_bytes() == reference
