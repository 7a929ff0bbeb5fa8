"""`seqgen generate --workers N` on a local Ray (one cluster for the session): same bytes as one process,
a lost worker, a lost driver, a bad line in a late shard, --on-error skip across workers."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback (read at import)
ray = pytest.importorskip("ray")  # the ray extra (installed by the test extra)

from seqgen_cli.errors import SeqgenError  # noqa: E402
from seqgen_cli.generator import GeneratorSpec  # noqa: E402
from seqgen_cli.pipeline.cluster import ClusterOptions  # noqa: E402
from seqgen_cli.pipeline.driver import generate_distributed  # noqa: E402
from seqgen_cli.pipeline.formats import index_path, parts_dir, read_index  # noqa: E402
from seqgen_cli.pipeline.job import JobOptions, check_job  # noqa: E402
from tests.helpers import seqgen, shuffled, write_lines  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray cluster and its worker processes

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 6
BATCH = 8
ARGS = ["--max-new-tokens", str(NEW_TOKENS), "--batch-size", str(BATCH), "-q"]


@pytest.fixture(scope="session")
def ray_address() -> str:
    """One local Ray for the whole session (2 CPUs, loopback, no dashboard): its address."""
    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False,
        logging_level=logging.ERROR,
    )  # fmt: skip
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:"), address
    yield address
    ray.shutdown()


@pytest.fixture(scope="module")
def marian(tiny_models) -> Path:
    return tiny_models("marian")


def one_process(model: Path, src: Path, out: Path, *more: str) -> bytes:
    res = seqgen("generate", "-m", str(model), str(src), "-o", str(out), *ARGS, *more)
    assert res.exit_code == 0, res.stderr
    return out.read_bytes()


def distributed(model: Path, src: Path, out: Path, shard_size: int, events=None, **job):
    opts = JobOptions(**{"batch_size": BATCH, **job})
    spec = GeneratorSpec(model=str(model), generation={"max_new_tokens": NEW_TOKENS})
    cluster = ClusterOptions(workers=2, shard_size=shard_size)
    return generate_distributed(spec, check_job([str(src)], str(out), opts), cluster, events=events)


@pytest.fixture(scope="module")
def job(marian: Path, tmp_path_factory) -> tuple[Path, bytes]:
    """160 inputs of shuffled lengths and the output one process writes for them."""
    tmp = tmp_path_factory.mktemp("dist")
    src = write_lines(tmp / "in.txt", shuffled(160, seed=11))
    return src, one_process(marian, src, tmp / "reference.txt")


@pytest.mark.parametrize("shard_size", [7, 1000])  # (16, 80 and 10 below)
def test_two_workers_write_the_bytes_one_process_writes(
    ray_address, marian: Path, job, tmp_path: Path, shard_size: int
) -> None:
    src, reference = job
    out, stats = tmp_path / "out.txt", tmp_path / "stats.json"
    summary = distributed(marian, src, out, shard_size, stats=str(stats))
    assert summary.error is None and not summary.interrupted
    assert out.read_bytes() == reference
    assert not index_path(out).exists() and not parts_dir(str(out)).exists()  # merged parts are deleted
    data = json.loads(stats.read_text())
    dist = data["distributed"]
    assert data["inputs"] == 160 and dist["shards"] == -(-160 // shard_size)
    assert len(dist["workers"]) == 2 and sum(w["shards"] for w in dist["workers"]) == dist["shards"]
    assert sum(w["inputs"] for w in dist["workers"]) == 160
    if shard_size == 7:  # 23 shards: both workers took some, and report their throughput
        assert all(w["shards"] > 0 and w["samples_per_second"] > 0 for w in dist["workers"])


def test_a_killed_worker_is_replaced_and_the_output_is_complete(
    ray_address, marian: Path, tmp_path: Path
) -> None:
    # shards of 40 finish between two polls; 3 x 320 inputs one at a time take seconds each, so the
    # driver sees one under way (whichever it polls first)
    src = write_lines(tmp_path / "in.txt", shuffled(960, seed=12))
    reference = one_process(marian, src, tmp_path / "reference.txt")
    out = tmp_path / "out.txt"
    killed: list[int] = []

    def kill_one_worker_mid_shard(kind: str, info: dict) -> None:
        if kind == "progress" and not killed and info["done"] > 0:
            os.kill(info["pid"], signal.SIGKILL)  # a worker process this run started (pid it reported)
            killed.append(info["pid"])

    summary = distributed(marian, src, out, 320, events=kill_one_worker_mid_shard, batch_size=1)
    assert killed, "no worker was seen mid-shard"
    assert summary.error is None
    assert out.read_bytes() == reference
    dist = summary.distributed
    assert dist["retried_shards"] >= 1
    assert [w["restarts"] for w in dist["workers"] if killed[0] in w["pids"]] == [1]


def merged_shards(out: Path) -> int:
    """The inputs the driver's index records, 0 before its header is written (the file exists from its open)."""
    try:
        return read_index(out)[1].done if index_path(out).exists() else 0
    except SeqgenError:  # created, header not yet written
        return 0


def test_a_killed_driver_resumes_where_it_stopped(ray_address, marian: Path, job, tmp_path: Path) -> None:
    src, reference = job
    out = tmp_path / "out.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable, "-m", "seqgen_cli", "generate", "-m", str(marian), str(src), "-o", str(out), *ARGS,
        "--workers", "2", "--address", ray_address, "--shard-size", "16",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 150
        while merged_shards(out) == 0:  # a shard is merged and recorded
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no shard merged"
            time.sleep(0.05)
    finally:
        proc.kill()  # the driver this test started
        proc.wait()
    merged, recorded = out.read_bytes(), read_index(out)[1].done  # the index may lag the output by a shard
    assert merged and reference.startswith(merged) and merged != reference
    assert 0 < recorded <= merged.count(b"\n")
    summary = distributed(marian, src, out, 16, resume=True)
    assert summary.error is None
    assert summary.resumed_from == recorded  # recorded shards are not generated again
    assert out.read_bytes() == reference
    assert not index_path(out).exists() and not parts_dir(str(out)).exists()


def test_a_bad_line_in_a_late_shard_names_its_line_then_skip_and_resume(
    ray_address, marian: Path, tmp_path: Path
) -> None:
    texts = shuffled(60, seed=3)
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts)]
    good = write_lines(tmp_path / "good.jsonl", lines)
    reference = one_process(marian, good, tmp_path / "reference.jsonl", "--output-format", "jsonl")
    bad_lines = list(lines)
    bad_lines[46] = '{"id": 46, "text": "unterminated'
    src = write_lines(tmp_path / "in.jsonl", bad_lines)
    workers = ["--workers", "2", "--shard-size", "10", "--output-format", "jsonl"]
    out = tmp_path / "out.jsonl"
    res = seqgen("generate", "-m", str(marian), str(src), "-o", str(out), *ARGS, *workers)
    assert res.exit_code == 2
    assert (
        f"{src}:47: invalid JSON" in res.stderr and "the outputs for the first 46 inputs are in" in res.stderr
    )
    assert out.read_bytes() == b"".join(reference.splitlines(keepends=True)[:46])
    # --on-error skip, to stdout: the bad line becomes an error object, everything else as one process
    res = seqgen("generate", "-m", str(marian), str(src), *ARGS, *workers, "--on-error", "skip")
    assert res.exit_code == 0, res.stderr
    got = res.stdout.splitlines()
    assert len(got) == 60 and "invalid JSON" in json.loads(got[46])["error"]
    want = reference.decode().splitlines()
    assert got[:46] == want[:46] and got[47:] == want[47:]
    # fixed, the failed run resumes from the line it stopped at
    write_lines(src, lines)
    res = seqgen("generate", "-m", str(marian), str(src), "-o", str(out), *ARGS, *workers, "--resume")
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes() == reference


def test_one_of_n_drivers_writes_its_shard(ray_address, marian: Path, job, tmp_path: Path) -> None:
    """``--shard 1/2 --workers 2`` (one driver per machine, say): the second half of the one-process run."""
    src, reference = job
    out = tmp_path / "half.txt"
    summary = distributed(marian, src, out, 16, shard=(1, 2))
    assert summary.error is None and summary.inputs == 80
    assert out.read_bytes() == b"".join(reference.splitlines(keepends=True)[80:])
    first = tmp_path / "first-half.txt"  # its other half, by one process: the two parts merge
    one_process(marian, src, first, "--shard", "0/2")
    res = seqgen("merge", str(out), str(first), "-o", str(tmp_path / "all.txt"))
    assert res.exit_code == 2 and "parts out of order" in res.stderr
    res = seqgen("merge", str(first), str(out), "-o", str(tmp_path / "all.txt"))
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "all.txt").read_bytes() == first.read_bytes() + out.read_bytes()
