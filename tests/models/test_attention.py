"""Attention scores in float16 / bfloat16: the product ``q @ K^T`` is summed and kept in float32 up to the float32
softmax (as transformers' SDPA kernels do), never rounded to half in between; float32 is untouched.

* :func:`scores32`, :func:`attention` and both decoder-only caches' ``attend`` give the scores of the same half
  inputs upcast to float32 (``q.float() @ k.float()``) to float32 summation order, where the old product rounded
  to half misses by far more (large-magnitude scores);
* float32 is bit for bit the computation it always was (queries scaled first);
* on CUDA (fake tensors: no device needed) the scores are one ``bmm`` into float32 over the cache's own keys: no
  float32 copy of the keys, no second read;
* the CPU path compiles with inductor (``fullgraph=True``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from seqgen_cli.models.attention import attention, scores32
from seqgen_cli.models.kv_cache import DecoderOnlyKVCache
from seqgen_cli.models.layers import causal_attention
from seqgen_cli.shapes import span_bucket

aten = torch.ops.aten
HALVES = [torch.float16, torch.bfloat16]
EPS32 = torch.finfo(torch.float32).eps
SPREAD = 4.0  # inputs ~ N(0, 4^2): scores in the hundreds, where a half's spacing is 0.25 (fp16) to 2 (bf16)
SCALES = [1.0, 0.125, 128**-0.5]  # T5 (none), a power of two (BART, GPT-2: d = 64), not one (Llama: d = 128)


def float32_bound(q: Tensor, keys_t: Tensor, scale: float) -> Tensor:
    """How far two float32 evaluations of ``scale * q @ keys_t`` (same half inputs) may lie apart. The products
    of two halves are exact in float32, so only the order of the ``d``-term sum differs: each sum is within
    ``d * eps32 / 2 * sum |q_i k_i|`` of the exact one (the standard ``gamma_d`` bound), so two are within
    ``d * eps32 * sum |q_i k_i|``; scaling adds half a float32 spacing of the score to each."""
    d = q.shape[-1]
    mags = q.float().abs() @ keys_t.float().abs()  # [..., Q, K]
    return d * EPS32 * mags * scale + EPS32 * mags * scale


def half_rounded(q: Tensor, keys_t: Tensor, scale: float) -> Tensor:
    """The old scores: the product rounded to half before it becomes float32 (queries scaled first, in half)."""
    return torch.matmul(q if scale == 1.0 else q * scale, keys_t).float()


class SoftmaxInputs(TorchDispatchMode):
    """Records what every softmax is fed: the scores, as the step computed them."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: list[Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is aten._softmax.default:
            self.scores.append(args[0].clone())
        return func(*args, **(kwargs or {}))


def assert_float32_scores(got: Tensor, want: Tensor, bound: Tensor) -> None:
    """``got`` (float32) equals ``want`` within ``bound`` where ``want`` is finite, and is ``-inf`` where it is."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)
    err = (got - want).abs()[finite]
    assert (err <= bound.expand_as(want)[finite]).all(), f"max error {err.max().item():.3g}"


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    return (torch.randn(*shape, generator=gen) * SPREAD).to(dtype)


@pytest.mark.parametrize("dtype", HALVES)
def test_scores32_sums_in_float32(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    q = randn(2, 3, 4, 64, dtype=dtype, gen=gen)  # [B, H, Q, d]
    cache = randn(2, 3, 40, 2, 64, dtype=dtype, gen=gen)  # [B, H, T, R, d]
    keys_t = cache[:, :, :25].view(2, 3, 50, 64).transpose(-1, -2)  # [B, H, d, span*R]: the caches' view
    want = q.float() @ keys_t.float()
    bound = float32_bound(q, keys_t, 1.0)
    got = scores32(q, keys_t)
    assert_float32_scores(got, want, bound)
    old = half_rounded(q, keys_t, 1.0)
    assert ((old - want).abs() > bound).any(), "inputs too small for half rounding to matter"
    assert (old - want).abs().max() > 10 * bound.max()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", HALVES)
def test_attention_scores_are_float32(dtype: torch.dtype, scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    q = randn(2, 3, 4, 64, dtype=dtype, gen=gen)  # [B, H, Rq, d]
    keys_t = randn(2, 3, 64, 30, dtype=dtype, gen=gen)  # [B, H, d, K]
    values = randn(2, 3, 30, 64, dtype=dtype, gen=gen)  # [B, H, K, d]
    bias = torch.zeros(2, 1, 4, 30).masked_fill_(torch.rand(2, 1, 4, 30, generator=gen) < 0.3, float("-inf"))
    bias[..., 0] = 0.0  # every row sees a key
    with SoftmaxInputs() as rec:
        out = attention(q, keys_t, values, bias, scale)
    assert out.dtype == dtype and out.shape == (2, 3, 4, 64)
    (got,) = rec.scores
    want = (q.float() @ keys_t.float()) * scale + bias
    bound = float32_bound(q, keys_t, scale)
    assert_float32_scores(got, want, bound)
    old = half_rounded(q, keys_t, scale) + bias
    finite = want.isfinite()
    assert ((old - want).abs()[finite] > bound.expand_as(want)[finite]).any()


@pytest.mark.parametrize("scale", SCALES)
def test_float32_attention_is_unchanged(scale: float) -> None:
    """float32 is the exactness contract: the same ops in the same order, so the same bits."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 4, 16, generator=gen)
    keys_t = torch.randn(2, 3, 16, 9, generator=gen)
    values = torch.randn(2, 3, 9, 16, generator=gen)
    bias = torch.zeros(1, 1, 4, 9)
    bias[..., -2:] = float("-inf")
    old = torch.matmul(q if scale == 1.0 else q * scale, keys_t).float() + bias
    want = torch.matmul(torch.softmax(old, dim=-1).to(values.dtype), values)
    assert torch.equal(attention(q, keys_t, values, bias, scale), want)
    assert torch.equal(scores32(q, keys_t), torch.matmul(q, keys_t))


def decoder_only_reference(
    cache: DecoderOnlyKVCache, q: Tensor, scale: float, lane: bool
) -> tuple[Tensor, Tensor]:
    """The scores of the step just attended, from the cache's own half keys upcast to float32, with its masks,
    and their :func:`float32_bound`: [B, Hkv, R*G, P + span*R] each (lane: generated first)."""
    fixed = cache.fixed
    b, hkv, d, _ = fixed.keys[0].shape
    r, span = cache.r, cache.span
    n, h, _ = q.shape
    g = h // hkv
    qg = q.view(b, r, hkv, g, d).transpose(1, 2).reshape(b, hkv, r * g, d)  # [B, Hkv, R*G, d]
    keys_t = cache.generated.keys[0][:, :, :, :span].reshape(b, hkv, d, span * r)  # [B, Hkv, d, span*R]
    gen = (qg.float() @ keys_t.float()) * scale
    if cache.generated_bias is not None:
        gen = (gen.view(b, hkv, r, g, span * r) + cache.generated_bias).view(b, hkv, r * g, span * r)
    prompt = (qg.float() @ fixed.keys[0].float()) * scale + fixed.bias
    parts = [gen, prompt] if lane else [prompt, gen]
    bound = [float32_bound(qg, keys_t, scale), float32_bound(qg, fixed.keys[0], scale)]
    return torch.cat(parts, dim=-1), torch.cat(bound if lane else bound[::-1], dim=-1)


@pytest.mark.parametrize("dtype", HALVES)
def test_decoder_only_scores_are_float32(dtype: torch.dtype) -> None:
    """Grouped-query heads (4 query heads over 2 K/V heads), 2 beams, a padded prompt, the third step."""
    gen = torch.Generator().manual_seed(3)
    b, r, h, hkv, d, p, scale = 2, 2, 4, 2, 32, 7, 32**-0.5
    pk = [randn(b, hkv, p, d, dtype=dtype, gen=gen)]
    pv = [randn(b, hkv, p, d, dtype=dtype, gen=gen)]
    mask = torch.ones(b, p, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    cache = DecoderOnlyKVCache(pk, pv, mask, r, 8)
    for t in range(3):
        cache.check(t)
        cache.begin()
        q = randn(b * r, h, d, dtype=dtype, gen=gen)
        k, v = randn(b * r, hkv, d, dtype=dtype, gen=gen), randn(b * r, hkv, d, dtype=dtype, gen=gen)
        with SoftmaxInputs() as rec:
            out = causal_attention(cache, 0, q, k, v, scale)
        cache.advance()
        assert out.dtype == dtype and out.shape == (b * r, h * d)
    want, bound = decoder_only_reference(cache, q, scale, lane=False)
    assert_float32_scores(rec.scores[0], want, bound)


@pytest.mark.parametrize("dtype", HALVES)
def test_decoder_only_lane_scores_are_float32(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    s, r, h, hkv, d, w, scale = 2, 1, 4, 2, 32, 6, 32**-0.5
    cache = DecoderOnlyKVCache.lanes(1, s, r, hkv, d, 8, w, dtype, torch.device("cpu"))
    lanes = torch.arange(s)
    mask = torch.ones(s, w, dtype=torch.long)
    mask[1, :3] = 0
    pk = [randn(s, hkv, w, d, dtype=dtype, gen=gen)]
    cache.put_fixed(lanes, pk, [randn(s, hkv, w, d, dtype=dtype, gen=gen)], mask)
    cache.join(lanes.tolist())
    for t in range(2):
        cache.span = span_bucket(t, cache.max_len)
        cache.begin()
        q = randn(s * r, h, d, dtype=dtype, gen=gen)
        k, v = randn(s * r, hkv, d, dtype=dtype, gen=gen), randn(s * r, hkv, d, dtype=dtype, gen=gen)
        with SoftmaxInputs() as rec:
            out = causal_attention(cache, 0, q, k, v, scale)
        cache.advance()
        assert out.dtype == dtype and out.shape == (s * r, h * d)
    want, bound = decoder_only_reference(cache, q, scale, lane=True)
    assert_float32_scores(rec.scores[0], want, bound)


class Ops(TorchDispatchMode):
    """Records every aten op with the element counts of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, list[int]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        sizes = [a.numel() for a in (*args, *(kwargs or {}).values()) if isinstance(a, Tensor)]
        self.calls.append((func, sizes))
        return func(*args, **(kwargs or {}))


COPIES = {aten._to_copy.default, aten.clone.default, aten.copy_.default}


@pytest.mark.parametrize("dtype", HALVES)
def test_cuda_scores_are_one_gemm_over_the_cache(dtype: torch.dtype) -> None:
    """CUDA (fake tensors): ``bmm`` with ``out_dtype=float32`` on views of the cache; nothing copies the keys."""
    b, h, t, r, d, span = 2, 3, 16, 2, 8, 9
    with FakeTensorMode():
        cuda = torch.device("cuda")
        kl = torch.zeros(b, h, t, r, d, dtype=dtype, device=cuda)  # [B, H, T, R, d]
        # as the caches' views (``kl[:, :, :span]``: a CPU-only build cannot index a fake CUDA tensor)
        keys_t = kl.narrow(2, 0, span).view(b, h, span * r, d).transpose(-1, -2)  # [B, H, d, span*R]
        values = kl.narrow(2, 0, span).view(b, h, span * r, d)  # [B, H, span*R, d]
        rows = torch.zeros(b * r, h, d, dtype=dtype, device=cuda)  # [N, H, d]
        q = rows.view(b, r, h, d).transpose(1, 2)  # [N, H, d] -> [B, H, R, d]
        with Ops() as ops:
            out = attention(q, keys_t, values, None, 0.125)
        assert out.dtype == dtype and out.shape == (b, h, r, d)
        with Ops() as score_ops:
            scores = scores32(q, keys_t)
        assert scores.dtype == torch.float32 and scores.shape == (b, h, r, span * r)
    funcs = [f for f, _ in score_ops.calls]
    assert funcs.count(aten.bmm.dtype) == 1, funcs
    assert aten.bmm.default not in funcs and aten.matmul.default not in funcs
    keys = b * h * d * span * r
    copied = [(f, n) for f, n in ops.calls if f in COPIES and max(n, default=0) >= keys]
    assert not copied, f"the keys were copied: {copied}"


@pytest.mark.parametrize("dtype", HALVES)
def test_half_attention_compiles_on_the_cpu(dtype: torch.dtype) -> None:
    """inductor, ``fullgraph=True``: the compiled scores are the same float32 scores, and the output follows."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    q = randn(2, 3, 4, 64, dtype=dtype, gen=gen)
    keys_t = randn(2, 3, 64, 30, dtype=dtype, gen=gen)
    values = randn(2, 3, 30, 64, dtype=dtype, gen=gen)
    scale = 128**-0.5

    def scaled(q: Tensor, keys_t: Tensor) -> Tensor:
        return scores32(q, keys_t).mul_(scale)

    got = torch.compile(scaled, fullgraph=True, dynamic=False)(q, keys_t)
    assert_float32_scores(got, (q.float() @ keys_t.float()) * scale, float32_bound(q, keys_t, scale))
    compiled = torch.compile(attention, fullgraph=True, dynamic=False)(q, keys_t, values, None, scale)
    eager = attention(q, keys_t, values, None, scale)
    # float32-close scores give float32-close probabilities; rounding those and the output to half moves each by
    # at most one half spacing: 2 * eps_half * sum_j p_j |v_j|, with the probabilities of the scores themselves
    probs = torch.softmax((q.float() @ keys_t.float()) * scale, dim=-1)
    bound = 2 * torch.finfo(dtype).eps * (probs @ values.float().abs())
    assert compiled.dtype == dtype
    assert ((compiled.float() - eager.float()).abs() <= bound).all()
