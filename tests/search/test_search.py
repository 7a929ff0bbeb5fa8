"""Search-level properties: batch invariance, dropping finished inputs, sampling, unsupported settings."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.errors import SeqgenError
from seqgen_cli.models import get_backend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.search import Batch, beam, generate, settings_for, unsupported_reason
from seqgen_cli.search.beam import CHUNK, topk_in_order, wide_topk
from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.processors import LogitsPipeline
from tests.equivalence import rescore
from tests.tiny_models import load, text_batch


def _run(model, batch: Batch, seed: int | None = None, **kwargs):
    config = resolve_generation_config(model.generation_config, None, kwargs)
    return generate(get_backend(model, generic=True), batch, config, seed=seed)


def _unpad(model, batch: Batch, i: int) -> Batch:
    """Input ``i`` alone, without padding."""
    keep = batch.attention_mask[i] == 1
    return Batch(batch.input_ids[i : i + 1, keep], batch.attention_mask[i : i + 1, keep])


def _subset(model, batch: Batch, idx: list[int]) -> Batch:
    """Inputs ``idx`` re-padded to their own width (as a smaller batch would be)."""
    lengths = batch.attention_mask[idx].sum(1)
    width = int(lengths.max())
    pad = batch.input_ids[batch.attention_mask == 0]
    pad_id = int(pad[0]) if len(pad) else 0
    ids = torch.full((len(idx), width), pad_id)
    mask = torch.zeros((len(idx), width), dtype=torch.long)
    for j, i in enumerate(idx):
        one = _unpad(model, batch, i)
        n = one.input_ids.shape[1]
        cols = slice(0, n) if model.config.is_encoder_decoder else slice(width - n, width)
        ids[j, cols], mask[j, cols] = one.input_ids[0], 1
    return Batch(ids, mask)


@pytest.mark.parametrize("family", ["bart", "t5", "gpt2", "llama"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=16),
        dict(num_beams=4, max_new_tokens=16, no_repeat_ngram_size=3, early_stopping=True),
        dict(num_beams=3, max_new_tokens=16, num_return_sequences=2, length_penalty=0.6),
    ],
    ids=["greedy", "beam4", "beam3_nrs2"],
)
def test_batch_invariance(tiny_models, family: str, kwargs: dict) -> None:
    """An input's output does not depend on its batch: alone, in a batch of 4, in a batch of 24.

    For decoder-only models the prompt width changes with the batch (left padding); differences are then
    only allowed where re-scoring shows a near-tie.
    """
    loaded = load(tiny_models(family))
    model = loaded.model
    large = text_batch(loaded, 24, seed=7)
    full = _run(model, large, **kwargs)
    small_idx = [3, 5, 11, 17]
    small = _run(model, _subset(model, large, small_idx), **kwargs)
    for j, i in enumerate(small_idx):
        alone = _run(model, _unpad(model, large, i), **kwargs)
        for other in (small.sequences[j], alone.sequences[0]):
            if other == full.sequences[i]:
                continue
            assert not model.config.is_encoder_decoder, (i, other, full.sequences[i])
            assert kwargs.get("num_beams", 1) > 1, "greedy must not depend on the batch"
            one = _unpad(model, large, i)
            s = settings_for(
                get_backend(model, generic=True),
                one,
                resolve_generation_config(model.generation_config, None, kwargs),
            )
            a, b = rescore(model, one, 0, other[0], s), rescore(model, one, 0, full.sequences[i][0], s)
            assert abs(a - b) <= 1e-5 * max(abs(a), abs(b)), (i, other, full.sequences[i])


class CountingDecoder(GenericBackend):
    def __init__(self, model):
        super().__init__(model)
        self.dropped: list[int] = []

    def keep(self, state, keep, rows):
        self.dropped.append(len(keep))
        super().keep(state, keep, rows)


@pytest.mark.parametrize("family", ["marian", "gpt2"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=20),
        dict(num_beams=4, max_new_tokens=20, early_stopping=True),
        dict(num_beams=4, max_new_tokens=20, early_stopping=False, length_penalty=0.5),
        dict(do_sample=True, top_k=5, num_return_sequences=2, max_new_tokens=20),
    ],
    ids=["greedy", "beam_es", "beam_heuristic", "sample"],
)
def test_dropping_finished_inputs_changes_nothing(tiny_models, family: str, kwargs: dict) -> None:
    loaded = load(tiny_models(family))
    model = loaded.model
    batch = text_batch(loaded, 16, seed=3)
    config = resolve_generation_config(model.generation_config, None, kwargs)
    keeping = CountingDecoder(model)
    ref = generate(keeping, batch, config, seed=0, sync_every=10**9)  # like generate(): nobody leaves
    assert not keeping.dropped
    for sync_every in (1, 3):  # leave at once / a few steps late (the GPU default is 4)
        dropping = CountingDecoder(model)
        out = generate(dropping, batch, config, seed=0, sync_every=sync_every)
        assert dropping.dropped, "no input ever left the batch: the test is vacuous"
        if kwargs.get("do_sample"):
            continue  # the RNG stream depends on the number of rows; only determinism is promised (below)
        assert out.sequences == ref.sequences
        # the generic backend runs transformers' forward on MKL's GEMM, whose sums over a product of a few rows can
        # take another order when the row count (inputs leaving) or MKL's thread split (a loaded machine) changes:
        # the scores agree within float32 rounding of ~20 summed log-probs
        assert (out.scores is None) == (ref.scores is None)
        for mine, theirs in zip(out.scores or [], ref.scores or [], strict=True):
            assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(mine, theirs, strict=True))


def test_sampling_is_deterministic_with_a_seed(tiny_models) -> None:
    loaded = load(tiny_models("t5"))
    model = loaded.model
    batch = text_batch(loaded, 8, seed=5)
    kwargs = dict(do_sample=True, num_return_sequences=3, max_new_tokens=16, top_p=0.9)
    a, b = _run(model, batch, seed=1, **kwargs), _run(model, batch, seed=1, **kwargs)
    c = _run(model, batch, seed=2, **kwargs)
    assert a.sequences == b.sequences
    assert a.sequences != c.sequences
    assert all(len(per) == 3 for per in a.sequences)


@torch.inference_mode()
def test_top_k_never_leaves_the_top_k(tiny_models) -> None:
    loaded = load(tiny_models("t5"))
    model = loaded.model
    batch = text_batch(loaded, 6, seed=9)
    k = 3
    kwargs = dict(do_sample=True, top_k=k, num_return_sequences=4, max_new_tokens=12, temperature=1.5)
    out = _run(model, batch, seed=0, **kwargs)
    config = resolve_generation_config(
        model.generation_config, None, dict(max_new_tokens=12)
    )  # processors, no warpers
    s = settings_for(get_backend(model, generic=True), batch, config)
    for i, per_input in enumerate(out.sequences):
        for seq in per_input:
            dec = torch.tensor([[s.decoder_start, *seq]])
            ids, mask = batch.input_ids[i : i + 1], batch.attention_mask[i : i + 1]
            logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[0].float()
            history = TokenHistory(dec[:, :1], s.max_length)
            pipe = LogitsPipeline(s, history, logits.shape[-1], logits.device)
            for t, tok in enumerate(seq):
                scores = pipe(history, logits[t : t + 1].clone())[0]
                assert scores[tok] >= torch.topk(scores, k).values[-1], (i, t, tok)
                history.append(torch.tensor([tok]))


@torch.inference_mode()
def test_sampling_follows_the_distribution(tiny_models) -> None:
    """One step, many samples: empirical frequencies close to softmax(logits / T) restricted to the top k."""
    loaded = load(tiny_models("t5"))
    model = loaded.model
    batch = text_batch(loaded, 1, seed=2)
    n, temperature, k = 3000, 2.0, 6
    out = _run(
        model,
        batch,
        seed=0,
        do_sample=True,
        num_return_sequences=n,
        max_new_tokens=1,
        top_k=k,
        temperature=temperature,
    )
    decoder = get_backend(model, generic=True)
    config = resolve_generation_config(model.generation_config, None, dict(max_new_tokens=1))
    s = settings_for(decoder, batch, config)
    dec = torch.tensor([[s.decoder_start]])
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, decoder_input_ids=dec
    ).logits[0, -1]
    assert s.forced_bos is None and not s.forced_eos
    probs = torch.softmax(logits.float() / temperature, -1)
    top = torch.topk(probs, k)
    expected = torch.zeros_like(probs)
    expected[top.indices] = top.values / top.values.sum()
    counts = torch.bincount(torch.tensor([seq[0] for seq in out.sequences[0]]), minlength=probs.shape[0])
    tv = 0.5 * (counts.float() / n - expected).abs().sum()
    assert tv < 0.05, tv


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_beams=4, do_sample=True),
        dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
        dict(force_words_ids=[[5]], num_beams=2),
        dict(penalty_alpha=0.6, top_k=4),
        dict(num_return_sequences=2),
        dict(sequence_bias=[[[5], -1.0]]),
    ],
)
def test_unsupported_settings_raise(tiny_models, kwargs: dict) -> None:
    loaded = load(tiny_models("bart"))
    model = loaded.model
    try:
        config = resolve_generation_config(model.generation_config, None, kwargs)
    except SeqgenError:
        return  # transformers' validation already rejects the combination
    assert unsupported_reason(config) is not None
    with pytest.raises(SeqgenError):
        generate(get_backend(model, generic=True), text_batch(loaded, 2), config)


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_bfloat16_model(tiny_models, family: str) -> None:
    """Half-precision logits go through the same float32 search; same forward ops, so same tokens as generate()."""
    import copy

    from tests.equivalence import check_equivalence

    loaded = load(tiny_models(family))
    model = copy.deepcopy(loaded.model).to(torch.bfloat16)
    batch = text_batch(loaded, 8, seed=6)
    for kwargs in (dict(max_new_tokens=12), dict(num_beams=3, max_new_tokens=12, no_repeat_ngram_size=2)):
        config = resolve_generation_config(model.generation_config, None, kwargs)
        out = generate(get_backend(model, generic=True), batch, config)
        assert all(0 < len(s[0]) <= 12 for s in out.sequences)
        result = check_equivalence(
            model, lambda m: get_backend(m, generic=True), batch, kwargs, keep_dtype=True
        )
        assert result.identical == result.total, result.summary()


def _ngrams_ok(row: list[int], start: int, n: int) -> bool:
    """No token at position >= ``start`` of ``row`` completes an n-gram that already ended earlier."""
    seen = {tuple(row[j - n + 1 : j + 1]) for j in range(n - 1, start)}
    for j in range(max(start, n - 1), len(row)):
        gram = tuple(row[j - n + 1 : j + 1])
        if gram in seen:
            return False
        seen.add(gram)
    return True


@pytest.mark.parametrize("family", ["bart", "t5", "gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_fast_backends(tiny_models, family: str, dtype: torch.dtype, record_property) -> None:
    """bf16/fp16 weights and activations through the fast backends on the CPU: valid outputs, the bans hold
    (n-gram, min length, forced BOS/EOS), float32 scores. Agreement with float32 is reported, not asserted."""
    import copy

    loaded = load(tiny_models(family))
    batch = text_batch(loaded, 8, seed=12)
    n, min_new, max_new = 2, 6, 16
    kwargs = dict(num_beams=4, no_repeat_ngram_size=n, min_new_tokens=min_new, max_new_tokens=max_new)
    config = resolve_generation_config(loaded.model.generation_config, None, kwargs)
    ref = generate(get_backend(loaded.model), batch, config)
    half = copy.deepcopy(loaded.model).to(dtype)
    backend = get_backend(half)
    assert not isinstance(backend, GenericBackend)
    seen: list[torch.dtype] = []
    pipeline_call = LogitsPipeline.__call__

    def spy(self: LogitsPipeline, history: TokenHistory, scores: torch.Tensor) -> torch.Tensor:
        seen.append(scores.dtype)  # log-probs (beam) reach the processors in float32
        return pipeline_call(self, history, scores)

    with mock.patch.object(LogitsPipeline, "__call__", spy):
        out = generate(backend, batch, config)
    assert seen and set(seen) == {torch.float32}
    s = settings_for(backend, batch, config)
    vocab = backend.vocab_size
    ended = 0
    for i, (per_input, scores) in enumerate(zip(out.sequences, out.scores, strict=True)):
        seq, score = per_input[0], scores[0]
        assert min_new <= len(seq) <= max_new and all(0 <= tok < vocab for tok in seq), seq
        assert not any(tok in s.eos for tok in seq[:-1]), seq  # EOS only last,
        if seq[-1] in s.eos:
            ended += 1
            assert len(seq) > min_new, seq  # never within the first min_new_tokens
        else:
            assert len(seq) == max_new, seq
        assert torch.isfinite(torch.tensor(score)) and score < 0, score  # a float32 log-prob sum
        if s.forced_bos is not None:
            assert seq[0] == s.forced_bos
        if s.forced_eos and len(seq) == max_new:
            assert seq[-1] in s.forced_eos
        prompt = [s.decoder_start] if half.config.is_encoder_decoder else batch.input_ids[i].tolist()
        assert _ngrams_ok(prompt + seq, len(prompt), n), (prompt, seq)
    assert ended, "no output ended with EOS: the min-length ban was not exercised"
    same = sum(a == b for a, b in zip(out.sequences, ref.sequences, strict=True))
    record_property("agreement_with_float32", f"{same}/{len(ref.sequences)}")
    print(f"{family} {dtype}: {same}/{len(ref.sequences)} outputs identical to float32")


@pytest.mark.parametrize("width", [8 * 128, 4 * 600 + 5, 4 * 54_776 + 3])
def test_wide_topk_matches_torch_topk(width: int) -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, width, generator=g)
    scores[1, -1] = 50.0  # the best column in the last (shorter) chunk
    scores[2, :-300] = float("-inf")  # few finite values, all near the end
    scores[3, 7], scores[3, 9] = 40.0, 41.0  # the two best in one chunk
    scores[4, ::2] = float("-inf")
    values, indices = wide_topk(scores, 8)
    ref_values, ref_indices = torch.topk(scores, 8)
    assert torch.equal(values, ref_values)
    assert torch.equal(indices, ref_indices)  # no ties among these values
    assert torch.equal(scores.gather(1, indices), values)
    scores[3, 7] = 41.0  # a tie: torch.topk's own order of the equal values
    values, indices = wide_topk(scores, 8)
    assert torch.equal(values, torch.topk(scores, 8).values)
    assert torch.equal(indices, torch.topk(scores, 8).indices)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wide_topk_gives_torch_topks_order_of_ties(dtype: torch.dtype) -> None:
    """Log-probs of half-precision logits tie often (and in float32 ties can be made): beams' scores over 4 x 3,000
    logits rounded to ``dtype`` (then float32, as the search sees them), equal values within a beam, across beams
    and at the k-th place; ``wide_topk`` gives ``torch.topk``'s indices, equal values in its order, in every row."""
    g = torch.Generator().manual_seed(3)
    rows, beams, vocab, k = 64, 4, 3000, 8
    logits = (torch.randn(rows, beams, vocab, generator=g) * 4).to(dtype).float()  # ties where dtype rounds
    logits[:8, :, :50] = logits[:8, :, :1]  # rows 0-7: 50 equal best logits in each beam
    running = torch.zeros(rows, beams)  # rows 8-15: equal running scores, so beams tie with each other
    running[16:] = torch.randn(rows - 16, beams, generator=g)
    scores = (torch.log_softmax(logits, -1) + running[:, :, None]).view(rows, beams * vocab)
    ref = torch.topk(scores, k)
    values, indices = wide_topk(scores, k)
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)
    for r in range(rows):  # the same, row by row: whatever the other rows hold
        one = wide_topk(scores[r : r + 1], k)
        assert torch.equal(one[1], ref.indices[r : r + 1]), r


def test_wide_topk_all_but_few_masked_keeps_the_finite_ones() -> None:
    scores = torch.full((2, 4 * 8 * 128 * 2), float("-inf"))
    scores[0, [3, 3000, 8000]] = torch.tensor([1.0, 3.0, 2.0])
    values, indices = wide_topk(scores, 8)
    assert values[0, :3].tolist() == [3.0, 2.0, 1.0]
    assert indices[0, :3].tolist() == [3000, 8000, 3]
    assert torch.isinf(values[0, 3:]).all() and torch.isinf(values[1]).all()


@pytest.mark.parametrize("k", [2, 8, 10, 130])
def test_topk_in_order_is_torch_topk_over_rows_full_of_ties(k: int) -> None:
    """``topk_in_order`` runs torch's CPU top-k over only the chunks whose elements can enter its heap: the same
    values and indices as over whole rows, where values tie at the top, at the k-th place, across beams, in the
    shorter last chunk, and where a row is mostly or wholly ``-inf``; a row that keeps too many chunks goes whole."""
    g = torch.Generator().manual_seed(k)
    for beams, vocab in ((k // 2, 5_000), (k // 2, 54_776), (k, 1_283)):
        rows = 12
        logits = (torch.randn(rows, beams, vocab, generator=g) * 3).to(torch.bfloat16).float()  # ties everywhere
        logits[0, :, ::7] = logits[0, :, :1].clone()  # a seventh of row 0's logits equal to its first
        running = torch.randn(rows, beams, generator=g).to(torch.bfloat16).float()
        running[1] = 0.0  # row 1: beams tie with each other
        scores = (torch.log_softmax(logits, -1) + running[:, :, None]).view(rows, beams * vocab)
        scores[2, : scores.shape[1] // 2] = float("-inf")
        scores[3, 5:] = float("-inf")  # fewer finite values than k
        scores[6, CHUNK : 2 * CHUNK] = float("-inf")  # a whole chunk -inf (among the first k elements when k > CHUNK)
        scores[4] = float("-inf")
        scores[5, -3:] = 30.0  # the best ones, tied, in the last (shorter) chunk
        m = scores.shape[1]
        scores[8] = torch.linspace(-60, 0, m).to(torch.bfloat16).float()  # rising, tied: every chunk kept, so whole
        full = m // CHUNK * CHUNK
        maxima = torch.cat(
            (scores[:, :full].view(rows, -1, CHUNK).amax(-1), scores[:, full:].amax(-1, keepdim=True)), 1
        )[:, : -(-m // CHUNK)]
        every = torch.arange(rows)
        with mock.patch.object(beam, "_topk_of_chunks", wraps=beam._topk_of_chunks) as by_chunks:
            values, indices = topk_in_order(scores, maxima, every, k)
        chunked = by_chunks.call_args.args[1].tolist() if by_chunks.called else []
        assert 8 not in chunked and (vocab != 54_776 or {0, 1, 3, 4, 5} <= set(chunked))  # wide rows: by chunks
        ref = torch.topk(scores, k)
        assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices), (beams, vocab)
        some = torch.tensor([5, 0, 3])  # any rows, in any order
        values, indices = topk_in_order(scores, maxima, some, k)
        assert torch.equal(indices, ref.indices[some]) and torch.equal(values, ref.values[some])
        scores[7, m // 2], maxima[7, m // 2 // CHUNK] = float("nan"), float("nan")  # NaN: the largest to torch.topk
        values, indices = topk_in_order(scores, maxima, torch.tensor([7]), k)
        assert torch.equal(indices, torch.topk(scores[7:8], k).indices) and values[0, 0].isnan()
