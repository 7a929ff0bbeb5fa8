"""One generate loop: ``Generator.generate_iterable`` and the file pipeline both run their batches through
``Generator.generate_batches``, and get the same outputs, in input order, over inputs of mixed lengths."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from seqgen_cli.batching import Chunk, ItemBatch, Text, tokenise
from seqgen_cli.generator import Generator
from seqgen_cli.pipeline import run as run_module
from seqgen_cli.pipeline.records import read_records
from seqgen_cli.pipeline.run import RunOptions, run
from seqgen_cli.pipeline.sinks import StreamSink
from tests.helpers import Capture, FakeGen, write_lines


@pytest.fixture(scope="module")
def gen(tiny_models) -> Generator:
    return Generator(str(tiny_models("bart")), backend="hf", max_new_tokens=4)


def mixed(n: int, seed: int) -> list[str]:
    """Texts of 1 to 60 words, a few blank: several width buckets per window."""
    rng = random.Random(seed)
    words = "the a cat sat on mat with hat and then ran far".split()
    return [
        "" if rng.random() < 0.1 else " ".join(rng.choices(words, k=rng.choice([1, 2, 7, 20, 60])))
        for _ in range(n)
    ]


def alone(gen: Generator, texts: list[str]) -> list[list[str]]:
    """Each input run on its own through the batch layer."""
    return [
        gen.detokenise(gen.generate_ids([gen.encode([t])[0].ids])[0])
        if t.strip()
        else [""] * gen.num_return_sequences
        for t in texts
    ]


def test_generate_iterable_and_the_pipeline_both_generate_through_generate_batches(
    gen: Generator, tmp_path: Path, monkeypatch
) -> None:
    one_loop = Generator.generate_batches
    callers: list[str] = []
    inside = False

    def spy(self, batches, known=None):
        nonlocal inside
        callers.append("pipeline" if known is not None else "iterable")
        loop = one_loop(self, batches, known)
        while True:
            inside = True
            try:
                done = next(loop)
            except StopIteration:
                return
            finally:
                inside = False
            yield done

    generate_ids = gen.generate_ids

    def only_in_the_loop(batch, indices=None):
        assert inside, "a batch was generated outside Generator.generate_batches"
        return generate_ids(batch, indices)

    monkeypatch.setattr(Generator, "generate_batches", spy)
    monkeypatch.setattr(gen, "generate_ids", only_in_the_loop)
    texts = mixed(30, seed=1)
    streamed = list(gen.generate_iterable(texts, batch_size=4, sort_window=16))
    out = Capture()
    src = write_lines(tmp_path / "in.txt", texts)
    summary = run(gen, read_records([str(src)]), StreamSink(out), RunOptions(batch_size=4, sort_window=16))
    assert callers == ["iterable", "pipeline"] and summary.error is None
    assert out.text() == "".join(" ".join(o[0].splitlines()) + "\n" for o in streamed)
    assert "generate_split" not in vars(run_module)  # the pipeline keeps no generate loop of its own


@pytest.mark.parametrize("batch_size,batch_tokens,window", [(3, None, 8), (8, 160, None), (5, None, 0)])
def test_one_loop_keeps_input_order_and_outputs_over_mixed_lengths(
    gen: Generator, tmp_path: Path, batch_size, batch_tokens, window
) -> None:
    texts = mixed(48, seed=batch_size)
    expected = alone(gen, texts)
    streamed = list(
        gen.generate_iterable(
            iter(texts), batch_size=batch_size, batch_tokens=batch_tokens, sort_window=window
        )
    )
    assert streamed == expected
    out = Capture()
    src = write_lines(tmp_path / "in.txt", texts)
    opts = RunOptions(batch_size=batch_size, batch_tokens=batch_tokens, sort_window=window)
    summary = run(gen, read_records([str(src)]), StreamSink(out), opts)
    assert out.text() == "".join(" ".join(o[0].splitlines()) + "\n" for o in expected)
    assert summary.inputs == len(texts) and summary.skipped == 0


def batches_of(texts: list[str], gen: FakeGen, batch_size: int = 3) -> Iterator[ItemBatch]:
    items = tokenise([Text(i, t) for i, t in enumerate(texts)], gen.encode)
    return iter(gen.batcher(iter([Chunk(items)]), lambda items: None, batch_size, sort_window=64))


def test_known_inputs_are_handed_back_not_generated() -> None:
    texts = [f"{i}:" + "x" * (i * 7 % 23) for i in range(40)]
    gen = FakeGen()

    def known(items):
        return [it for it in items if it.index % 3 == 0], [it for it in items if it.index % 3]

    generated, answered = [], []
    for done in gen.generate_batches(batches_of(texts, gen), known):
        assert [r.item for r in done.results] == [it for it in done.batch.items if it.index % 3]
        assert all(r.error is None and r.sequences == [r.item.ids[::-1]] for r in done.results)
        generated += [r.item.index for r in done.results]
        answered += [it.index for it in done.known]
    assert sorted(generated + answered) == list(range(40)) and all(i % 3 == 0 for i in answered)
    ran = [int("".join(map(chr, ids)).split(":")[0]) for batch in gen.batches for ids in batch]
    assert sorted(ran) == sorted(generated)  # the model saw only the inputs not known


def test_the_next_batch_is_read_only_when_one_is_taken() -> None:
    """The pipeline narrows the batches after a failure by wrapping the loop's input: it must be read lazily."""
    gen, taken = FakeGen(), []

    def counted(batches: Iterator[ItemBatch]) -> Iterator[ItemBatch]:
        for batch in batches:
            taken.append(batch.window)
            yield batch

    loop = gen.generate_batches(counted(batches_of([f"line {i}" for i in range(12)], gen)))
    next(loop)
    assert len(taken) == 1 and len(gen.batches) == 1
    assert len(list(loop)) == 3 and len(taken) == 4
