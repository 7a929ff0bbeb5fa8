"""Where a checked ``seqgen generate`` job runs (``pipeline/launch.py``): the ``--workers`` flags checked
before anything is read, and a run in this process with the notes said before it (none under ``--quiet``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline.cluster import ClusterOptions
from seqgen_cli.pipeline.job import JobOptions, check_job
from seqgen_cli.pipeline.launch import cluster_options, run_job
from tests.helpers import FakeGen, expected, write_lines

NO_FLAGS = {"address": None, "gpus_per_worker": None, "cpus_per_worker": None, "shard_size": None}


def test_no_workers_runs_in_this_process() -> None:
    assert cluster_options(None, NO_FLAGS, verify=8) is None


def test_workers_take_the_flags_given() -> None:
    flags = {**NO_FLAGS, "gpus_per_worker": 0.5, "shard_size": 100}
    assert cluster_options(2, flags, verify=None) == ClusterOptions(2, gpus_per_worker=0.5, shard_size=100)
    assert cluster_options(2, NO_FLAGS, verify=0) == ClusterOptions(2)  # --verify 0: off


def test_a_cluster_flag_needs_workers() -> None:
    with pytest.raises(SeqgenError, match="^--cpus-per-worker needs --workers N$"):
        cluster_options(None, {**NO_FLAGS, "cpus_per_worker": 2.0, "shard_size": 10}, verify=None)


def test_verify_runs_in_one_process() -> None:
    with pytest.raises(SeqgenError, match="^--verify runs in one process: not with --workers$"):
        cluster_options(2, {**NO_FLAGS, "address": "auto"}, verify=8)


class _Gen(FakeGen):
    """A generator whose backend runs without lanes, as a Generator built without them says."""

    fallback = None
    refill = False


@pytest.mark.parametrize("quiet", [False, True])
def test_a_run_in_this_process_says_its_notes_first(tmp_path: Path, quiet: bool) -> None:
    texts = ["a dog ran", "the plan"]
    src, out = write_lines(tmp_path / "in.txt", texts), tmp_path / "out.txt"
    gen = _Gen()
    spec = SimpleNamespace(model=str(tmp_path / "no-model"), generation={}, refill=True, build=lambda: gen)
    notes: list[str] = []
    job = check_job([str(src)], str(out), JobOptions())
    summary, max_source_length = run_job(spec, job, None, quiet=quiet, note=notes.append)
    assert summary.error is None and not summary.interrupted and max_source_length is None
    assert out.read_text(encoding="utf-8") == expected(texts)
    refill = "seqgen: note: --refill does not run here: transformers generate() runs this model; batches run"
    assert notes == ([] if quiet else [notes[0]]) and all(n.startswith(refill) for n in notes)
