"""The refill engine (``search/refill.py``, ``--refill``): token-identical to ``generate()`` with joins at many
different steps, and an input's output (tokens and scores, bit for bit) does not depend on its neighbours or
on when it joined."""

from __future__ import annotations

import json
import random

import pytest
import torch

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import get_backend
from seqgen_cli.search import Batch
from seqgen_cli.search.refill import RefillStats, generate_refill
from seqgen_cli.shapes import MIN_WIDTH
from tests.equivalence import COMPILED_TOL, MASKED_SUM_RTOL, SETTINGS, check_equivalence, refill
from tests.tiny_models import load, text_batch

ENC_DEC = ["bart", "mbart", "marian", "pegasus", "t5", "flan-t5"]
DEC_ONLY = ["gpt2", "llama"]
EVERY_SETTING = ["bart", "t5", "gpt2"]  # every setting; the other families a few
FEW = ["greedy", "beam4_ngram3_lp2_minmax_es", "beam4_nrs3"]
BATCH = 16


def cases() -> list[tuple[str, str]]:
    return [(f, s) for f in ENC_DEC + DEC_ONLY for s in (SETTINGS if f in EVERY_SETTING else FEW)]


@pytest.mark.parametrize(("family", "setting"), cases())
def test_refill_equivalence(tiny_models, family: str, setting: str) -> None:
    loaded = load(tiny_models(family))
    stats = RefillStats()
    engine = refill(lanes=5, seed=len(setting), min_free=2, stats=stats)
    result = check_equivalence(
        loaded.model,
        get_backend,
        text_batch(loaded, BATCH),
        SETTINGS[setting],
        engine=engine,
        rtol=MASKED_SUM_RTOL,
    )
    print(
        f"{family} {setting} refill: {result.summary()}; occupancy {stats.occupancy:.2f}, {stats.joins} joins"
    )
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    if SETTINGS[setting].get("num_beams", 1) == 1:
        assert result.identical == result.total
    assert stats.joins >= 3  # inputs joined at several different steps


def run_alone(backend, batch: Batch, config, i: int):
    one = Batch(batch.input_ids[i : i + 1], batch.attention_mask[i : i + 1])  # decoder-only: the same width
    return generate_refill(backend, one, config, lanes=1)


@pytest.mark.parametrize("family", ["bart", "t5", *DEC_ONLY])
@pytest.mark.parametrize(
    "setting", ["beam4_ngram3_lp2_minmax_es", "beam4_nrs3", "greedy_rep1.3_ngram2_default_len"]
)
def test_refill_output_independent_of_neighbours(tiny_models, family: str, setting: str) -> None:
    """Each input alone, then among the others in shuffled orders, lane counts and join thresholds (so it joins
    at other steps, beside other inputs, in another lane): the same tokens and scores, bit for bit. Decoder-only
    prompts of 6 to 293 tokens: joiners are prefilled in groups of several widths and a long one widens every
    lane's prompt region mid-run."""
    loaded = load(tiny_models(family))
    long_prompts = family in DEC_ONLY
    model, batch = loaded.model, text_batch(loaded, 12, seed=3, max_tokens=300 if long_prompts else 40)
    if long_prompts:
        assert batch.attention_mask.sum(dim=1).max() > 2 * MIN_WIDTH  # widens twice
    config = resolve_generation_config(model.generation_config, None, SETTINGS[setting])
    backend = get_backend(model)
    alone = [run_alone(backend, batch, config, i) for i in range(12)]
    join_counts = set()
    for trial, (lanes, min_free) in enumerate([(4, 1), (3, 2), (5, 1), (7, 3)]):
        stats = RefillStats()
        out = refill(lanes, seed=trial, min_free=min_free, stats=stats)(backend, batch, config)
        join_counts.add(stats.joins)
        for i in range(12):
            assert out.sequences[i] == alone[i].sequences[0], f"trial {trial}, input {i}"
            if out.scores is not None:
                assert out.scores[i] == alone[i].scores[0], f"trial {trial}, input {i}"
    assert len(join_counts) > 1  # the schedules differ


@pytest.mark.parametrize("family", DEC_ONLY)
def test_refill_prompt_widths(tiny_models, family: str) -> None:
    """Decoder-only ``widths``: each prompt counts its positions (``max_length``, ``min_length``) from its own width,
    as ``generate()`` on it padded to that width alone does; inputs of several widths share the lanes."""
    from seqgen_cli.shapes import input_width
    from seqgen_cli.verify import compare

    loaded = load(tiny_models(family))
    model, batch = loaded.model, text_batch(loaded, 12, seed=3, max_tokens=40)
    kwargs = SETTINGS["beam4_maxlen48_minlen44"]  # lengths count the padded prompt
    config = resolve_generation_config(model.generation_config, None, kwargs)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    widths = [input_width(n) for n in lengths]
    assert len(set(widths)) > 2
    order = list(range(12))
    random.Random(0).shuffle(order)
    out = generate_refill(get_backend(model), batch, config, lanes=4, order=order, widths=widths)
    same_width = generate_refill(get_backend(model), batch, config, lanes=4, order=order)
    assert out.sequences != same_width.sequences  # the widths matter here
    for w in sorted(set(widths)):
        group = [i for i in range(12) if widths[i] == w]
        cols = slice(batch.input_ids.shape[1] - w, None)
        prompts = Batch(batch.input_ids[group, cols], batch.attention_mask[group, cols])
        ours = [out.sequences[i] for i in group]
        result = compare(model, prompts, kwargs, ours, [out.scores[i] for i in group])
        assert not result.mismatches, (w, result.mismatches[:3])


@pytest.mark.parametrize("family", ["bart", "gpt2", "llama"])
def test_refill_sampling_stream_per_input(tiny_models, family: str) -> None:
    """Sampling: an input's draws depend on the seed and its index only: the same outputs in any order, beside
    any neighbours, and in a part of the run (a resumed or sharded run) given the same indices."""
    loaded = load(tiny_models(family))
    model, batch = loaded.model, text_batch(loaded, 10, seed=1)
    kwargs = dict(do_sample=True, num_return_sequences=2, top_k=20, max_new_tokens=12)
    config = resolve_generation_config(model.generation_config, None, kwargs)
    backend = get_backend(model)
    whole = generate_refill(backend, batch, config, lanes=4, seed=7)
    shuffled = generate_refill(backend, batch, config, lanes=3, seed=7, order=[9, 2, 5, 0, 1, 8, 3, 7, 6, 4])
    assert shuffled.sequences == whole.sequences
    tail = Batch(batch.input_ids[6:], batch.attention_mask[6:])  # a shard: inputs 6..9
    part = generate_refill(backend, tail, config, lanes=2, seed=7, indices=range(6, 10))
    assert part.sequences == whole.sequences[6:]
    other_seed = generate_refill(backend, batch, config, lanes=4, seed=8)
    assert other_seed.sequences != whole.sequences
    assert len({tuple(map(tuple, s)) for s in whole.sequences}) > 1  # sampling differs across inputs


def test_refill_occupancy_counts(tiny_models) -> None:
    """Steps run, row-steps and live row-steps add up: a full batch at first, idle rows only at the tail."""
    loaded = load(tiny_models("bart"))
    model, batch = loaded.model, text_batch(loaded, 16, seed=2)
    config = resolve_generation_config(model.generation_config, None, SETTINGS["beam4_lp0.6"])
    stats = RefillStats()
    generate_refill(get_backend(model), batch, config, lanes=4, stats=stats)
    assert stats.row_steps == stats.steps * 4 * 4
    assert 0.5 < stats.occupancy <= 1.0
    assert stats.joins >= 4


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_refill_cli(tiny_models, tmp_path, family: str) -> None:
    """``--refill`` writes what ``--no-refill`` writes; ``--stats`` has lanes, occupancy, joins and steps. GPT-2 with
    ``--max-length``: each prompt's new tokens count from its own width (8 to 32 here), as without refill."""
    from tests.helpers import seqgen
    from tests.tiny_models import sample_texts

    path = tiny_models(family)
    src = tmp_path / "in.txt"
    texts = sample_texts(40, seed=8)
    if family == "gpt2":  # prompts of at most 24 tokens (a width bucket of at most 32: room for new tokens)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        texts = [t for t in texts if len(tok(t).input_ids) <= 24]
        assert len(texts) > 6  # more inputs than lanes: some join later
    src.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    common = ["generate", "-m", str(path), str(src), "--num-beams", "3", "-q"]
    common += ["--max-new-tokens", "6"] if family == "bart" else ["--max-length", "40"]
    stats = tmp_path / "stats.json"
    a = seqgen(*common, "-o", str(tmp_path / "a.txt"), "--batch-size", "1", "--no-refill")
    b = seqgen(*common, "-o", str(tmp_path / "b.txt"), "--batch-size", "6", "--refill", "--stats", str(stats))
    assert a.exit_code == 0 and b.exit_code == 0, (a.stderr, b.stderr)
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()
    refill_stats = json.loads(stats.read_text())["device"]["refill"]
    assert refill_stats["lanes"] == 6 and refill_stats["joins"] >= 1 and refill_stats["steps"] > 0
    assert 0 < refill_stats["occupancy"] <= 1


def test_refill_window_mixes_widths(tiny_models) -> None:
    """With refill the batcher hands a window of several width buckets to one engine call (the lanes pad each
    input on their own); without, batches of ``batch_size`` (a fast encoder-decoder backend encodes each input
    at its own width). Same outputs either way."""
    from seqgen_cli.generator import Generator
    from seqgen_cli.shapes import input_width
    from tests.tiny_models import sample_texts

    texts = sample_texts(24, seed=5)
    outputs, calls = {}, {}
    for on in (False, True):
        gen = Generator(str(tiny_models("bart")), device="cpu", refill=on, num_beams=2, max_new_tokens=5)
        widths = {input_width(len(e.ids)) for e in gen.encode(texts)}
        assert len(widths) >= 3
        batches: list[int] = []
        generate_output = gen.generate_output
        gen.generate_output = lambda batch, idx=None, f=generate_output, seen=batches: (
            seen.append(len(batch)) or f(batch, idx)
        )
        outputs[on] = list(gen.generate_iterable(texts, batch_size=4))
        calls[on] = batches
    assert outputs[True] == outputs[False]
    assert calls[True] == [len(texts)]  # one window, one call over 4 lanes
    assert calls[False] == [4] * (len(texts) // 4)


def test_lane_cache_steps_per_lane() -> None:
    """A lane cache: lanes at different steps write their own step and see their own history only."""
    from seqgen_cli.models.kv_cache import EncoderDecoderKVCache

    cache = EncoderDecoderKVCache.lanes(1, 2, 1, 1, 2, 4, 8, torch.float32, torch.device("cpu"))
    cache.steps.copy_(torch.tensor([0, 2]))
    cache._row_steps()
    cache.begin()
    k = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]]])  # [N=2, H=1, d=2]
    cache.update(0, k, k)
    keys = cache.generated.keys[0]  # [L, H, T, R, d]
    assert keys[0, 0, 0, 0].tolist() == [1.0, 1.0] and keys[1, 0, 2, 0].tolist() == [2.0, 2.0]
    visible = cache.generated_bias.view(2, 4) == 0
    assert visible.tolist() == [[True, False, False, False], [True, True, True, False]]


def test_decoder_only_lane_cache_prompt_region_and_steps() -> None:
    """A decoder-only lane cache: a joiner's prefill K/V go into columns [0, w) of its lane's prompt region, the rest
    masked; widening adds masked columns on the right; lanes at different steps write their own generated position,
    and a row attends its visible generated keys and its prompt's real keys, as one softmax."""
    from seqgen_cli.models.kv_cache import DecoderOnlyKVCache
    from seqgen_cli.models.layers import causal_attention

    inf = float("-inf")
    # 1 layer, 2 lanes of 1 row, 1 K/V head of 2 dims, 4 generated positions, prompt regions of 3 columns
    cache = DecoderOnlyKVCache.lanes(1, 2, 1, 1, 2, 4, 3, torch.float32, torch.device("cpu"))
    pk = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])  # [J=1, Hkv=1, w=2, d=2]: a pad column, then a real one
    pv = torch.tensor([[[[5.0, 6.0], [7.0, 8.0]]]])
    cache.put_fixed(torch.tensor([1]), [pk], [pv], torch.tensor([[0, 1]]))
    cache.widen(5)
    assert cache.fixed.bias.view(2, 5).tolist() == [[inf] * 5, [inf, 0.0, inf, inf, inf]]
    assert cache.fixed.keys[0][1, 0].tolist() == [[1.0, 3.0, 0.0, 0.0, 0.0], [2.0, 4.0, 0.0, 0.0, 0.0]]  # [d, W]
    assert cache.fixed.values[0][1, 0, :2].tolist() == [[5.0, 6.0], [7.0, 8.0]]
    cache.steps.copy_(torch.tensor([0, 2]))
    cache._row_steps()
    cache.span = 4
    cache.begin()
    assert (cache.generated_bias.view(2, 4) == 0).tolist() == [
        [True, False, False, False],
        [True, True, True, False],
    ]
    q = torch.tensor([[[0.5, -1.0]], [[1.0, 0.25]]])  # [N=2, H=1, d]
    k = torch.tensor([[[1.0, 1.0]], [[2.0, -2.0]]])  # [N, Hkv, d]
    v = torch.tensor([[[3.0, 0.0]], [[0.0, 4.0]]])
    out = causal_attention(cache, 0, q, k, v, 1.0)  # [N, H*d]
    keys = cache.generated.keys[0]  # [L, Hkv, d, T, R]
    assert keys[0, 0, :, 0, 0].tolist() == [1.0, 1.0] and keys[1, 0, :, 2, 0].tolist() == [2.0, -2.0]
    # lane 1 sees generated positions 0..2 (zeros, zeros, its own) and its prompt's real column
    keys = torch.tensor([[0.0, 0.0], [0.0, 0.0], [2.0, -2.0], [3.0, 4.0]])
    values = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 4.0], [7.0, 8.0]])
    expected = torch.softmax(keys @ q[1, 0], dim=0) @ values
    torch.testing.assert_close(out[1], expected)
    torch.testing.assert_close(out[0], v[0, 0])  # lane 0: its own key only (empty prompt region)


@pytest.mark.slow  # inductor compiles: ~20 s of CPU, a minute on a loaded box
@pytest.mark.parametrize("family", ["bart", "t5", *DEC_ONLY])
def test_lane_step_compiles_whole(tiny_models, family: str) -> None:
    """The refill step has static shapes: its ``decode`` compiles as one graph (``fullgraph=True``, no dynamic
    shapes) under the real inductor on the CPU and gives the eager step's logits, with lanes at different steps,
    a join mid-run and a beam reordering. A span bucket is a host int: one graph per (lanes, width, span)."""
    from seqgen_cli.search.refill import _columns

    loaded = load(tiny_models(family))
    eager, compiled = get_backend(loaded.model), get_backend(loaded.model)
    torch._dynamo.reset()
    compiled.decode = torch.compile(compiled.decode, fullgraph=True, dynamic=False)
    batch = text_batch(loaded, 4, seed=5)
    width = batch.input_ids.shape[1]
    lanes, r = 3, 2
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        states = [b.open_lanes(lanes, r, 8) for b in (eager, compiled)]

        def join(lane_ids: list[int], inputs: list[int]) -> None:
            rows = _columns(batch, torch.tensor(inputs), width, left=family in DEC_ONLY)
            for b, state in zip((eager, compiled), states, strict=True):
                b.join(state, lane_ids, rows)  # decoder-only: the prefill, eager in both

        join([0, 1, 2], [0, 1, 2])
        for t in range(6):
            if t == 3:
                join([1], [3])  # a joiner at step 0 beside lanes at step 3
            tokens = torch.randint(4, eager.vocab_size, (lanes * r,), generator=g)
            expected = eager.step(states[0], tokens)  # the furthest lane at step t
            got = compiled.step(states[1], tokens)
            torch.testing.assert_close(got, expected, rtol=COMPILED_TOL, atol=COMPILED_TOL)
            if t == 1:
                rows = torch.tensor([1, 0, 2, 2, 5, 4])
                eager.reorder(states[0], rows)
                compiled.reorder(states[1], rows)
