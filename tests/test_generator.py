"""The Python API's layers: generate_ids (one batch) -> generate_iterable (streaming) -> generate."""

from __future__ import annotations

import random

import pytest

from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import Generator, GeneratorSpec


@pytest.fixture(scope="module")
def gen(tiny_models) -> Generator:
    return Generator(str(tiny_models("bart")), backend="hf", max_new_tokens=4)


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the a cat sat on mat with hat and then ran far".split()
    return [
        "" if rng.random() < 0.1 else " ".join(rng.choices(words, k=rng.randint(1, 30))) for _ in range(n)
    ]


def one_by_one(gen: Generator, inputs: list[str]) -> list[list[str]]:
    """Each input alone through the batch layer: what any batching must reproduce."""
    out = []
    for text in inputs:
        if not text.strip():
            out.append([""])
            continue
        out.append(gen.detokenise(gen.generate_ids([gen.encode([text])[0].ids])[0]))
    return out


@pytest.mark.parametrize("batch_size,batch_tokens,window", [(3, None, 8), (16, 120, None), (5, None, 0)])
def test_generate_iterable_streams_in_input_order(gen: Generator, batch_size, batch_tokens, window) -> None:
    inputs = texts(40, seed=batch_size)
    calls: list[int] = []
    generate_output = gen.generate_output

    def spy(batch, indices=None):
        calls.append(len(batch))
        if batch_tokens is not None and len(batch) > 1:
            assert max(map(len, batch)) * len(batch) <= batch_tokens
        return generate_output(batch, indices)

    gen.generate_output = spy  # type: ignore[method-assign]
    try:
        stream = gen.generate_iterable(
            iter(inputs), batch_size=batch_size, batch_tokens=batch_tokens, sort_window=window
        )
        first = next(stream)  # streaming: the first output comes before the input is exhausted
        got = [first, *stream]
    finally:
        del gen.generate_output
    assert got == one_by_one(gen, inputs)
    assert max(calls) <= batch_size and sum(calls) == sum(1 for t in inputs if t.strip())


def test_generate_is_generate_iterable(gen: Generator) -> None:
    inputs = texts(10, seed=5)
    assert gen.generate(inputs, batch_size=4) == list(gen.generate_iterable(inputs, batch_size=4))


def test_generate_iterable_splits_a_batch_that_runs_out_of_memory(gen: Generator) -> None:
    inputs = [t for t in texts(12, seed=2) if t.strip()]
    generate_output = gen.generate_output
    sizes: list[int] = []

    def small_memory(batch, indices=None):
        sizes.append(len(batch))
        if len(batch) > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        return generate_output(batch, indices)

    gen.generate_output = small_memory  # type: ignore[method-assign]
    try:
        got = gen.generate(inputs, batch_size=8)
        assert got == one_by_one(gen, inputs) and max(sizes) > 2  # batches of one width bucket, split

        def always(batch, indices=None):
            raise MemoryError

        gen.generate_output = always  # type: ignore[method-assign]
        with pytest.raises(SeqgenError, match=r"input 1: out of memory \(input of \d+ tokens, run alone\)"):
            gen.generate(inputs[:1])
    finally:
        del gen.generate_output


def test_length_rules(gen: Generator, tiny_models) -> None:
    assert gen.new_token_limits() == (4, 0)
    enc_dec = Generator(str(tiny_models("bart")), backend="hf", max_length=10, min_length=3)
    assert enc_dec.new_token_limits() == (9, 2)  # the decoder start token counts
    causal = Generator(str(tiny_models("gpt2")), backend="hf", max_length=10, min_length=3)
    assert causal.new_token_limits(prompt_len=4)[0] == 6 and causal.new_token_limits(prompt_len=2)[1] == 1
    assert causal.num_return_sequences == 1 and causal.rows_per_input == 1


def test_the_spec_holds_the_settings_once(gen: Generator, tiny_models) -> None:
    """``Generator(model, **settings)`` builds its :class:`GeneratorSpec`: the settings the spec names, the rest
    generation settings; ``Generator(spec, **fields)`` builds that spec with those fields replaced."""
    model = str(tiny_models("bart"))
    assert gen.spec == GeneratorSpec(model, backend="hf", generation={"max_new_tokens": 4})
    seeded = Generator(gen.spec, seed=7)
    assert seeded.spec == GeneratorSpec(model, backend="hf", seed=7, generation={"max_new_tokens": 4})
    assert seeded.seed == 7 and seeded.new_token_limits() == gen.new_token_limits()


def test_flags_are_checked_once_before_the_model_loads(tiny_models, tmp_path) -> None:
    missing = str(tmp_path / "no-model")  # an error other than the flags' would come from the load
    with pytest.raises(SeqgenError, match="unknown generation setting"):
        Generator(missing, num_beemz=2)
    with pytest.raises(SeqgenError, match="contradict"):
        Generator(missing, max_new_tokens=5, max_length=9)
    given = Generator(
        str(tiny_models("bart")), backend="hf", max_new_tokens=3, max_length=None, num_beams=None
    )
    assert (
        given.new_token_limits()[0] == 3 and given.config.num_beams == given.model.generation_config.num_beams
    )


def test_the_first_output_comes_after_one_chunk_not_the_whole_window(gen: Generator) -> None:
    """The default look-ahead sorts 2048 inputs; the first window is one batch, so the first output needs only the
    first chunk of tokenised inputs (CHUNK_SIZE), not the window."""
    from seqgen_cli.batching import CHUNK_SIZE

    consumed = 0

    def lines():
        nonlocal consumed
        for i in range(3 * CHUNK_SIZE):
            consumed += 1
            yield f"input number {i}"

    stream = gen.generate_iterable(lines(), batch_size=4)
    next(stream)
    assert consumed <= CHUNK_SIZE


def test_device_stats_name_loader_and_engine(tiny_models) -> None:
    """--stats device: a decoder-only model loads through transformers (seqgen's own trees are encoder-decoders
    only: no note about them); generate() is the hf backend's engine."""
    fast = Generator(str(tiny_models("gpt2")), backend="fast", max_new_tokens=2).device_stats()
    assert fast["loader"] == "transformers" and fast["engine"] == "gpt2 decoder"
    hf = Generator(str(tiny_models("bart")), backend="hf", max_new_tokens=2).device_stats()
    assert hf["loader"] == "transformers" and hf["engine"] == "generate()"
