"""Kept state buffers on the capture path (``models/capture.py``): one static state per captured batch shape for
the :class:`CapturedBackend`'s life, on the CPU with the stand-in "eager" compiler (and inductor, slow).

* over runs of 50+ batches of mixed lengths, input counts and settings through one backend, the state a shape
  runs on (encoder outputs or prompt K/V, masks, self-attention cache, back-pointers, counters, the step's
  tokens) keeps its addresses, every batch and every compaction; one allocation per shape; the outputs are the
  plain backend's tokens, and bit for bit (tokens and scores) those of fresh buffers for every batch;
* a later batch refills a kept state exactly as a fresh ``start`` fills a new one, a compaction copies exactly
  what ``keep`` keeps; the bytes ``cache_bytes`` promises are what a refilled or compacted state holds;
* kept states stay within the device budget (least recently used released first), an out-of-memory error
  releases them, and a batch whose buffers a later batch took cannot step on silently;
* ``stats()`` reports the kept states (and, on CUDA, the CUDA graphs recorded; counted here on stand-in trees).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import Any

import pytest
import torch

from seqgen_cli.budget import DeviceBudget
from seqgen_cli.config import resolve_generation_config
from seqgen_cli.generator import Generator
from seqgen_cli.models import capture, get_backend, linear_maps
from seqgen_cli.models.capture import CapturedBackend, CapturedState, Decode
from seqgen_cli.models.kept import tensors_of
from seqgen_cli.search import Batch, generate
from seqgen_cli.shapes import graph_positions, graph_width
from tests.tiny_models import load, text_batch

FAMILIES = ["bart", "t5", "gpt2", "llama"]


def eager(decode: Decode) -> Decode:
    """A "compiler" that keeps ``decode`` as it is: the capture wrapper's logic without compiling."""
    return decode


def state_buffers(inner: Any) -> list[torch.Tensor]:
    """The tensors of a wrapped backend's state that a captured step reads as its state (what CUDA graphs read in
    place), not the step's intermediates (the attention biases ``begin`` builds)."""
    cache = inner.cache
    common = [cache.ptr, cache.steps]
    held = [*cache.fixed.tensors(), cache.fixed.bias, *cache.generated.tensors(), *common]
    if hasattr(inner, "self_bias"):  # encoder-decoder: T5's relative position bias
        return [*held, *([] if inner.self_bias is None else [inner.self_bias])]
    return [*held, inner.start_pos]


class Watched(CapturedBackend):
    """A :class:`CapturedBackend` that records, after every start and compaction, the addresses of the state each
    shape runs on. It holds every tensor it saw, so no later allocation can land where a freed one was (fresh
    buffers always show as new addresses)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.addresses: defaultdict[tuple, set[tuple[int, ...]]] = defaultdict(set)
        self.uses: Counter[tuple] = Counter()
        self.compactions = 0
        self.held: list[list[torch.Tensor]] = []

    def _saw(self, state: CapturedState) -> None:
        tensors = [*state_buffers(state.inner), state.tokens]
        key = (state.rows_per_input, *state.shape)  # rows per input, physical rows, width, positions
        self.addresses[key].add(tuple(t.data_ptr() for t in tensors))
        self.uses[key] += 1
        self.held.append(tensors)

    def start(self, batch: Batch, rows_per_input: int, max_new_tokens: int) -> Any:
        state, first = super().start(batch, rows_per_input, max_new_tokens)
        self._saw(state)
        return state, first

    def keep(self, state: CapturedState, keep: torch.Tensor, rows: torch.Tensor) -> None:
        before = state.shape
        super().keep(state, keep, rows)
        if state.shape != before:
            self.compactions += 1
            self._saw(state)


SETTINGS = [  # rows per input 3, 1 and 2: shapes of every kind
    dict(num_beams=3, max_new_tokens=10),
    dict(num_beams=1, max_new_tokens=12),
    dict(do_sample=True, num_return_sequences=2, max_new_tokens=8),
]
INPUTS = [5, 1, 8, 3, 7]  # graph inputs 8, 1, 8, 4, 8 (and, compacted, 4, 2, 1)
LENGTHS = [40, 90]  # longest source / prompt tokens: graph widths 64 and (mostly) 128


def mixed_batches(loaded: Any, n: int) -> list[tuple[Batch, dict[str, Any]]]:
    """``n`` batches of mixed input counts, lengths and settings (cycles of coprime lengths: each shape comes back
    in other company)."""
    cycle = zip(itertools.cycle(INPUTS), itertools.cycle(LENGTHS), itertools.cycle(SETTINGS), strict=False)
    return [
        (text_batch(loaded, count, seed=100 + i, max_tokens=tokens), setting)
        for i, (count, tokens, setting) in zip(range(n), cycle, strict=False)
    ]


def run(backend: Any, loaded: Any, batch: Batch, setting: dict[str, Any]) -> Any:
    config = resolve_generation_config(loaded.model.generation_config, None, setting)
    return generate(backend, batch, config, seed=7)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_state_per_shape_over_a_run_of_mixed_batches(tiny_models, family: str) -> None:
    """56 batches through one backend: each shape's state keeps its addresses over every batch and compaction
    that runs on it, and is allocated once; the tokens are the plain backend's, and tokens and scores are bit for
    bit those of a new backend (fresh buffers) for every batch."""
    loaded = load(tiny_models(family))
    inner = get_backend(loaded.model)
    backend = Watched(inner, eager)
    for i, (batch, setting) in enumerate(mixed_batches(loaded, 56)):
        out, plain = run(backend, loaded, batch, setting), run(inner, loaded, batch, setting)
        assert out.sequences == plain.sequences, f"batch {i}: not the plain backend's tokens"
        fresh = run(CapturedBackend(inner, eager), loaded, batch, setting)  # new buffers, as every batch had
        assert (out.sequences, out.scores) == (fresh.sequences, fresh.scores), f"batch {i}: not as fresh"
    moved = {key: len(seen) for key, seen in backend.addresses.items() if len(seen) > 1}
    assert not moved, f"state addresses changed within a shape (shape: addresses seen): {moved}"
    assert backend.pool.allocations.total() == len(backend.addresses), (
        backend.pool.allocations,
        backend.uses,
    )
    assert set(backend.pool.allocations.values()) == {1}
    reused = backend.uses.total() - len(backend.addresses)  # batches and compactions on a kept state
    assert reused >= 30 and backend.compactions >= 5, (backend.uses, backend.compactions)
    assert len({key[2] for key in backend.addresses}) == 2, "graph widths 64 and 128"
    stats = backend.stats()
    assert stats["kept_shapes"] == stats["kept_allocations"] == len(backend.addresses)
    assert stats["kept_released"] == 0 and stats["kept_bytes"] > 0
    assert "cuda_graphs_recorded" not in stats, "not on the CPU"


def test_a_generator_run_of_fifty_batches_keeps_its_buffers(tiny_models) -> None:
    """The Generator's own path (tokenising, length-sorted windows, batches of 4): 50 batches, the eager
    Generator's outputs, one allocation per shape, every shape's addresses fixed; ``--stats`` shows it."""
    from seqgen_cli.pipeline.stats import Summary
    from tests.tiny_models import sample_texts

    model = str(tiny_models("bart"))
    texts = sample_texts(200, seed=21)
    plain = Generator(model, device="cpu", num_beams=2, max_new_tokens=8)
    expected = list(plain.generate_iterable(texts, batch_size=4))
    gen = Generator(model, device="cpu", num_beams=2, max_new_tokens=8)
    backend = Watched(gen.model_backend(), eager)
    gen._model_backend = backend
    assert list(gen.generate_iterable(texts, batch_size=4)) == expected
    assert backend.uses.total() - backend.compactions >= 50, "batches"
    assert all(len(seen) == 1 for seen in backend.addresses.values()), backend.addresses
    assert backend.pool.allocations.total() == len(backend.addresses) <= 16
    stats = gen.device_stats()
    assert stats["kept_shapes"] == stats["kept_allocations"] == len(backend.addresses)
    assert Summary(backend="fast", device=stats).line()  # the closing line takes the new keys


@pytest.mark.parametrize("family", FAMILIES)
def test_restart_fills_a_kept_state_as_start_fills_a_new_one(tiny_models, family: str) -> None:
    """A state of an earlier batch (stepped, reordered: stale everywhere) refilled by ``restart`` holds exactly
    what ``start`` (and capture's ``make_static``) gives the new batch, in its own tensors; the first logits too."""
    loaded = load(tiny_models(family))
    backend = get_backend(loaded.model)
    left = not backend.is_encoder_decoder
    r, positions = 2, 64
    first_batch, second = (
        b.padded(4, 64, left) for b in (text_batch(loaded, 3, seed=1), text_batch(loaded, 4, seed=2))
    )
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        kept, _ = backend.start(first_batch, r, positions)
        kept.cache.make_static()
        for t in range(5):
            backend.step(kept, torch.randint(4, backend.vocab_size, (4 * r,), generator=g))
            if t == 2:
                backend.reorder(kept, torch.tensor([1, 1, 2, 3, 5, 4, 7, 7]))
        addresses = [x.data_ptr() for x in state_buffers(kept)]
        first = backend.restart(kept, second)
        new, new_first = backend.start(second, r, positions)
        new.cache.make_static()
    assert [x.data_ptr() for x in state_buffers(kept)] == addresses, "restart allocated"
    assert kept.t == new.t == 0 and kept.cache.span == new.cache.span
    for ours, theirs in zip(state_buffers(kept), state_buffers(new), strict=True):
        assert torch.equal(ours, theirs)
    assert (first is None) == (new_first is None) and (first is None or torch.equal(first, new_first))
    with torch.inference_mode(), pytest.raises(ValueError, match="cannot restart"):
        backend.restart(kept, text_batch(loaded, 2, seed=1).padded(2, 64, left))


@pytest.mark.parametrize("family", FAMILIES)
def test_compact_copies_what_drop_keeps(tiny_models, family: str) -> None:
    """Compaction into a kept state (stale, of an earlier batch) holds what ``keep`` keeps (written positions, zeros
    after them, back-pointers, counters), into the same tensors; the source state is left as it was."""
    loaded = load(tiny_models(family))
    backend = get_backend(loaded.model)
    r, positions, steps = 2, 64, 4
    batch = text_batch(loaded, 4, seed=3).padded(4, 64, not backend.is_encoder_decoder)
    keep, rows = torch.tensor([0, 3]), torch.tensor([0, 1, 6, 7])
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        state, _ = backend.start(batch, r, positions)
        state.cache.make_static()
        for t in range(steps):
            backend.step(state, torch.randint(4, backend.vocab_size, (4 * r,), generator=g))
            if t == 1:
                backend.reorder(state, torch.tensor([1, 0, 2, 2, 4, 5, 7, 6]))
        target = backend.keep_into(state, torch.tensor([2, 1]), torch.tensor([4, 5, 2, 3]))  # a stale one
        backend.step(target, torch.randint(4, backend.vocab_size, (2 * r,), generator=g))
        addresses = [x.data_ptr() for x in state_buffers(target)]
        before = [x.clone() for x in state_buffers(state)]
        assert backend.keep_into(state, keep, rows, into=target) is target
        assert [x.data_ptr() for x in state_buffers(target)] == addresses
        assert all(torch.equal(x, y) for x, y in zip(state_buffers(state), before, strict=True))
        backend.keep(state, keep, rows)  # what the plain engine keeps
    assert target.t == state.t == steps
    for ours, theirs in zip(state_buffers(target), state_buffers(state), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_cache_bytes_describe_a_refilled_and_a_compacted_state(tiny_models, family: str) -> None:
    """What a batch holds is its shape's kept state: ``cache_bytes`` counts it, refilled or compacted into (GPT-2's
    prompt values have storage of their own: not views of the prefill's q|k|v output)."""
    loaded = load(tiny_models(family))
    captured = CapturedBackend(get_backend(loaded.model), eager)
    inner = captured.backend
    for seed in (2, 4):  # the second batch refills the first one's state
        batch = text_batch(loaded, 3, seed=seed, max_tokens=20)
        state, _ = captured.start(batch, 2, 7)
        width = batch.input_ids.shape[1]
        assert captured.cache_bytes(3, width, 2, 7) == sum(inner.cache_nbytes(state.inner).values())
        held, caches = state.kept.nbytes - state.tokens.nbytes, sum(inner.cache_nbytes(state.inner).values())
        assert caches <= held <= 1.05 * caches, "kept bytes: the caches (and masks, counters), not more"
    captured.keep(state, torch.tensor([0]), torch.tensor([0, 1]))  # 4 lanes -> 1
    assert state.shape[0] == 2
    assert sum(inner.cache_nbytes(state.inner).values()) == inner.cache_bytes(1, 64, 2, 64)
    assert captured.stats()["kept_bytes"] == sum(k.nbytes for k in captured.kept.values())


def test_kept_states_stay_within_the_budget(tiny_models) -> None:
    """A budget that holds about two batches' states: a new shape releases the least recently used idle
    state (never the running one), the outputs stay the plain backend's, and a released shape that comes back is
    allocated again."""
    loaded = load(tiny_models("bart"))
    inner = get_backend(loaded.model)
    probe = CapturedBackend(inner, eager)
    widths = {}
    for tokens in (12, 90):
        widths[tokens] = probe.pool.batch_bytes((8, 3, graph_width(tokens), graph_positions(10)))
    backend = Watched(inner, eager, budget=DeviceBudget(torch.device("cpu"), 2 * widths[90] + widths[12]))
    batches = mixed_batches(loaded, 21)
    for batch, setting in batches:
        out = run(backend, loaded, batch, setting)
        assert out.sequences == run(inner, loaded, batch, setting).sequences
        assert (
            sum(k.nbytes for k in backend.kept.values())
            == backend.pool.budget.held
            <= backend.pool.budget.limit
        )
    assert (
        backend.pool.released > 0
        and backend.pool.allocations.total() == len(backend.kept) + backend.pool.released
    )
    assert max(backend.pool.allocations.values()) > 1, "a released shape came back: allocated again"


def test_out_of_memory_releases_the_kept_states(tiny_models) -> None:
    """An out-of-memory error in a step releases every kept state before it is raised (the batch is split: its
    halves need the memory); the next batch allocates afresh and runs as before."""
    loaded = load(tiny_models("bart"))
    inner = get_backend(loaded.model)
    failing = {"now": False}

    def compiler(decode: Decode) -> Decode:
        def run(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            if failing["now"]:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return decode(state, tokens)

        return run

    backend = CapturedBackend(inner, compiler)
    batch = text_batch(loaded, 5, seed=5)
    setting = dict(num_beams=3, max_new_tokens=10)
    run(backend, loaded, text_batch(loaded, 3, seed=1), setting)
    run(backend, loaded, text_batch(loaded, 1, seed=1), setting)
    assert len(backend.kept) >= 2
    failing["now"] = True
    with pytest.raises(torch.OutOfMemoryError):
        run(backend, loaded, batch, setting)
    failing["now"] = False
    assert not backend.kept and backend.pool.released >= 2
    assert run(backend, loaded, batch, setting).sequences == run(inner, loaded, batch, setting).sequences


def test_a_batch_whose_state_was_taken_cannot_step_on(tiny_models) -> None:
    """One batch at a time: a second batch of the same shape takes the kept state; the first one fails loudly
    instead of reading the second one's caches."""
    loaded = load(tiny_models("bart"))
    backend = CapturedBackend(get_backend(loaded.model), eager)
    first, _ = backend.start(text_batch(loaded, 3, seed=1), 2, 8)
    second, _ = backend.start(text_batch(loaded, 4, seed=2), 2, 8)
    assert second.inner is first.inner and backend.pool.allocations.total() == 1
    tokens = torch.zeros(6, dtype=torch.long)
    with pytest.raises(RuntimeError, match="taken by a later batch"):
        backend.step(first, tokens)
    backend.step(second, torch.zeros(8, dtype=torch.long))
    with pytest.raises(RuntimeError, match="taken by a later batch"):
        backend.reorder(first, torch.arange(6))


def recording(fn: Any) -> Any:
    """A "compiler" that announces a CUDA graph recording as cudagraph trees do (torch.compile's start callbacks,
    trigger ``CUDAGRAPH_RECORDING``) the first time a call's input addresses are new (its state's first tensor and
    the input's shape), and runs ``fn`` as it is."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    seen: set[tuple[Any, ...]] = set()

    def run(state: Any, x: torch.Tensor) -> Any:
        key = (tuple(x.shape), next(tensors_of(state)).data_ptr())
        if key not in seen:
            seen.add(key)
            with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "test"):
                pass
        return fn(state, x)

    return run


def test_cuda_graph_recordings_are_counted_per_shape(tiny_models) -> None:
    """``--stats`` counts the CUDA graphs each compiled shape's calls recorded (model steps and search steps), read
    from torch.compile's recording callbacks (counted again after a ``torch._dynamo.reset``, which clears them):
    over 50 batches on kept states every shape records once; the CPU with nothing recorded reports nothing."""
    from tests.tiny_models import sample_texts

    model, texts = str(tiny_models("bart")), sample_texts(200, seed=21)
    gen = Generator(model, device="cpu", num_beams=2, max_new_tokens=8)
    backend = CapturedBackend(gen.model_backend(), recording, search_compiler=recording)
    gen._model_backend = backend
    torch._dynamo.reset()  # clears torch.compile's callbacks: the next batch registers the count again
    assert "cuda_graphs_recorded" not in backend.stats(), "nothing recorded on the CPU: nothing reported"
    list(gen.generate_iterable(texts, batch_size=4))
    stats = backend.stats()
    per_shape = stats["cuda_graphs_recorded_per_shape"]
    assert set(per_shape.values()) == {1}, per_shape
    models = {name for name in per_shape if name.startswith("model ")}
    assert models == {"model " + capture.shape_name(shape) for shape in backend.shapes}, (
        models,
        backend.shapes,
    )
    assert len(per_shape) > len(models) >= 2 and stats["cuda_graphs_recorded"] == len(per_shape)
    assert stats["kept_allocations"] == stats["kept_shapes"], "one recording per shape: one state per shape"


@pytest.mark.slow  # inductor compiles 2 shapes: about a minute on a loaded 2-core box
def test_kept_states_through_the_real_compiler(tiny_models, monkeypatch) -> None:
    """``decode`` compiled whole by inductor (CPU): batches of two inputs (shapes of 2 inputs and, compacted, 1)
    refill the kept states; every step runs compiled, no shape compiles twice, the tokens are the plain ones."""
    monkeypatch.setattr(linear_maps, "ONEDNN", False)  # oneDNN's fused linear does not lower in inductor
    loaded = load(tiny_models("bart"))
    inner = get_backend(loaded.model)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]

    def inductor(decode: Decode) -> Decode:
        return torch.compile(decode, fullgraph=True, dynamic=False)

    before = graphs["unique_graphs"]
    backend = Watched(inner, inductor)
    setting = dict(num_beams=2, max_new_tokens=8)
    for seed in range(6):
        batch = text_batch(loaded, 2, seed=200 + seed, max_tokens=30)
        assert run(backend, loaded, batch, setting).sequences == run(inner, loaded, batch, setting).sequences
    assert backend.path == "captured" and backend.steps["eager"] == 0
    assert all(len(seen) == 1 for seen in backend.addresses.values()), backend.addresses
    assert backend.compactions >= 1 and backend.pool.allocations.total() == len(backend.addresses) == 2
    assert graphs["unique_graphs"] - before == len(backend.shapes), "a shape compiled again"
