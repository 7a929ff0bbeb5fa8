"""`seqgen generate` end to end on a tiny BART: pipes, SIGKILL/SIGINT and --resume, memory, scoring."""

from __future__ import annotations

import builtins
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seqgen_cli.pipeline.formats import index_path
from tests.helpers import seqgen
from tests.tiny_models import sample_texts

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--max-new-tokens", "4", "--batch-size", "1", "-q"]  # batch 1: batching cannot change a token


def spawn(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "seqgen_cli", "generate", *args]
    # A shell's background job inherits SIGINT ignored (and Python then keeps ignoring it): undo that.
    reset = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, preexec_fn=reset, **kw)


def index_done(out: Path) -> int:
    try:
        lines = index_path(out).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return 0
    entries = [json.loads(x) for x in lines[1:] if x.endswith("}")]
    return entries[-1]["done"] if entries else 0


@pytest.fixture(scope="module")
def bart(tiny_models) -> Path:
    return tiny_models("bart")


@pytest.fixture(scope="module")
def job(bart: Path, tmp_path_factory) -> tuple[Path, bytes, Path]:
    """An input file, the output of an uninterrupted run, and that run's --stats (scored with BLEU)."""
    tmp = tmp_path_factory.mktemp("job")
    src = tmp / "in.txt"
    src.write_text("".join(t + "\n" for t in sample_texts(30, seed=5)), encoding="utf-8")
    out, stats = tmp / "reference.txt", tmp / "stats.json"
    more = ["--reference", str(src), "--metrics", "bleu", "--stats", str(stats)]
    res = seqgen("generate", "-m", str(bart), str(src), "-o", str(out), *ARGS, *more)
    assert res.exit_code == 0, res.stderr
    assert "BLEU" in res.stderr and not index_path(out).exists()
    return src, out.read_bytes(), stats


def start_and_wait_for_progress(bart: Path, src: Path, out: Path) -> subprocess.Popen:
    """Feed all but the last 5 inputs through a pipe left open (so the run cannot finish), and wait
    until the index shows outputs written."""
    proc = spawn("-m", str(bart), "-o", str(out), *ARGS, stdin=subprocess.PIPE)
    lines = src.read_bytes().splitlines(keepends=True)
    proc.stdin.write(b"".join(lines[:-5]))
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while index_done(out) == 0:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)
    return proc


@pytest.mark.slow
def test_sigkill_then_resume_is_byte_identical(bart: Path, job, tmp_path: Path) -> None:
    src, reference, _ = job
    out = tmp_path / "out.txt"
    proc = start_and_wait_for_progress(bart, src, out)
    proc.kill()
    proc.wait()
    killed = out.read_bytes()
    assert killed.endswith(b"\n") and reference.startswith(killed)  # whole lines only
    assert index_path(out).exists()
    # The killed run read stdin; resuming from the file is fine: the inputs' digest is what is checked.
    res = seqgen("generate", "-m", str(bart), str(src), "-o", str(out), "--resume", *ARGS)
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes() == reference
    assert not index_path(out).exists()


@pytest.mark.slow
def test_sigint_writes_what_is_done_says_how_to_resume_and_exits_130(bart: Path, job, tmp_path: Path) -> None:
    src, reference, _ = job
    out = tmp_path / "out.txt"
    proc = start_and_wait_for_progress(bart, src, out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err and str(out) in err
    done = out.read_bytes()
    n = done.count(b"\n")
    assert f"first {n} inputs" in err and reference.startswith(done) and n < reference.count(b"\n")
    res = seqgen("generate", "-m", str(bart), str(src), "-o", str(out), "--resume", *ARGS)
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes() == reference


def _readline(stream, timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no output within {timeout}s"
    return stream.readline()


@pytest.mark.slow
def test_stdin_to_stdout_streams_through_a_real_pipe(bart: Path, job) -> None:
    src, reference, _ = job
    texts = src.read_text(encoding="utf-8").splitlines()[:2]
    proc = spawn("-m", str(bart), *ARGS, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        proc.stdin.write(texts[0].encode() + b"\n")
        proc.stdin.flush()
        first = _readline(proc.stdout, 120)  # while the input is still open
        proc.stdin.write(texts[1].encode() + b"\n")
        proc.stdin.flush()
        second = _readline(proc.stdout, 60)
        assert first + second == b"".join(reference.splitlines(keepends=True)[:2])
        proc.send_signal(signal.SIGINT)  # Ctrl-C while waiting for more input
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "first 2 inputs are in stdout" in err.decode() and "cannot be resumed" in err.decode()


@pytest.mark.slow
def test_head_closing_the_pipe_is_not_an_error(bart: Path, job, tmp_path: Path) -> None:
    src, reference, _ = job
    short = tmp_path / "short.txt"
    short.write_bytes(b"".join(src.read_bytes().splitlines(keepends=True)[:6]))
    src = short
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = f"{sys.executable} -m seqgen_cli generate -m {bart} {src} {' '.join(ARGS)} | head -n 2"
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], env=env, capture_output=True, timeout=120)
    assert res.stdout == b"".join(reference.splitlines(keepends=True)[:2])
    assert res.returncode == 0 and res.stderr == b"", res.stderr


def test_reference_scored_and_stats_written(job) -> None:
    src, reference, stats = job
    data = json.loads(stats.read_text())
    assert data["metrics"]["lines"] == 30 and "score" in data["metrics"]["bleu"]
    assert data["inputs"] == 30 and data["samples_per_second"] > 0 and data["generate_seconds"] > 0
    assert data["interrupted"] is False and data["error"] is None and 0 <= data["padding_ratio"] < 1
    # no GPU: no peak GPU memory, no CUDA graphs
    step = "eager (cpu: no CUDA graphs)"
    from seqgen_cli.models.linear_maps import cpu_isa

    assert data["device"] == {
        "device": "cpu", "dtype": "float32", "loader": "seqgen", "engine": "bart decoder", "step_path": step,
        "cpu_isa": cpu_isa(), "linear_maps": "float32 oneDNN (weights packed once)",
    }  # fmt: skip


def test_resume_needs_an_output_file(bart: Path) -> None:
    res = seqgen("generate", "-m", str(bart), "--resume", input="x\n")
    assert res.exit_code == 2 and "--resume needs -o FILE" in res.stderr


def _rss_growth_mb(bart: Path, tmp_path: Path, n: int) -> float:
    """Peak RSS above the RSS at the run's start (``--stats``) of a run over ``n`` one-token lines, batches of
    4096: every output written."""
    src, out, stats = tmp_path / f"big{n}.txt", tmp_path / f"out{n}.txt", tmp_path / f"stats{n}.json"
    src.write_text("".join(f"w{i % 997}\n" for i in range(n)), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "seqgen_cli", "generate", "-m", str(bart), str(src), "-o", str(out),
        "--max-new-tokens", "1", "--batch-size", "4096", "--sort-window", "4096", "-q", "--stats", str(stats),
    ]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
    assert res.returncode == 0, res.stderr.decode()
    data = json.loads(stats.read_text())
    with open(out, "rb") as fh:
        assert sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 20), b"")) == n
    assert data["inputs"] == n
    return data["peak_rss_mb"] - data["rss_at_start_mb"]


@pytest.mark.slow
def test_200k_lines_run_in_bounded_memory(bart: Path, tmp_path: Path) -> None:
    """Memory does not grow with the input: 200,000 lines peak within 100 MB of 20,000 lines at the same batch
    size (whose step, batches of 4096 with 64-key cross-attention chunks, takes 225-275 MB in both; measured:
    within 25 MB of each other). Reading the whole input into one window (``--sort-window 200000``) peaks 153 MB
    above 20,000 lines: that would fail here."""
    small, large = _rss_growth_mb(bart, tmp_path, 20_000), _rss_growth_mb(bart, tmp_path, 200_000)
    assert large - small < 100, (small, large)


def test_shards_merged_equal_the_one_process_run(bart: Path, job, tmp_path: Path) -> None:
    src, reference, _ = job  # 30 inputs
    parts = [tmp_path / f"part{i}.txt" for i in range(4)]
    for i, part in enumerate(parts[:3]):
        res = seqgen("generate", "-m", str(bart), str(src), "-o", str(part), "--shard", f"{i}/4", *ARGS)
        assert res.exit_code == 0, res.stderr
    env = {"RANK": "3", "WORLD_SIZE": "4"}  # as torchrun sets them
    res = seqgen(
        "generate", "-m", str(bart), str(src), "-o", str(parts[3]), "--shard", "auto", *ARGS, env=env
    )
    assert res.exit_code == 0, res.stderr
    assert [p.read_bytes().count(b"\n") for p in parts] == [7, 8, 7, 8]
    out = tmp_path / "merged.txt"
    res = seqgen("merge", *map(str, parts), "-o", str(out))
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes() == reference


def test_a_shard_opens_its_input_three_times_check_count_then_generate(
    bart: Path, job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``check_job`` runs once (it opens the input to check it can) and resolves the shard in one pass (line
    count and hash); then the shard is read: no further line counts of the input (there were three)."""
    src = job[0]
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, str | os.PathLike) and os.fspath(file) == str(src):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    res = seqgen(
        "generate", "-m", str(bart), str(src), "-o", str(tmp_path / "p.txt"), "--shard", "1/4", *ARGS
    )
    assert res.exit_code == 0, res.stderr
    assert len(opened) == 3, opened


def test_merge_refuses_an_unfinished_part(tmp_path: Path) -> None:
    b = tmp_path / "b.txt"
    b.write_text("y\n")
    index_path(b).write_text("{}\n")  # shard b was interrupted
    out = tmp_path / "out.txt"
    res = seqgen("merge", str(b), "-o", str(out))
    assert res.exit_code == 2 and f"{b}: incomplete" in res.stderr and "--resume" in res.stderr
    assert not out.exists()
    index_path(b).unlink()  # finished, but not by `seqgen generate --shard`: no manifest
    res = seqgen("merge", str(b), "-o", str(out))
    assert res.exit_code == 2 and "no b.txt.seqgen-part beside it" in res.stderr and not out.exists()


def test_shard_errors(bart: Path, job) -> None:
    src = str(job[0])
    res = seqgen("generate", "-m", str(bart), src, "--shard", "4/4", *ARGS)
    assert res.exit_code == 2 and "0 <= I < N" in res.stderr
    res = seqgen("generate", "-m", str(bart), src, "--shard", "auto", env={"RANK": None})
    assert res.exit_code == 2 and "RANK and WORLD_SIZE" in res.stderr
    res = seqgen("generate", "-m", str(bart), "--shard", "0/2", *ARGS, input="a\n")
    assert res.exit_code == 2 and "--shard needs input files" in res.stderr
    res = seqgen("generate", "-m", str(bart), src, "--address", "auto", *ARGS)
    assert res.exit_code == 2 and "--address needs --workers N" in res.stderr


@pytest.mark.slow
def test_without_workers_ray_is_never_imported(bart: Path, job, tmp_path: Path) -> None:
    src, reference, _ = job
    out = tmp_path / "out.txt"
    code = (
        "import sys; from seqgen_cli.cli import main\n"
        f"try: main({['generate', '-m', str(bart), str(src), '-o', str(out), *ARGS]!r})\n"
        "except SystemExit as e: assert not e.code, e.code\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr.decode()
    assert out.read_bytes() == reference


@pytest.mark.slow
def test_process_exit_flushes_runs_atexit_and_keeps_the_status(bart: Path, job, tmp_path: Path) -> None:
    """``cli.run`` ends the process with ``os._exit``: stdout still complete, atexit handlers run, status kept."""
    src, reference, _ = job
    marker = tmp_path / "atexit-ran"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONUNBUFFERED", None)  # stdout block-buffered, as in a shell pipe

    def run(*args: str) -> subprocess.CompletedProcess:
        code = (
            "import atexit, pathlib, sys; from seqgen_cli.cli import run\n"
            f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'ran')\n"
            f"run({list(args)!r})\n"
            "raise AssertionError('run() returned')\n"
        )
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)

    res = run("generate", "-m", str(bart), str(src), *ARGS)  # to stdout, a pipe: block-buffered
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout == reference
    assert marker.read_text() == "ran"
    marker.unlink()
    res = run("generate", "-m", str(bart), str(tmp_path / "missing.txt"), *ARGS)
    assert res.returncode == 2
    assert res.stderr.decode().strip().startswith("seqgen: error:")
    assert marker.read_text() == "ran"


def test_workers_without_ray_say_how_to_install_it(bart: Path, job, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    res = seqgen("generate", "-m", str(bart), str(job[0]), "--workers", "2", *ARGS)
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        "seqgen: error: --workers needs Ray, which is not installed: pip install 'seqgen-cli[ray]'"
    ]


def test_stats_break_the_start_up_down(tiny_models, tmp_path: Path) -> None:
    """``--stats`` ``startup``: each stage before the first decode step (imports, tokenizer, weights into seqgen's
    own tree: no model class, the fast backend; int8: its weights) and when the command and the first batch came, after the process started.
    The stages run one after another between the two, so they add up to at most the time between them."""
    src, stats = tmp_path / "in.txt", tmp_path / "stats.json"
    src.write_text("one line\nanother line\n", encoding="utf-8")
    for dtype in ("float32", "int8"):
        res = seqgen("generate", "-m", str(tiny_models("bart")), str(src), "-o", str(tmp_path / f"{dtype}.txt"),
                     "--max-new-tokens", "3", "--dtype", dtype, "--stats", str(stats))  # fmt: skip
        assert res.exit_code == 0, res.output
        start = json.loads(stats.read_text())["startup"]
        stages, marks = start["stages"], start["since_process_start"]
        expected = {"import the pipeline (torch, transformers)", "import transformers", "tokenizer", "weights",
                    "fast backend"} | ({"int8 weights"} if dtype == "int8" else set())  # fmt: skip
        assert set(stages) == expected and all(s >= 0 for s in stages.values())
        assert 0 < marks["generate command"] < marks["first batch"]
        assert sum(stages.values()) <= marks["first batch"] - marks["generate command"]
