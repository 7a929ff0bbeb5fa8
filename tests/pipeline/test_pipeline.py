"""The I/O pipeline on a fake model (fast): order, batching, OOM splitting, bad lines, interrupt, resume."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from pathlib import Path

import pytest

from seqgen_cli.batching import Batcher, Chunk, Encoded, Text, tokenise
from seqgen_cli.errors import SeqgenError
from seqgen_cli.outputs import OutputText
from seqgen_cli.pipeline import formats, resume
from seqgen_cli.pipeline.formats import index_path
from seqgen_cli.pipeline.job import JobOptions, check_job, generate_job
from seqgen_cli.pipeline.messages import closing_message
from seqgen_cli.pipeline.records import read_records
from seqgen_cli.pipeline.run import RunOptions, run
from seqgen_cli.pipeline.sinks import StreamSink
from seqgen_cli.shapes import input_width
from tests.helpers import Capture, FakeGen, expected, write_lines


def shuffled_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append("" if rng.random() < 0.05 else f"{i}:" + "x" * rng.choice([1, 2, 5, 40, 200]))
    return out


@pytest.mark.parametrize(
    "batch_size,batch_tokens,window",
    [(1, None, None), (4, None, None), (7, 300, 64), (64, 1000, 0), (32, 50, 16), (1000, 10**6, 5000)],
)
def test_order_preserved_with_shuffled_lengths(tmp_path: Path, batch_size, batch_tokens, window) -> None:
    texts = shuffled_texts(400, seed=batch_size)
    src = write_lines(tmp_path / "in.txt", texts)
    gen, out = FakeGen(), Capture()
    opts = RunOptions(batch_size=batch_size, batch_tokens=batch_tokens, sort_window=window)
    summary = run(gen, read_records([str(src)]), StreamSink(out), opts)
    assert out.text() == expected(texts)
    assert summary.inputs == 400 and summary.error is None
    for b in gen.batches:
        assert len(b) <= batch_size
        assert len({input_width(len(ids)) for ids in b}) == 1  # one width bucket per batch
        if batch_tokens and len(b) > 1:
            assert input_width(max(map(len, b))) * len(b) <= batch_tokens
    if window != 0 and 1 < batch_size < 100:  # sorted within a window: little padding
        assert summary.padding_ratio < 0.5


def test_token_budget_counts_beams(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["abcd"] * 20)
    gen = FakeGen(n=4)  # 4 beams: 4 rows per input
    run(gen, read_records([str(src)]), StreamSink(Capture()), RunOptions(batch_size=100, batch_tokens=128))
    assert {len(b) for b in gen.batches} == {4}  # 4 tokens (padded to 8) x 4 rows x 4 inputs = 128


def test_oom_is_split_down_and_nothing_is_lost(tmp_path: Path) -> None:
    def oom_above_3(batch):
        if len(batch) > 3:
            raise MemoryError

    texts = shuffled_texts(100, seed=3)
    src = write_lines(tmp_path / "in.txt", texts)
    gen, out = FakeGen(fail=oom_above_3), Capture()
    summary = run(gen, read_records([str(src)]), StreamSink(out), RunOptions(batch_size=32))
    assert out.text() == expected(texts)
    assert max(map(len, gen.batches)) <= 3 and summary.skipped == 0


def _poison(batch):
    if any(ids == [ord(c) for c in "BOOM"] for ids in batch):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_input_that_fails_alone_is_skipped_with_its_line(tmp_path: Path, capsys) -> None:
    texts = ["aa", "bbb", "BOOM", "c", "dddd"]
    src = write_lines(tmp_path / "in.txt", texts)
    out = Capture()
    opts = RunOptions(batch_size=8, on_error="skip")
    summary = run(FakeGen(fail=_poison), read_records([str(src)]), StreamSink(out), opts)
    assert out.text() == "aa\nbbb\n\nc\ndddd\n"
    assert summary.skipped == 1
    assert f"{src}:3: out of memory" in capsys.readouterr().err


def test_input_that_fails_alone_stops_after_writing_all_before_it(tmp_path: Path) -> None:
    # Sorted by length, "BOOM" (line 6) runs before the long lines 1-5: those must still be written.
    texts = ["x" * 50 + str(i) for i in range(5)] + ["BOOM"] + ["y", "zz"] + ["w" * 9] * 30
    src = write_lines(tmp_path / "in.txt", texts)
    out = Capture()
    opts = RunOptions(batch_size=2, on_error="fail", sort_window=100)
    summary = run(FakeGen(fail=_poison), read_records([str(src)]), StreamSink(out), opts)
    assert out.text() == expected(texts[:5])
    assert summary.error is not None and summary.error.startswith(f"{src}:6: out of memory")
    assert "the outputs for the first 5 inputs are in stdout" in closing_message(summary, "-")


@pytest.mark.parametrize(
    "bad,needle", [(b"{not json}\n", "invalid JSON"), (b'{"text": 3}\n', "field 'text'")]
)
def test_bad_jsonl_line_is_named_and_earlier_outputs_written(tmp_path: Path, bad, needle) -> None:
    lines = [json.dumps({"id": i, "text": "t" * (10 - i)}).encode() + b"\n" for i in range(6)]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(lines[:4]) + bad + b"".join(lines[4:]))
    out = Capture()
    opts = RunOptions(output_format="jsonl", sort_window=100)
    summary = run(FakeGen(), read_records([str(src)]), StreamSink(out), opts)
    assert summary.error.startswith(f"{src}:5: ") and needle in summary.error
    rows = [json.loads(line) for line in out.text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2, 3] and rows[0]["output"] == "t" * 10

    out = Capture()
    opts = RunOptions(output_format="jsonl", on_error="skip")
    summary = run(FakeGen(), read_records([str(src)], on_error="skip"), StreamSink(out), opts)
    rows = [json.loads(line) for line in out.text().splitlines()]
    assert len(rows) == 7 and summary.skipped == 1 and summary.error is None
    assert rows[4]["output"] == "" and needle in rows[4]["error"] and f"{src}:5" in rows[4]["error"]
    assert [r.get("id") for r in rows[5:]] == [4, 5]


def test_jsonl_fields_passed_through_and_lists_for_several_sequences(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "src": "abc", "lang": "de"}\n{"id": "b", "src": "xy"}\n', encoding="utf-8")
    out = Capture()
    run(
        FakeGen(n=2),
        read_records([str(src)]),
        StreamSink(out),
        RunOptions(output_format="jsonl", output_field="hyp"),
    )
    rows = [json.loads(line) for line in out.text().splitlines()]
    assert rows[0] == {"id": "a", "src": "abc", "lang": "de", "hyp": ["cba", "cba1"]}
    assert rows[1]["hyp"] == ["yx", "yx1"]
    out = Capture()  # text: N consecutive lines per input
    run(FakeGen(n=2), read_records([str(src)]), StreamSink(out), RunOptions())
    assert out.text() == "cba\ncba1\nyx\nyx1\n"


def test_the_text_written_cuts_the_stop_and_splits_the_reasoning(tmp_path: Path) -> None:
    """``Generator.texts`` (``outputs.py``) decides what is written: the stop string cut, the reasoning in a JSONL
    field or stripped; the written text is the answer in both formats (FakeGen writes each input reversed)."""
    src = tmp_path / "in.jsonl"
    outputs = ["<think>hm</think>\n\nDas HausEND more", "plain"]
    src.write_text("".join(json.dumps({"text": o[::-1]}) + "\n" for o in outputs), encoding="utf-8")
    for reasoning, fmt, want in [
        ("field", "jsonl", [("Das Haus", "hm"), ("plain", None)]),
        ("strip", "jsonl", [("Das Haus", None), ("plain", None)]),
        ("strip", "text", "Das Haus\nplain\n"),
    ]:
        gen, out = FakeGen(), Capture()
        gen.texts = OutputText(gen.detokenise, ("END",), reasoning=reasoning)
        run(gen, read_records([str(src)]), StreamSink(out), RunOptions(output_format=fmt))
        if fmt == "text":
            assert out.text() == want
            continue
        got = [json.loads(line) for line in out.text().splitlines()]
        assert [(r["output"], r.get("reasoning")) for r in got] == want, reasoning
        assert ("reasoning" in got[0]) == (reasoning == "field")


def _job(gen, src: Path, out: Path, **kw) -> object:
    opts = JobOptions(batch_size=kw.pop("batch_size", 3), sort_window=kw.pop("sort_window", 12), **kw)
    return generate_job(gen, check_job([str(src)], str(out), opts))


def test_interrupt_writes_done_then_resume_is_byte_identical(tmp_path: Path) -> None:
    texts = shuffled_texts(120, seed=7)
    src = write_lines(tmp_path / "in.txt", texts)
    calls = {"n": 0}

    def interrupt_on_9th(batch):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt

    out = tmp_path / "out.txt"
    summary = _job(FakeGen(fail=interrupt_on_9th), src, out)
    assert summary.interrupted and 0 < summary.inputs < 120
    assert out.read_text(encoding="utf-8") == expected(texts[: summary.inputs])
    assert "--resume" in closing_message(summary, str(out))
    assert index_path(out).exists()
    with pytest.raises(SeqgenError, match="interrupted run"):  # no silent overwrite
        _job(FakeGen(), src, out)
    done = summary.inputs
    summary = _job(FakeGen(), src, out, resume=True, stats=str(tmp_path / "s.json"))
    assert summary.resumed_from == done and summary.inputs == 120 - done
    assert out.read_text(encoding="utf-8") == expected(texts)
    assert not index_path(out).exists()  # complete: nothing left to resume
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["resumed_from"] == done and stats["inputs"] == 120 - done
    with pytest.raises(SeqgenError, match="nothing to resume"):
        _job(FakeGen(), src, out, resume=True)


def test_resume_truncates_an_unindexed_tail_and_checks_input_and_settings(tmp_path: Path) -> None:
    texts = shuffled_texts(60, seed=1)
    src = write_lines(tmp_path / "in.txt", texts)
    out = tmp_path / "out.txt"
    calls = {"n": 0}

    def interrupt(batch):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt

    _job(FakeGen(fail=interrupt), src, out)
    with open(out, "ab") as fh:  # what a crash between write and index could leave
        fh.write(b"half a li")
    with pytest.raises(SeqgenError, match="different settings.*output_format"):
        _job(FakeGen(), src, out, resume=True, output_format="jsonl")
    other = write_lines(tmp_path / "other.txt", ["changed"] + texts[1:])
    with pytest.raises(SeqgenError, match="differ from those of the interrupted run"):
        _job(FakeGen(), other, out, resume=True)
    _job(FakeGen(), src, out, resume=True)
    assert out.read_text(encoding="utf-8") == expected(texts)


def test_resume_without_output_file_starts_fresh(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["abc", "de"])
    out = tmp_path / "new.txt"
    summary = _job(FakeGen(), src, out, resume=True)
    assert summary.inputs == 2 and out.read_text() == "cba\ned\n"


def test_resume_state_ignores_a_torn_index_line(tmp_path: Path) -> None:
    out = tmp_path / "o.txt"
    out.write_bytes(b"a\nb\nc\n")
    settings = {"k": 1}
    written = hashlib.sha256(b"a\nb\n").hexdigest()
    lines = [
        {"seqgen_index": formats.INDEX_VERSION, "settings": settings},
        {"done": 2, "offset": 4, "sha256": "x", "output_sha256": written},
    ]
    index_path(out).write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"done": 3, "off')
    state = resume.load(out, settings)
    assert (state.done, state.offset) == (2, 4)


def _saved(out: Path) -> int:
    """Inputs whose outputs a resume of ``out`` finds: written (the index's last entry) or journaled after them."""
    if not index_path(out).exists():
        return 0
    done = formats.read_index(out)[1].done
    return done + len(formats.load_journal(out, done)[0])


def _killed_run(src: Path, out: Path, kill_at_batch: int) -> list[int]:
    """Run a job in a forked child that SIGKILLs itself when batch ``kill_at_batch`` starts.

    Returns the sizes of the batches it generated before (the child reports them through a pipe).
    """
    import multiprocessing as mp
    import os
    import signal
    import time

    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child() -> None:
        sizes: list[int] = []

        def kill(batch):
            if len(sizes) == kill_at_batch:
                writer.send(sizes)
                # the writer thread takes the batches already handed to it: waited for, not slept on (on a busy
                # box it may take longer than any fixed pause); the deadline only bounds a writer that hangs
                deadline = time.monotonic() + 60
                while _saved(out) < sum(sizes) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            sizes.append(len(batch))

        _job(FakeGen(fail=kill), src, out, batch_size=4, sort_window=1000)

    proc = ctx.Process(target=child)
    proc.start()
    assert reader.poll(120), f"the child ended (exit code {proc.exitcode}) before batch {kill_at_batch}"
    sizes = reader.recv()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    return sizes


def _batches(texts: list[str], batch_size: int, window: int):
    """The batches a run over ``texts`` cuts (FakeGen's ids: a token per character)."""
    items = tokenise([Text(i, t) for i, t in enumerate(texts)], FakeGen().encode)
    return Batcher(iter([Chunk(items)]), lambda items: None, batch_size=batch_size, window=window)


def test_sigkill_loses_no_generated_output(tmp_path: Path) -> None:
    # One sort window over the whole input (a file output: windows do not grow): batches run shortest first, so
    # almost every finished output waits for an earlier (longer) input. The journal keeps them; --resume generates
    # only the rest.
    texts = [f"{i:03d}" + "x" * ((i * 37) % 50) for i in range(120)]
    src = write_lines(tmp_path / "in.txt", texts)
    out = tmp_path / "out.txt"
    sizes = _killed_run(src, out, kill_at_batch=10)
    generated = sum(sizes)
    assert generated == sum(len(b.items) for b in itertools.islice(_batches(texts, 4, 1000), 10))
    gen = FakeGen()
    summary = _job(gen, src, out, resume=True, batch_size=4, sort_window=1000)
    regenerated = sum(len(b) for b in gen.batches)
    assert regenerated == len(texts) - generated  # nothing that was generated is generated again
    assert summary.resumed_from + summary.inputs == len(texts)
    assert out.read_text(encoding="utf-8") == expected(texts)
    assert not formats.journal_path(out).exists() and not index_path(out).exists()


def test_windows_grow_from_one_batch_to_the_sort_window(tmp_path: Path) -> None:
    """The first window is one batch, each next four times as many, up to the sort window: first outputs come
    early."""
    texts = [Text(i, "x" * (1 + i % 7)) for i in range(200)]
    items = tokenise(texts, lambda ts, fields: [Encoded([1] * len(t), False) for t in ts])
    batcher = Batcher(iter([Chunk(items)]), lambda items: None, batch_size=4, window=64, grow=True)
    sizes: dict[int, int] = {}
    for batch in batcher:
        sizes[batch.window] = sizes.get(batch.window, 0) + len(batch.items)
    assert list(sizes.values()) == [4, 16, 64, 64, 52]


def test_windows_grow_for_a_stream_not_for_a_file(tmp_path: Path) -> None:
    """Output to stdout or a pipe: someone may read the first lines as they come, so windows grow from one batch;
    to a file, whole sort windows (fuller batches)."""
    texts = [f"{i:03d}" + "x" * ((i * 37) % 50) for i in range(120)]
    src = write_lines(tmp_path / "in.txt", texts)
    first_four = {tuple(ord(c) for c in t) for t in texts[:4]}
    stream, file = FakeGen(), FakeGen()
    run(stream, read_records([str(src)]), StreamSink(Capture()), RunOptions(batch_size=4, sort_window=1000))
    _job(file, src, tmp_path / "out.txt", batch_size=4, sort_window=1000)
    assert {tuple(ids) for ids in stream.batches[0]} <= first_four  # the first window: the first batch
    assert not {tuple(ids) for ids in file.batches[0]} <= first_four  # the shortest of all 120 first


def test_the_closing_line_counts_the_journaled_outputs_as_generated() -> None:
    """An interrupted run that wrote 1 input and journaled 319 (they waited for an earlier one): the closing line
    says both, and samples/s counts all 320 (before: "1 input ... 0.11 samples/s")."""
    from seqgen_cli.pipeline.stats import Summary

    summary = Summary(inputs=1, journaled=319, seconds=8.0, interrupted=True)
    line = summary.line("in.txt")
    assert "1 input written and 319 more generated (kept in the journal) in 8.0s" in line
    assert f"{320 / 8.0:.2f} samples/s" in line
    assert Summary(inputs=4, seconds=2.0).line().startswith("seqgen: 4 inputs in 2.0s")
