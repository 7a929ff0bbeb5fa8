"""Nothing lost, nothing mixed. Same-file checks by inode, write failures (disk full), journal
entries checked against their input, `seqgen merge` manifests, streams and closed standard streams."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from seqgen_cli.errors import SeqgenError
from seqgen_cli.outputs import OutputText
from seqgen_cli.pipeline import formats
from seqgen_cli.pipeline.formats import index_path, journal_path
from seqgen_cli.pipeline.job import JobOptions, check_job, generate_job
from seqgen_cli.pipeline.records import read_records
from seqgen_cli.pipeline.run import RunOptions, run
from seqgen_cli.pipeline.sinks import StreamSink
from tests.helpers import Capture, FakeGen, expected, one_line_error, run_seqgen, seqgen, write_lines
from tests.tiny_models import sample_texts

REPO = Path(__file__).resolve().parents[2]


# -- 1. an input that is the output under another name ------------------------------------------------


@pytest.mark.parametrize("alias", ["hard link", "symlink", "relative path"])
def test_input_that_is_the_output_under_another_name_is_refused(tmp_path: Path, monkeypatch, alias) -> None:
    src = tmp_path / "in1.txt"
    src.write_text("keep me\nand me\n", encoding="utf-8")
    other = tmp_path / "in1_other.txt"
    if alias == "hard link":
        os.link(src, other)
    elif alias == "symlink":
        other.symlink_to(src)
    else:
        monkeypatch.chdir(tmp_path)
        other = Path("sub/../in1.txt")
        (tmp_path / "sub").mkdir()
    # The model is never loaded: the check comes first.
    res = seqgen("generate", "-m", str(tmp_path / "no-model"), str(other), "-o", str(src))
    one_line_error(res, str(src), "input")
    assert src.read_text(encoding="utf-8") == "keep me\nand me\n"
    assert not Path(f"{src}.seqgen-index").exists()


@contextmanager
def written_by_another_run(path: Path) -> Iterator[None]:
    """``path`` locked as a running seqgen holds its ``-o`` FILE (another open file: flock locks conflict
    within one process too)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def test_an_output_another_run_is_writing_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """Two runs into one -o FILE would overwrite or interleave each other's outputs: the second one stops with
    one line, before loading the model (none here), and the first one's file and side files stay as they are."""
    src, out = write_lines(tmp_path / "in.txt", ["one"]), tmp_path / "out.txt"
    out.write_text("the first run's output\n", encoding="utf-8")
    with written_by_another_run(out):
        for resume in ([], ["--resume"]):
            res = seqgen("generate", "-m", str(tmp_path / "no-model"), str(src), "-o", str(out), *resume)
            one_line_error(res, str(out), "being written by another seqgen run")
    assert out.read_text(encoding="utf-8") == "the first run's output\n"
    assert not index_path(out).exists() and not journal_path(out).exists()


def test_two_runs_that_pass_the_early_check_together_meet_at_the_lock(tmp_path: Path) -> None:
    """Both checked before either opened the output: the one that opens it second stops at the lock, before it
    changes the file or writes an index; the other one runs to the end."""
    texts = ragged(10)
    src, out = write_lines(tmp_path / "in.txt", texts), tmp_path / "out.txt"
    opts = JobOptions(batch_size=4)
    first, second = check_job([str(src)], str(out), opts), check_job([str(src)], str(out), opts)
    out.write_text("the first run's output\n", encoding="utf-8")
    with written_by_another_run(out), pytest.raises(SeqgenError, match="being written by another seqgen run"):
        generate_job(FakeGen(), second)
    assert out.read_text(encoding="utf-8") == "the first run's output\n" and not index_path(out).exists()
    generate_job(FakeGen(), first)
    assert out.read_text(encoding="utf-8") == expected(texts)


@pytest.mark.slow
def test_stdin_that_is_the_output_file_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("keep me\n", encoding="utf-8")
    with open(src, "rb") as stdin:
        res = run_seqgen("generate", "-m", str(tmp_path / "no-model"), "-o", str(src), stdin=stdin)
    err = res.stderr.decode().strip()
    assert res.returncode == 2 and err.startswith("seqgen: error: standard input is the same file as -o"), err
    assert len(err.splitlines()) == 1 and src.read_text(encoding="utf-8") == "keep me\n"


def test_merge_refuses_an_output_that_is_a_part_under_another_name(tmp_path: Path) -> None:
    part = tmp_path / "part0.txt"
    part.write_text("x\n", encoding="utf-8")
    os.link(part, tmp_path / "out.txt")
    res = seqgen("merge", str(part), "-o", str(tmp_path / "out.txt"))
    one_line_error(res, "part")
    assert part.read_text(encoding="utf-8") == "x\n"


# -- 2. abnormal exits: disk full, unexpected errors ----------------------------------------------------


def _job(gen, src: Path, out: Path, **kw):
    opts = JobOptions(batch_size=kw.pop("batch_size", 4), sort_window=kw.pop("sort_window", 1000), **kw)
    return generate_job(gen, check_job([str(src)], str(out), opts))


def ragged(n: int) -> list[str]:
    """Inputs whose lengths are shuffled, so that most finished outputs wait for an earlier one."""
    return [f"{i:03d}" + "x" * ((i * 37) % 50) for i in range(n)]


def disk_full(monkeypatch, path: Path, limit: int) -> None:
    """``os.write`` that lets ``path`` grow to ``limit`` bytes, then writes what still fits and raises ENOSPC."""
    real = os.write

    def write(fd, data) -> int:
        if path.exists() and os.path.samestat(os.fstat(fd), os.stat(path)):
            room = limit - os.lseek(fd, 0, os.SEEK_CUR)
            if len(data) > room:
                if room > 0:
                    real(fd, bytes(data[:room]))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


def assert_kept_for_resume(out: Path, full: bytes, message: str) -> int:
    """After an abnormal exit: whole outputs only, index and journal kept, one line saying where and how."""
    data = out.read_bytes()
    assert data.endswith(b"\n") and full.startswith(data) and len(data) < len(full)
    assert index_path(out).exists() and journal_path(out).exists()
    done = data.count(b"\n")
    assert "\n" not in message and f"first {done} inputs are in {out}" in message and "--resume" in message
    return done


def test_disk_full_leaves_whole_lines_keeps_index_and_journal_and_resume_is_identical(
    tmp_path: Path, monkeypatch
) -> None:
    texts = ragged(120)
    src, out = write_lines(tmp_path / "in.txt", texts), tmp_path / "out.txt"
    full = expected(texts).encode()
    with monkeypatch.context() as m:
        disk_full(m, out, len(full) // 2 + 3)  # the disk fills in the middle of a line
        with pytest.raises(SeqgenError) as info:
            _job(FakeGen(), src, out)
    message = str(info.value)
    assert message.startswith(f"no space left on device writing {out}; "), message
    assert_kept_for_resume(out, full, message)
    gen = FakeGen()
    _job(gen, src, out, resume=True)
    assert out.read_bytes() == full
    assert sum(map(len, gen.batches)) < len(texts)  # journaled outputs were not generated again


def test_unexpected_error_keeps_index_and_journal(tmp_path: Path) -> None:
    texts = ragged(120)
    src, out = write_lines(tmp_path / "in.txt", texts), tmp_path / "out.txt"
    calls = []

    def crash_at_12th(batch) -> None:
        calls.append(1)
        if len(calls) == 12:
            raise RuntimeError("boom")

    with pytest.raises(SeqgenError) as info:
        _job(FakeGen(fail=crash_at_12th), src, out)
    message = str(info.value)
    assert message.startswith("internal error: RuntimeError: boom"), message
    assert_kept_for_resume(out, expected(texts).encode(), message)
    _job(FakeGen(), src, out, resume=True)
    assert out.read_text(encoding="utf-8") == expected(texts)


def test_memory_error_while_writing_keeps_index_and_journal(tmp_path: Path) -> None:
    texts = ragged(120)
    src, out = write_lines(tmp_path / "in.txt", texts), tmp_path / "out.txt"
    gen = FakeGen()
    calls = []
    detokenise = gen.detokenise

    def detokenise_until_memory_runs_out(seqs):
        calls.append(1)
        if len(calls) == 15:
            raise MemoryError
        return detokenise(seqs)

    gen.texts = OutputText(detokenise_until_memory_runs_out)  # the writer's texts
    with pytest.raises(SeqgenError) as info:
        _job(gen, src, out)
    assert str(info.value).startswith("out of memory"), info.value
    assert_kept_for_resume(out, expected(texts).encode(), str(info.value))
    _job(FakeGen(), src, out, resume=True)
    assert out.read_text(encoding="utf-8") == expected(texts)


def test_disk_full_on_the_command_line_is_one_line_and_resumes(
    tiny_models, tmp_path: Path, monkeypatch
) -> None:
    bart = str(tiny_models("bart"))
    src = write_lines(tmp_path / "in.txt", sample_texts(30, seed=5))
    args = ["--max-new-tokens", "4", "--batch-size", "4", "-q"]
    reference = tmp_path / "reference.txt"
    assert seqgen("generate", "-m", bart, str(src), "-o", str(reference), *args).exit_code == 0
    full = reference.read_bytes()
    out = tmp_path / "out.txt"
    with monkeypatch.context() as m:
        disk_full(m, out, len(full) // 3)
        res = seqgen("generate", "-m", bart, str(src), "-o", str(out), *args)
    line = one_line_error(res, f"no space left on device writing {out}")
    assert res.exit_code == 1
    assert_kept_for_resume(out, full, line)
    res = seqgen("generate", "-m", bart, str(src), "-o", str(out), "--resume", *args)
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes() == full and not index_path(out).exists()


def test_resume_refuses_a_torn_output_without_index(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["abc", "de", "fgh"])
    out = tmp_path / "out.txt"
    out.write_bytes(b"cba\ne")  # an index lost, or an older seqgen's disk-full
    with pytest.raises(SeqgenError, match="its last line is torn"):
        _job(FakeGen(), src, out, resume=True)
    assert out.read_bytes() == b"cba\ne"


def test_a_torn_journal_line_does_not_hide_later_entries(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    journal = formats.Journal(out, fresh=True)
    journal.add([(3, "k3", "three\n")])
    journal.close(complete=False)
    with open(formats.journal_path(out), "ab") as fh:
        fh.write(b'{"i": 4, "in')  # a kill in the middle of a write
    journal = formats.Journal(out, fresh=False)
    journal.add([(5, "k5", "five\n")])
    journal.close(complete=False)
    assert sorted(formats.load_journal(out, 0)[0]) == [3, 5]


# -- 3. journal entries carry their input's hash ------------------------------------------------------


def test_resume_regenerates_a_journaled_output_whose_input_changed(tmp_path: Path) -> None:
    texts = ragged(120)
    src, out = write_lines(tmp_path / "in.txt", texts), tmp_path / "out.txt"
    calls = []

    def interrupt_at_10th(batch) -> None:
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt

    done = _job(FakeGen(fail=interrupt_at_10th), src, out).inputs
    journaled = sorted(formats.load_journal(out, done)[0])
    assert len(journaled) > 3  # outputs waiting for an earlier input
    changed = journaled[len(journaled) // 2]
    texts[changed] = "changed " + texts[changed]
    write_lines(src, texts)
    gen = FakeGen()
    _job(gen, src, out, resume=True)
    assert out.read_text(encoding="utf-8") == expected(texts)  # as a fresh run on the changed input
    assert sum(map(len, gen.batches)) == len(texts) - done - len(journaled) + 1  # only that one again


def cut_short_with_a_journal(tiny_models, tmp_path: Path, monkeypatch) -> tuple[list[str], Path, bytes, int]:
    """A tiny BART's run into ``out.txt`` stopped by a full disk, with later outputs in its journal: the command
    (without ``-o``), the output, the bytes an uninterrupted run writes, the inputs written."""
    src = write_lines(tmp_path / "in.txt", sample_texts(40, seed=7))
    args = [
        "generate",
        "-m",
        str(tiny_models("bart")),
        str(src),
        "--max-new-tokens",
        "4",
        "--batch-size",
        "2",
    ]
    reference = tmp_path / "reference.txt"
    assert seqgen(*args, "-o", str(reference)).exit_code == 0
    full, out = reference.read_bytes(), tmp_path / "out.txt"
    with monkeypatch.context() as m:
        disk_full(m, out, len(full) // 3)
        assert seqgen(*args, "-o", str(out)).exit_code == 1
    done = out.read_bytes().count(b"\n")
    return args, out, full, done


def journal_entries(out: Path) -> list[dict]:
    return [json.loads(line) for line in journal_path(out).read_text(encoding="utf-8").splitlines()]


def journal_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "seqgen-journal" in line]


def test_resume_discards_edited_and_garbled_journal_entries(tiny_models, tmp_path: Path, monkeypatch) -> None:
    args, out, full, done = cut_short_with_a_journal(tiny_models, tmp_path, monkeypatch)
    entries = journal_entries(out)
    waiting = [n for n, e in enumerate(entries) if e["i"] >= done]
    assert len(waiting) >= 3, entries  # outputs waiting for an earlier input
    entries[waiting[0]]["out"] = "EDITED BY HAND\n"
    lines = [json.dumps(e) for e in entries]
    lines[waiting[1]] = lines[waiting[1]][: len(lines[waiting[1]]) // 2]  # garbled, later entries follow
    journal_path(out).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    res = seqgen(*args, "-o", str(out), "--resume")
    assert res.exit_code == 0, res.stderr
    data = out.read_bytes()
    assert data == full and b"EDITED" not in data  # as an uninterrupted run
    (warning,) = journal_warnings(res.stderr)
    assert warning.startswith("seqgen: warning: discarded 2 entries of out.txt.seqgen-journal"), warning
    assert "1 edited or damaged" in warning and "1 unreadable" in warning and "generated anew" in warning


def test_resume_regenerates_the_entries_of_a_journal_without_digests(
    tiny_models, tmp_path: Path, monkeypatch
) -> None:
    """A journal written before entries had a digest: its entries are not trusted, their inputs generated anew."""
    args, out, full, done = cut_short_with_a_journal(tiny_models, tmp_path, monkeypatch)
    entries = [{k: e[k] for k in ("i", "in", "out")} for e in journal_entries(out)]  # the previous format
    waiting = [e for e in entries if e["i"] >= done]
    assert waiting
    waiting[0]["out"] = "EDITED BY HAND\n"
    journal_path(out).write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
    res = seqgen(*args, "-o", str(out), "--resume")
    assert res.exit_code == 0, res.stderr
    data = out.read_bytes()
    assert data == full and b"EDITED" not in data
    (warning,) = journal_warnings(res.stderr)
    assert f"discarded {len(waiting)} entr" in warning and "without a digest" in warning, warning


# -- 3b. a --workers run completed by one process leaves no parts folder ------------------------------------


@pytest.mark.parametrize("foreign", [False, True])
def test_one_process_resume_of_a_workers_run_removes_its_parts_folder(
    tiny_models, tmp_path: Path, monkeypatch, foreign: bool
) -> None:
    """What a killed ``--workers`` driver leaves (the output and its index; in ``OUT.seqgen-parts/`` the driver's
    mark, a finished part and a partial one with their locks, index and journal), written here by the worker code
    itself (:class:`ShardWorker`, without Ray), then finished by one process with ``--resume``."""
    from seqgen_cli.generator import GeneratorSpec
    from seqgen_cli.pipeline import worker as worker_module
    from seqgen_cli.pipeline.formats import DRIVER_MARK, parts_dir
    from seqgen_cli.pipeline.shards import Cutter
    from seqgen_cli.pipeline.worker import ShardTask, ShardWorker

    args, out, full, done = cut_short_with_a_journal(tiny_models, tmp_path, monkeypatch)
    parts = parts_dir(str(out))
    parts.mkdir()
    (parts / DRIVER_MARK).write_text("node-1", encoding="utf-8")  # the workers share the driver's folder
    monkeypatch.setattr(worker_module, "node_id", lambda: "node-1")
    spec = GeneratorSpec(model=args[2], generation={"max_new_tokens": 4})
    worker = ShardWorker(spec, JobOptions(batch_size=2), str(parts), "node-1", None)
    records = read_records([args[3]], "auto", None, "skip")
    cutter = Cutter(records, 0, 8, formats.InputDigest(), ahead=8)
    shards = []
    while not cutter.finished:
        shard = cutter.take()
        if shard is not None and shard.start >= done:
            shards.append(shard)
    finished, partial = shards[0], shards[1]
    assert worker.run_shard(ShardTask(finished.name, finished.records)).fatal is None
    batches = worker.gen.generate_batches

    def killed_after_one_batch(*a, **kw):
        for n, batch in enumerate(batches(*a, **kw)):
            if n == 1:
                raise KeyboardInterrupt
            yield batch

    worker.gen.generate_batches = killed_after_one_batch
    assert "interrupted" in worker.run_shard(ShardTask(partial.name, partial.records)).fatal
    left = {p.name for p in parts.iterdir()}
    assert {finished.name, f"{finished.name}.lock", partial.name, f"{partial.name}.lock"} <= left
    assert {index_path(partial.name).name, journal_path(partial.name).name, DRIVER_MARK} <= left
    if foreign:
        (parts / "notes.txt").write_text("not seqgen's", encoding="utf-8")
    res = seqgen(*args, "-o", str(out), "--resume")
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes() == full and not index_path(out).exists() and not journal_path(out).exists()
    if foreign:  # only what seqgen wrote is removed
        assert [p.name for p in parts.iterdir()] == ["notes.txt"]
        assert f"{parts.name} kept: it holds files seqgen did not write" in res.stderr, res.stderr
    else:
        assert not parts.exists(), sorted(p.name for p in parts.iterdir())


def test_a_part_a_worker_still_holds_locked_is_not_removed(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    parts = formats.parts_dir(out)
    parts.mkdir()
    part = parts / "000000000000-8-0123456789abcdef.part"
    for path in formats.part_files(part):
        path.write_text("x", encoding="utf-8")
    with open(f"{part}.lock") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a worker of a lost driver, still writing
        assert not formats.remove_parts(out)
        assert all(path.exists() for path in formats.part_files(part))
    assert formats.remove_parts(out) and not parts.exists()


# -- 9. seqgen merge checks that the parts belong together ---------------------------------------------


def make_parts(tmp_path: Path, src: Path, n: int, name: str = "part", gen=FakeGen, **kw) -> list[Path]:
    parts = [tmp_path / f"{name}{i}.txt" for i in range(n)]
    for i, part in enumerate(parts):
        opts = JobOptions(batch_size=4, shard=(i, n), **kw)
        assert generate_job(gen(), check_job([str(src)], str(part), opts)).error is None
    return parts


def int8_gen() -> FakeGen:
    gen = FakeGen()
    gen.loaded.int8 = True
    return gen


def test_merge_joins_the_shards_of_one_job_and_keeps_their_manifests(tmp_path: Path) -> None:
    texts = ragged(40)
    src = write_lines(tmp_path / "in.txt", texts)
    parts = make_parts(tmp_path, src, 3)
    out = tmp_path / "out.txt"
    res = seqgen("merge", *map(str, parts), "-o", str(out))
    assert res.exit_code == 0, res.stderr
    assert out.read_text(encoding="utf-8") == expected(texts)
    assert all(Path(f"{p}.seqgen-part").exists() for p in parts)  # kept: the parts can be merged again
    with written_by_another_run(out):  # replacing a file a run writes would lose that run's outputs
        one_line_error(
            seqgen("merge", *map(str, parts), "-o", str(out)), "being written by another seqgen run"
        )
    assert out.read_text(encoding="utf-8") == expected(texts)


@pytest.mark.parametrize(
    "case,needle",
    [
        ("out of order", "parts out of order: {p1} is shard 2/3"),
        ("missing", "missing shard 1/3"),
        ("twice", "shard 0/3 is given twice"),
        ("other input", "were made from different inputs"),
        ("other settings", "were written with different settings (output_format)"),
        ("other N", "is shard 1/4"),
        ("changed", "changed since its shard finished"),
        ("edited in place", "changed since its shard finished"),
        ("other dtype", "were written with different settings (dtype)"),
        ("no manifest", "no part1.txt.seqgen-part beside it"),
    ],
)
def test_merge_refuses_parts_that_do_not_belong_together(tmp_path: Path, case: str, needle: str) -> None:
    texts = ragged(40)
    src = write_lines(tmp_path / "in.txt", texts)
    parts = make_parts(tmp_path, src, 3)
    other = tmp_path / "other"
    other.mkdir()
    if case == "out of order":
        parts = [parts[0], parts[2], parts[1]]
    elif case == "missing":
        parts = [parts[0], parts[2]]
    elif case == "twice":
        parts = [parts[0], parts[0], parts[2]]
    elif case == "other input":
        parts[1] = make_parts(other, write_lines(other / "in.txt", texts[:-1] + ["changed"]), 3)[1]
    elif case == "other settings":
        parts[1] = make_parts(other, src, 3, output_format="jsonl")[1]
    elif case == "other N":
        parts[1] = make_parts(other, src, 4)[1]
    elif case == "changed":
        with open(parts[1], "ab") as fh:
            fh.write(b"one more line\n")
    elif case == "edited in place":  # the same length: only the content tells
        data = bytearray(parts[1].read_bytes())
        data[0] = ord("X") if data[0] != ord("X") else ord("Y")
        parts[1].write_bytes(bytes(data))
    elif case == "other dtype":
        parts[1] = make_parts(other, src, 3, gen=int8_gen)[1]
    else:
        Path(f"{parts[1]}.seqgen-part").unlink()
    out = tmp_path / "out.txt"
    res = seqgen("merge", *map(str, parts), "-o", str(out))
    one_line_error(res, needle.format(p1=parts[1]))
    assert res.exit_code == 2 and not out.exists()


def test_resuming_a_shard_whose_input_changed_is_refused(tmp_path: Path) -> None:
    texts = ragged(80)
    src, part = write_lines(tmp_path / "in.txt", texts), tmp_path / "part0.txt"
    calls = []

    def interrupt_at_3rd(batch) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    opts = JobOptions(batch_size=4, shard=(0, 2))
    assert generate_job(FakeGen(fail=interrupt_at_3rd), check_job([str(src)], str(part), opts)).interrupted
    write_lines(src, texts + ["more", "lines"])  # the shards' bounds move: shard 0 would overlap shard 1
    with pytest.raises(SeqgenError, match=r"different settings \(input\)"):
        resumed = JobOptions(batch_size=4, shard=(0, 2), resume=True)
        generate_job(FakeGen(), check_job([str(src)], str(part), resumed))


# -- 10. JSONL fields of a skipped line, closed standard streams, devices, unwritable outputs ---------------


def test_jsonl_skip_keeps_the_fields_of_a_line_that_parsed(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    lines = ['{"id": 1, "text": "abc"}', '{"id": 2, "txt": "x"}', '{"id": 3, "text": 5}', "{broken"]
    src.write_text("\n".join([*lines, '{"id": 5, "text": "de"}']) + "\n", encoding="utf-8")
    out = Capture()
    opts = RunOptions(output_format="jsonl", on_error="skip")
    summary = run(FakeGen(), read_records([str(src)], on_error="skip"), StreamSink(out), opts)
    rows = [json.loads(line) for line in out.text().splitlines()]
    assert summary.skipped == 3 and [r.get("id") for r in rows] == [1, 2, 3, None, 5]
    assert rows[1]["txt"] == "x" and rows[1]["output"] == "" and f"{src}:2: no field" in rows[1]["error"]
    assert rows[2]["text"] == 5 and f"{src}:3: field 'text' is int" in rows[2]["error"]
    assert rows[4] == {"id": 5, "text": "de", "output": "ed"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "redirect,needle",
    [("<&-", "standard input is closed"), (">&-", "standard output is closed")],
)
def test_closed_standard_stream_is_a_one_line_error(tmp_path: Path, redirect: str, needle: str) -> None:
    command = f'exec "{sys.executable}" -m seqgen_cli generate -m {tmp_path / "no-model"} {redirect}'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(["bash", "-c", command], env=env, capture_output=True, timeout=300, input=b"x\n")
    err = res.stderr.decode().strip()
    assert (
        res.returncode == 2 and err.startswith(f"seqgen: error: {needle}") and len(err.splitlines()) == 1
    ), err


def test_dev_null_is_written_as_a_stream_and_cannot_be_resumed(tiny_models, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["abc", "de"])
    res = seqgen(
        "generate", "-m", str(tiny_models("bart")), str(src), "-o", "/dev/null", "--max-new-tokens", "2"
    )
    assert res.exit_code == 0, res.stderr
    assert not Path("/dev/null.seqgen-index").exists() and os.path.exists("/dev/null")
    res = seqgen("generate", "-m", str(tmp_path / "no-model"), str(src), "-o", "/dev/null", "--resume")
    one_line_error(res, "--resume needs -o FILE: /dev/null is not a regular file")


DEV_STDOUT_JOB = """
import sys
from seqgen_cli.pipeline.job import JobOptions, check_job, generate_job
from tests.helpers import FakeGen
generate_job(FakeGen(), check_job([sys.argv[1]], "/dev/stdout", JobOptions()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stdout", ["pipe", "file appended to"])
def test_dev_stdout_is_written_as_a_stream(tmp_path: Path, stdout: str) -> None:
    texts = ["abc", "de", "", "fgh"]
    src = write_lines(tmp_path / "in.txt", texts)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", DEV_STDOUT_JOB, str(src)]
    if stdout == "pipe":
        res = subprocess.run(cmd, env=env, capture_output=True, timeout=300)
        assert res.returncode == 0, res.stderr.decode()
        assert res.stdout.decode() == expected(texts)
        return
    out = tmp_path / "out.txt"
    out.write_text("written before\n", encoding="utf-8")
    with open(out, "ab") as fh:  # `>> out.txt`
        res = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.PIPE, timeout=300)
    assert res.returncode == 0, res.stderr.decode()
    assert out.read_text(encoding="utf-8") == "written before\n" + expected(texts)


def test_merge_into_dev_null_writes_into_it(tmp_path: Path) -> None:
    parts = make_parts(tmp_path, write_lines(tmp_path / "in.txt", ragged(10)), 2)
    res = seqgen("merge", *map(str, parts), "-o", "/dev/null")
    assert res.exit_code == 0, res.stderr
    assert Path("/dev/null").is_char_device()


def test_unwritable_output_is_a_one_line_error_naming_it(tmp_path: Path, monkeypatch) -> None:
    """As a non-root user sees a read-only folder (root writes anyway, so the refusal is simulated)."""
    src = write_lines(tmp_path / "in.txt", ["abc"])
    folder = tmp_path / "read-only"
    folder.mkdir()
    out = folder / "out.txt"
    real_open = os.open

    def refuse(path, flags, *args, **kw):
        if str(path).startswith(str(folder)) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(SeqgenError, match=f"^permission denied writing {out}$"):
        _job(FakeGen(), src, out)
    assert not index_path(out).exists()
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not str(path).startswith(str(folder)))
    res = seqgen("generate", "-m", str(tmp_path / "no-model"), str(src), "-o", str(out))
    one_line_error(res, f"cannot write into {folder}")


def test_stats_into_a_missing_folder_is_refused_before_the_run(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["abc"])
    stats = tmp_path / "missing" / "stats.json"
    with pytest.raises(SeqgenError, match="--stats folder .*missing does not exist"):
        _job(FakeGen(), src, tmp_path / "out.txt", stats=str(stats))
    assert not (tmp_path / "out.txt").exists()
