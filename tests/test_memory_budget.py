"""Memory-aware batching: a batch's budget counts the bytes its caches and logits take.

Each backend says what ``start()`` allocates (``cache_bytes``: cross and self K/V, K/V heads only under
grouped-query attention, back-pointers; capture's padding of inputs, widths and positions), checked here against
the tensors it really allocates; on CUDA the default budget is the free memory (``torch.cuda.mem_get_info``,
faked here), and the batcher cuts batches to fit it.
"""

from __future__ import annotations

import pytest
import torch

from seqgen_cli.batching import MemoryLimit, plan_batches
from seqgen_cli.budget import HEADROOM, free_memory_budget
from seqgen_cli.generator import Generator
from seqgen_cli.models import get_backend
from seqgen_cli.models.capture import CapturedBackend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.shapes import input_width
from tests.tiny_models import load, text_batch

GiB = 2**30


def _eager(decode):
    return decode


@pytest.mark.parametrize("family", ["bart", "t5", "gpt2", "llama"])
def test_cache_bytes_are_what_start_allocates(tiny_models, family: str) -> None:
    loaded = load(tiny_models(family))
    backend = get_backend(loaded.model)
    batch = text_batch(loaded, 3, seed=2)
    width = batch.input_ids.shape[1]
    state, _ = backend.start(batch, 2, 7)
    assert backend.cache_bytes(3, width, 2, 7) == sum(backend.cache_nbytes(state).values())


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_captured_cache_bytes_count_the_padding(tiny_models, family: str) -> None:
    """3 inputs run in 4 lanes, a width of 20 in 64 columns, 7 new tokens in 64 positions."""
    loaded = load(tiny_models(family))
    captured = CapturedBackend(get_backend(loaded.model), _eager)
    batch = text_batch(loaded, 3, seed=2)
    width = batch.input_ids.shape[1]
    state, _ = captured.start(batch, 2, 7)
    inner = captured.backend
    assert captured.cache_bytes(3, width, 2, 7) == sum(inner.cache_nbytes(state.inner).values())
    assert captured.cache_bytes(3, width, 2, 7) == inner.cache_bytes(4, 64, 2, 64)
    assert captured.cache_bytes(3, width, 2, 7) > inner.cache_bytes(3, width, 2, 7)


def test_grouped_query_attention_counts_only_the_kv_heads(tiny_models) -> None:
    loaded = load(tiny_models("llama"))
    cfg = loaded.model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads, "the fixture has grouped-query attention"
    backend = get_backend(loaded.model)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    one_more_prompt_token = backend.cache_bytes(1, 11, 1, 5) - backend.cache_bytes(1, 10, 1, 5)
    assert one_more_prompt_token == per_token + 4  # + its float32 mask entry
    # a generated position of each of 3 rows: K/V per row + its back-pointers (int64)
    assert backend.cache_bytes(1, 10, 3, 6) - backend.cache_bytes(1, 10, 3, 5) == 3 * (per_token + 8)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_generic_backend_counts_transformers_caches(tiny_models, family: str) -> None:
    """generate()'s caches (the generic backend's): every row holds the source's K/V (and encoder states)."""
    loaded = load(tiny_models(family))
    backend = GenericBackend(loaded.model)
    batch = text_batch(loaded, 2, seed=3)
    b, s = batch.input_ids.shape
    state, _ = backend.start(batch, 3, 4)
    tokens = torch.zeros(b * 3, dtype=torch.long)
    steps = 4 if loaded.model.config.is_encoder_decoder else 3  # decoder-only: the prefill gives the first
    for _ in range(steps):
        backend.step(state, tokens)
    cache = state.cache
    layers = (
        [*cache.self_attention_cache.layers, *cache.cross_attention_cache.layers]
        if (hasattr(cache, "cross_attention_cache"))
        else list(cache.layers)
    )
    held = sum(x.keys.nbytes + x.values.nbytes for x in layers)
    if state.encoder_outputs is not None:
        held += state.encoder_outputs.last_hidden_state.nbytes
    new_tokens = 4 if loaded.model.config.is_encoder_decoder else 3
    assert backend.cache_bytes(b, s, 3, new_tokens) == held


def test_default_budget_on_cuda_is_the_free_memory(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GiB)
    assert free_memory_budget(torch.device("cuda", 0)) == int(12 * GiB * (1 - HEADROOM))
    assert free_memory_budget(torch.device("cpu")) is None


def test_batches_fit_the_memory_budget() -> None:
    lengths = [16] * 5 + [40] * 3  # two width buckets: batches never mix them

    def cost(inputs: int, width: int) -> int:
        return inputs * width * 100

    assert list(plan_batches(lengths, 32, None, memory=MemoryLimit(5000, cost))) == [
        [0, 1, 2],
        [3, 4],
        [5],
        [6],
        [7],
    ]
    assert list(plan_batches(lengths, 32, None, memory=None)) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    too_big = MemoryLimit(10, cost)  # nothing fits: each input alone, none dropped
    assert list(plan_batches(lengths, 32, None, memory=too_big)) == [[i] for i in range(8)]


def test_capture_padding_shrinks_the_batch(tiny_models) -> None:
    """A budget that holds 4 inputs: 5 would run in 8 padded lanes, so the captured path cuts at 4, while the
    eager path (no padding) takes 6."""
    loaded = load(tiny_models("bart"))
    eager = get_backend(loaded.model)
    captured = CapturedBackend(get_backend(loaded.model), _eager)

    def limit(backend) -> MemoryLimit:
        return MemoryLimit(captured.cache_bytes(4, 64, 2, 10), lambda n, w: backend.cache_bytes(n, w, 2, 10))

    lengths = [60] * 6
    assert list(plan_batches(lengths, 32, None, memory=limit(captured))) == [[0, 1, 2, 3], [4, 5]]
    assert list(plan_batches(lengths, 32, None, memory=limit(eager))) == [list(range(6))]


def test_generator_sizes_batches_by_its_memory_budget(tiny_models, monkeypatch) -> None:
    gen = Generator(str(tiny_models("bart")), device="cpu", num_beams=2, max_new_tokens=6)
    assert gen.memory_budget is None, "no limit on the CPU by default"
    sizes: list[int] = []
    real = gen.generate_output

    def spy(batch, indices=None):
        sizes.append(len(batch))
        return real(batch, indices)

    monkeypatch.setattr(gen, "generate_output", spy)
    texts = ["the same words in every line"] * 10
    width = input_width(len(gen.encode(texts[:1])[0].ids))  # the width the batch is padded to
    baseline = list(gen.generate_iterable(texts, batch_size=32))
    assert sizes == [10]
    gen.memory_budget = gen.batch_bytes(4, width)
    assert gen.batch_bytes(4, width) < gen.batch_bytes(5, width)
    sizes.clear()
    assert list(gen.generate_iterable(texts, batch_size=32)) == baseline
    assert sizes == [4, 4, 2]


def test_cuda_generator_takes_its_budget_from_free_memory(tiny_models, monkeypatch) -> None:
    """The default budget is read when the Generator is built (the model loaded), from the device it runs on."""
    seen = []

    def fake(device):
        seen.append(device)
        return 123 * GiB

    monkeypatch.setattr("seqgen_cli.budget.free_memory_budget", fake)
    gen = Generator(str(tiny_models("bart")), device="cpu", num_beams=2, max_new_tokens=6)
    assert gen.memory_budget == 123 * GiB and seen == [torch.device("cpu")]
    limit = gen.budget.memory_limit(gen.batch_bytes)
    assert limit is not None and limit.budget == 123 * GiB and limit.cost(3, 20) == gen.batch_bytes(3, 20)
