"""What a batch's cost counts beyond its caches and logits (``seqgen_cli/memory.py``), checked on the CPU against
the bytes of the tensors the encoder, the search and a decode step really make, and the free-memory budget read
again once per new batch shape (``torch.cuda.mem_get_info`` faked).

Measured: :class:`PeakBytes` counts every tensor storage the dispatched ops create while it is active, frees
included, and keeps the peak; tensors made before (weights, inputs) do not count.
"""

from __future__ import annotations

import math
import weakref
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GenerationConfig

from seqgen_cli.batching import LOGIT_BYTES, Item, MemoryLimit, plan_batches
from seqgen_cli.budget import HEADROOM, DeviceBudget
from seqgen_cli.generator import Generator
from seqgen_cli.memory import (
    CANDIDATE_BYTES,
    Dims,
    SearchDims,
    encoder_bytes,
    extra_bytes,
    graph_pool_bytes,
    search_bytes,
)
from seqgen_cli.models import get_backend
from seqgen_cli.models.capture import CapturedBackend
from seqgen_cli.search import Batch, beam, generate
from seqgen_cli.search.beam import CHUNK, wide_topk, wide_topk_bytes
from seqgen_cli.search.settings import rows_per_input
from seqgen_cli.shapes import graph_inputs, graph_positions, graph_width, input_width
from tests.tiny_models import load, load_tiny, text_batch

GiB = 2**30


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops create while active (an op's inputs still held as it returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()
        self.now = 0
        self.peak = 0

    def _free(self, key: int, nbytes: int) -> None:
        self.live.discard(key)
        self.now -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)  # one Python object per live storage
                if key not in given and key not in self.live:  # in place, a view, or counted: not new
                    self.live.add(key)
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.now)
        return out


def _sources(vocab: int, inputs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, vocab, (inputs, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, width // 2 :] = 0  # one padded source
    return ids, mask


# -- the encoder ---------------------------------------------------------------------------------------------------
def test_encoder_bytes_from_the_config(tiny_models) -> None:
    """BART's and T5's sizes as the config names them, and the formula's parts for 3 sources of 24 tokens."""
    bart = load_tiny(tiny_models("bart"))[0].config
    t5 = load_tiny(tiny_models("t5"))[0].config
    dims = Dims.of(bart, "encoder")
    assert dims == Dims(hidden=32, heads=4, inner=32, ffn=64, position_bias=False)
    assert Dims.of(t5, "encoder") == Dims(hidden=32, heads=4, inner=4 * 8, ffn=64, position_bias=True)
    b, s, e = 3, 24, 4
    scores = b * 4 * s * s * e  # [B, H, S, S]
    held = 3 * b * s * 32 * e + b * s * s * e  # embeddings, layer input, residual; [B, 1, S, S] mask
    attention = 5 * b * s * 32 * e + 2 * scores  # q, k, v, context (+ contiguous); scores and softmax
    feed_forward = scores + 4 * b * s * 64 * e + 2 * b * s * 32 * 4  # weights kept; [B, S, F] x 4; norm
    assert encoder_bytes(dims, b, s, e) == held + max(attention, feed_forward)
    t5_dims = Dims.of(t5, "encoder")
    assert t5_dims is not None  # T5: its [1, H, S, S] position bias held; sdpa's [B, H, S, S] bias mask
    t5_held, t5_attention = held + 4 * s * s * e, attention + scores
    assert encoder_bytes(t5_dims, b, s, e) == t5_held + max(t5_attention, feed_forward)


@pytest.mark.parametrize("family", ["bart", "t5", "flan-t5", "marian"])
@pytest.mark.parametrize(("inputs", "width"), [(3, 24), (4, 64), (2, 128), (8, 16)])
def test_encoder_bytes_bound_the_encoders_peak(tiny_models, family: str, inputs: int, width: int) -> None:
    """Eager attention materialises what the estimate counts (within 2x of the measured peak: short sources, where
    the feed-forward's four ``[B, S, F]`` count a composite activation's temporaries that Marian's one-op SiLU does
    not make; 1.4x where the scores dominate); sdpa (the CPU's fused flash attention) less."""
    model = load_tiny(tiny_models(family))[0]
    dims = Dims.of(model.config, "encoder")
    assert dims is not None
    estimate = encoder_bytes(dims, inputs, width, 4)
    ids, mask = _sources(model.get_input_embeddings().weight.shape[0], inputs, width)
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.inference_mode(), PeakBytes() as peak:
            model.get_encoder()(input_ids=ids, attention_mask=mask, return_dict=True)
        assert peak.peak <= estimate, (impl, peak.peak, estimate)
        if impl == "eager":
            assert estimate <= (2 if width < 64 else 1.4) * peak.peak, (peak.peak, estimate)


@pytest.mark.parametrize("name", ["t5gemma", "t5gemma2"])
def test_t5gemma_encoder_bytes_from_its_encoders_config(name: str) -> None:
    """T5Gemma names its stacks' sizes in a config per stack (T5Gemma 2: its encoder's text stack): the estimate
    reads the encoder's and bounds its attention's peak (grouped-query K/V heads: fewer bytes than counted)."""
    from tests.tiny_models import family_model, sources

    m = family_model(name)
    dims = Dims.of(m.config, "encoder")
    assert dims == Dims(hidden=32, heads=4, inner=4 * 8, ffn=64, position_bias=False)
    batch = sources(m.config, 8)
    estimate = encoder_bytes(dims, *batch.input_ids.shape, 4)
    with torch.inference_mode(), PeakBytes() as peak:
        m.get_encoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask, return_dict=True)
    assert peak.peak <= estimate <= 2 * peak.peak, (peak.peak, estimate)


# -- the search ----------------------------------------------------------------------------------------------------
class FakeLogits:
    """A backend whose steps make random logits (EOS favoured, so beams finish): only the search's tensors."""

    is_encoder_decoder = True

    def __init__(self, vocab: int, eos: int) -> None:
        self.vocab_size, self.eos = vocab, eos
        self.random = torch.Generator().manual_seed(0)

    def start(self, batch: Batch, rows_per_input: int, max_new_tokens: int) -> tuple[Any, None]:
        return None, None

    def step(self, state: Any, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.randn(tokens.shape[0], self.vocab_size, generator=self.random)
        logits[:, self.eos] += 2.5
        return logits

    def reorder(self, state: Any, rows: torch.Tensor) -> None:
        pass

    def keep(self, state: Any, keep: torch.Tensor, rows: torch.Tensor) -> None:
        pass


SEARCHES = {
    "greedy": {},
    "beam": dict(num_beams=3),
    "beam, n-grams": dict(num_beams=4, no_repeat_ngram_size=3),
    "beam, penalty, forced BOS": dict(num_beams=2, repetition_penalty=1.3, forced_bos_token_id=5),
    "sample": dict(do_sample=True, top_k=0),
    "sample, top-k": dict(do_sample=True, top_k=50),
    "sample, top-k, top-p": dict(do_sample=True, top_k=50, top_p=0.9, num_return_sequences=2),
}


def _config(new_tokens: int, **kwargs: Any) -> GenerationConfig:
    ids = dict(eos_token_id=2, pad_token_id=1, decoder_start_token_id=0, bos_token_id=0)
    return GenerationConfig(max_new_tokens=new_tokens, **ids, **kwargs)


def test_search_bytes_from_the_settings() -> None:
    """Beam search's parts: history (twice), finished hypotheses (four at once), the top-k over [B, K * V] (k + 1 chunks of
    it: wide_topk; tied rows' chunk flags and reduced rows: topk_in_order)."""
    b, k, t, v = 4, 3, 20, 600
    config = _config(t, num_beams=k)
    search = SearchDims.of(config)
    assert search == SearchDims("beam", 3, 6, ngrams=False, top_k=True, top_p=False)  # C = max(2, 1 + 1) * K
    n, c = b * k, 6
    history = 2 * n * (1 + t) * 8
    finished = 4 * b * k * t * 8
    chunks = math.ceil(k * v / CHUNK)
    reduced = max(math.ceil(64 * c / CHUNK), chunks // 8) * (CHUNK * 24 + 64)  # tied rows' reduced row, at its widest
    topk = b * (chunks * 4 + (c + 1) * CHUNK * 12 + c * CANDIDATE_BYTES)
    assert search_bytes(search, b, n, 1 + t, t, v) == history + finished + topk + b * (chunks * 24 + reduced)
    assert search_bytes(search, b, n, 1 + t, t, v, cpu=False) == history + finished + topk  # torch.topk: no ties path
    ngrams = SearchDims.of(_config(t, num_beams=k, no_repeat_ngram_size=3))
    assert (
        search_bytes(ngrams, b, n, 1 + t, t, v) - search_bytes(search, b, n, 1 + t, t, v)
        == 2 * n * (t + 2) * 8
    )
    sample = SearchDims.of(_config(t, do_sample=True, top_k=0))
    assert search_bytes(sample, b, b, 1 + t, t, v) == 2 * b * (1 + t) * 8 + 3 * b * v * 4


@pytest.mark.parametrize("name", list(SEARCHES))
@pytest.mark.parametrize(("inputs", "new_tokens"), [(4, 20), (16, 40)])
def test_search_bytes_bound_the_searchs_peak(name: str, inputs: int, new_tokens: int) -> None:
    """A whole search run's peak (its logits rows included) is at most the logits rows (``LOGIT_BYTES``) and
    :func:`search_bytes`, and at least 1/2.5 of them."""
    vocab, config = 600, _config(new_tokens, **SEARCHES[name])
    rows = inputs * rows_per_input(config)
    batch = Batch(torch.ones(inputs, 8, dtype=torch.long), torch.ones(inputs, 8, dtype=torch.long))
    with torch.inference_mode(), PeakBytes() as peak:
        generate(FakeLogits(vocab, 2), batch, config, seed=1)
    estimate = rows * vocab * LOGIT_BYTES + search_bytes(
        SearchDims.of(config), inputs, rows, 1 + new_tokens, new_tokens, vocab
    )
    assert peak.peak <= estimate <= 2.5 * peak.peak, (peak.peak, estimate)


def test_wide_topk_bytes_bound_its_peak_over_tied_rows() -> None:
    """Over rows tied at the top (bf16-rounded logits, beams apart by their running scores, as a search sees them)
    ``wide_topk`` reduces the rows to their kept chunks (``topk_in_order``) within ``wide_topk_bytes`` a row."""
    g = torch.Generator().manual_seed(0)
    b, beams, vocab, k = 6, 4, 54_776, 8
    logits = (torch.randn(b, beams, vocab, generator=g) * 3).to(torch.bfloat16).float()
    logits[:, 0, [100, 200]] = 20.0  # the best two tie: every row goes to topk_in_order
    running = torch.tensor([0.0, -1.5, -3.0, -4.5])[:, None]  # [K, 1]
    scores = (torch.log_softmax(logits, -1) + running).view(b, beams * vocab)
    with mock.patch.object(beam, "_topk_of_chunks", wraps=beam._topk_of_chunks) as by_chunks, PeakBytes() as peak:
        values, indices = wide_topk(scores, k)
    assert by_chunks.call_args.args[1].tolist() == list(range(b))  # every row by its chunks
    assert torch.equal(indices, torch.topk(scores, k).indices)
    assert 0 < peak.peak <= b * wide_topk_bytes(k, beams * vocab), (peak.peak, b * wide_topk_bytes(k, beams * vocab))


# -- the CUDA graphs' pool -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bart", "t5", "gpt2", "llama"])
def test_graph_pool_approximates_a_static_step(tiny_models, family: str) -> None:
    """The pool is approximated as one static step's activations: measured on the CPU's eager static step (the
    step a graph records), within 3x."""
    loaded = load(tiny_models(family))
    backend = get_backend(loaded.model)
    batch = text_batch(loaded, 7, seed=2)
    width, inputs, r = graph_width(batch.input_ids.shape[1]), graph_inputs(7), 4
    positions = graph_positions(10)
    batch = batch.padded(inputs, width, left=not backend.is_encoder_decoder)
    dims = Dims.of(loaded.model.config, "decoder")
    assert dims is not None
    estimate = graph_pool_bytes(dims, inputs, r, width, positions, backend.vocab_size, 4)
    with torch.inference_mode():
        state, _ = backend.start(batch, r, positions)
        state.cache.make_static()
        tokens = torch.zeros(inputs * r, dtype=torch.long)
        for _ in range(3):
            with PeakBytes() as peak:
                backend.step(state, tokens)
            assert peak.peak <= estimate <= 3 * peak.peak, (peak.peak, estimate)


# -- the batch's cost ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_batch_cost_grows_by_exactly_the_counted_terms(tiny_models, family: str) -> None:
    """``batch_bytes`` = caches + logits rows + encoder (encoder-decoder) + search, each from the shapes."""
    gen = Generator(str(tiny_models(family)), device="cpu", num_beams=2, max_new_tokens=6)
    backend, cfg = gen.model_backend(), gen.model.config
    v = backend.vocab_size
    for inputs, width in [(1, 8), (3, 24), (5, 40)]:
        new = gen.new_token_limits(width)[0]
        before = backend.cache_bytes(inputs, width, 2, new) + inputs * 2 * v * LOGIT_BYTES  # what it counted
        enc = Dims.of(cfg, "encoder")
        encoder = encoder_bytes(enc, inputs, width, 4) if cfg.is_encoder_decoder and enc is not None else 0
        history = (1 if cfg.is_encoder_decoder else width) + new
        search = search_bytes(SearchDims.of(gen.config), inputs, inputs * 2, history, new, v)
        assert gen.batch_bytes(inputs, width) == before + encoder + search
        assert search > 0 and (encoder > 0) == cfg.is_encoder_decoder


def test_captured_cost_counts_the_padded_shape_and_on_cuda_the_pool(tiny_models) -> None:
    """Under capture the encoder and the search count the padded shape; the graph pool only on CUDA."""
    loaded = load(tiny_models("bart"))
    model, config = loaded.model, _config(6, num_beams=2)
    captured = CapturedBackend(get_backend(model), lambda decode: decode)
    extra = extra_bytes(captured, model, config, 3, 20, 2, 6)
    # 3 inputs in 4 lanes, a width of 20 in 64 columns, 6 tokens in 64 positions
    inputs, width, positions = 4, 64, 64
    enc = Dims.of(model.config, "encoder")
    assert enc is not None
    dims = SearchDims.of(config)
    search = search_bytes(dims, inputs, inputs * 2, 1 + positions, positions, captured.vocab_size)
    assert extra == encoder_bytes(enc, inputs, width, 4) + search
    captured.device = torch.device("cuda", 0)  # sizes only: nothing runs
    dec = Dims.of(model.config, "decoder")
    assert dec is not None
    pool = graph_pool_bytes(dec, inputs, 2, width, positions, captured.vocab_size, 4)
    assert extra_bytes(captured, model, config, 3, 20, 2, 6) == extra + pool


# -- the budget, read again ----------------------------------------------------------------------------------------
def _fake_cuda(
    monkeypatch: pytest.MonkeyPatch, free: list[int], reserved: int = 0, allocated: int = 0
) -> list[int]:
    """``mem_get_info`` says ``free[0]`` (changed by the caller); returns the list its calls are appended to."""
    calls: list[int] = []

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        calls.append(free[0])
        return free[0], 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    return calls


def _items(*lengths: int) -> list[Item]:
    return [Item(i, [7] * n, f"input {i + 1}") for i, n in enumerate(lengths)]


def test_the_budget_is_read_once_per_new_shape(monkeypatch) -> None:
    free = [10 * GiB]
    calls = _fake_cuda(monkeypatch, free, reserved=3 * GiB, allocated=2 * GiB)
    reader = DeviceBudget(torch.device("cuda", 0), 5)
    reader.hold(GiB)  # a kept state's bytes, held for later batches
    budget = reader.after(_items(10, 12))  # a new shape: (2 inputs, width 16)
    assert budget == reader.limit == int((10 + 1 + 1) * GiB * (1 - HEADROOM)) and len(calls) == 1
    free[0] = 4 * GiB
    assert reader.after(_items(9, 16)) == budget  # (2, 16) again: not read
    assert reader.after(_items(9, 16, 3)) == int(6 * GiB * (1 - HEADROOM))  # (3, 16)
    reader.hold(-GiB)  # released
    reader.limit = 1
    assert reader.after(_items(20, 20)) == int(5 * GiB * (1 - HEADROOM))  # (2, 24); nothing kept
    assert len(calls) == reader.reads == 3
    reader.limit = 7
    assert reader.after([]) == 7 and len(calls) == 3  # nothing ran
    cpu = DeviceBudget.read(torch.device("cpu"))
    assert cpu.after(_items(10)) is None and len(calls) == 3  # no budget on the CPU


def test_the_budget_is_read_again_after_a_batch_that_compiled_or_kept_more(monkeypatch) -> None:
    """By default a shape's first batches run uncompiled: the batch that first compiles it (or allocates its kept
    state) is not the shape's first, and what it set up is no longer free, so the budget is read after it too."""
    free = [10 * GiB]
    calls = _fake_cuda(monkeypatch, free)
    reader = DeviceBudget(torch.device("cuda", 0), 5)
    budget = reader.after(_items(10, 12))  # a new shape, run uncompiled: read
    assert reader.after(_items(10, 12)) == budget and len(calls) == 1  # the same: not read
    reader.set_up()  # the next batch of the shape ran captured: its kept state allocated,
    reader.set_up()  # its shape compiled
    free[0] = 4 * GiB
    assert reader.after(_items(10, 12)) == int(4 * GiB * (1 - HEADROOM)) and len(calls) == 2
    reader.limit = 1
    assert reader.after(_items(10, 12)) == 1 and reader.reads == 2  # nothing new since


def test_the_kept_states_and_compiled_shapes_count_against_the_budget(tiny_models) -> None:
    """What the budget is read again after comes from the capture path itself: a kept state allocated and a shape
    compiled set something up, and the kept states' bytes are what the budget holds for them."""
    loaded = load(tiny_models("bart"))
    budget = DeviceBudget(torch.device("cpu"))
    captured = CapturedBackend(get_backend(loaded.model), lambda decode: decode, budget=budget)
    generate(captured, text_batch(loaded, 3, seed=2), _config(4, num_beams=2, min_new_tokens=4))
    assert budget.held == sum(kept.nbytes for kept in captured.kept.values()) > 0
    assert budget.set_ups == captured.stats()["kept_allocations"] + len(captured.shapes) >= 2


def test_a_budget_read_again_applies_to_the_rest_of_the_window() -> None:
    budget = [200]

    def cost(inputs: int, width: int) -> int:
        return inputs * 100

    batches = plan_batches([16] * 12, 32, None, memory=MemoryLimit(lambda: budget[0], cost))
    first = next(batches)
    budget[0] = 500  # read again after the first batch ran
    assert [first, *batches] == [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9, 10, 11]]


def test_generator_reads_its_budget_again_after_each_new_shape(tiny_models, monkeypatch) -> None:
    """A budget of 2 inputs, read again after the first batch as one of 5: batches of 2, 5, 5; one read per new
    shape ((2, w) and (5, w)), none per step or for the repeated shape."""
    gen = Generator(str(tiny_models("bart")), device="cpu", num_beams=2, max_new_tokens=6)
    texts = ["the same words in every line"] * 12
    width = input_width(len(gen.encode(texts[:1])[0].ids))
    gen.memory_budget = gen.batch_bytes(2, width)
    free = [math.ceil(gen.batch_bytes(5, width) / (1 - HEADROOM)) + 1]
    assert int(free[0] * (1 - HEADROOM)) < gen.batch_bytes(6, width)
    calls = _fake_cuda(monkeypatch, free)
    gen.budget.device = torch.device("cuda", 0)  # the model runs on the CPU; the budget as on CUDA
    sizes: list[int] = []
    real = gen.generate_output

    def spy(batch, indices=None):
        sizes.append(len(batch))
        return real(batch, indices)

    monkeypatch.setattr(gen, "generate_output", spy)
    outputs = list(gen.generate_iterable(texts, batch_size=32))
    assert len(outputs) == 12 and sizes == [2, 5, 5]
    assert len(calls) == 2 and gen.budget.shapes == {(2, width), (5, width)}
    assert gen.memory_budget == int(free[0] * (1 - HEADROOM))
