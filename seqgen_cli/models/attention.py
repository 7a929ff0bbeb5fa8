"""Attention over the caches' keys and values: scores accumulated in float32 (:func:`scores32`), softmax, and
the values summed chunk by chunk where batch-independence needs it (:func:`attention`), with the arithmetic
around it that the decoders share (RoPE, soft-capping). The caches (``models/kv_cache.py``) store; this attends."""

from __future__ import annotations

import torch
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)


def kv_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a cache holds keys and values in, under a model in ``dtype``: on the CPU under half precision
    float32, so attention there runs in float32 (no half GEMM sums in float32 on the CPU; its half attention took
    3-7x float32's time on an AVX2 CPU, docs/EXPERIMENTS.md, "Attention over every beam's keys: layouts measured"):
    each key and value is widened once as it is written, not at every layer and step, and its bits are the half
    value's (exact in float32), so the scores are the same; the probabilities and value sums are float32, the output
    rounded to half once. Elsewhere ``dtype``."""
    return torch.float32 if device.type == "cpu" and dtype in HALF else dtype
# ``torch.bmm(..., out_dtype=torch.float32)`` (torch >= 2.8): a half product written as float32, CUDA only (the
# CPU has no kernel for it); inductor lowers it to the same cuBLAS call (``at::_bmm_out_dtype_cuda``).
BMM_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")


def scores32(q: Tensor, keys_t: Tensor) -> Tensor:
    """``q @ keys_t`` as float32: ``q`` [..., Q, d], ``keys_t`` [..., d, K] (same batch dims) -> [..., Q, K].

    float32 inputs: ``torch.matmul`` as it always was (the exactness contract). float16 / bfloat16 inputs: the
    dot products are summed in float32 and come out as float32, never rounded to half in between (as in
    transformers' SDPA kernels); a product of two halves is exact in float32, so this is ``q.float() @
    keys_t.float()`` up to float32 summation order. On CUDA one cuBLAS GEMM reads the half keys once and writes
    float32 scores. Elsewhere (the CPU) the caches hold the keys in float32 already (:func:`kv_dtype`): only ``q``
    is widened, and the product is float32's."""
    if q.dtype not in HALF:
        return torch.matmul(q, keys_t)
    if BMM_OUT_DTYPE and q.device.type == "cuda":
        *batch, m, d = q.shape
        k = keys_t.shape[-1]
        q3 = q.reshape(-1, m, d)  # [..., Q, d] -> [prod(...), Q, d]; a copy only of q where not viewable
        k3 = keys_t.reshape(-1, d, k)  # [..., d, K] -> [prod(...), d, K]: a view for every cache here
        out = torch.bmm(q3, k3, out_dtype=torch.float32)  # [prod(...), Q, K]
        return out.view(*batch, m, k)  # [prod(...), Q, K] -> [..., Q, K]
    return torch.matmul(q.float(), keys_t.float())


Keys = tuple[Tensor, Tensor, "Tensor | None", "int | None"]  # keys_t, values, bias, chunk: one block of keys


def attention(
    q: Tensor,
    keys_t: Tensor,
    values: Tensor,
    bias: Tensor | None,
    scale: float,
    chunk: int | None = None,
    softcap: float | None = None,
    scale_scores: bool = False,
    then: Keys | None = None,
) -> Tensor:
    """``softmax(cap(scale * q @ keys_t) + bias) @ values`` with float32 scores: ``q`` [..., H, Q, d], ``keys_t``
    [..., Hkv, d, K] (keys transposed), ``values`` [..., Hkv, K, d], ``bias`` additive (0 / -inf, float32),
    broadcastable to [..., 1|H, Q, K] -> [..., H, Q, d].

    Grouped-query attention (``H`` a multiple of ``Hkv``): query head ``h`` attends K/V head ``h // (H / Hkv)``,
    as transformers' ``repeat_kv`` pairs them, without repeating the keys: a K/V head's query heads are rows of one
    product ([..., Hkv, G*Q, d]). ``bias`` then has one head ([..., 1, Q|1, K]).

    ``chunk`` (cross-attention: ``shapes.CROSS_CHUNK``; ``K`` a multiple of it): the values are summed chunk by
    chunk (one product per chunk of ``chunk`` keys, then a sum over the chunks), so keys masked at the end (a
    wider neighbour's source) add exact zeros and leave an input's bits as they are at its own width. One
    product over all ``K`` keys does not: the GEMM splits its inner dimension by its length. The scores and the
    softmax keep their bits at any width that is a multiple of 64 (measured; tests/models/test_determinism.py).

    ``then`` (T5Gemma 2's merged attention: the source's keys after the decoder's own): a second block of keys
    ``(keys_t, values, bias, chunk)`` under the same softmax, its scores after the first block's, its values summed
    apart (by its own chunks) and added.

    Where the scale goes: float32 scales ``q`` before the product (the order transformers' SDPA path takes);
    ``scale_scores`` (T5Gemma: transformers' eager attention, the only one it has) scales the product, as do
    float16 / bfloat16, which take the product in float32 (:func:`scores32`), so neither the scores nor the
    scaled queries are rounded to half. ``softcap`` (Gemma): scaled scores become ``tanh(s / softcap) * softcap``
    before the bias (:func:`soft_cap`).

    The output is in ``q``'s dtype: on the CPU under half precision the probabilities and value sums are float32
    (the values held so, :func:`kv_dtype`), rounded to half once here.

    Decoding attention on the CPU: two batched GEMMs beat SDPA's kernel, whose
    per-(input, head) overhead dominates at a handful of queries (docs/EXPERIMENTS.md,
    "CPU float32: what the step does, and what each choice measured"; over every beam's keys with the
    back-pointers' bias as its mask it ties them in float32: "Attention over every beam's keys: layouts measured")."""
    *lead, h, q_len, d = q.shape
    hkv = keys_t.shape[-3]
    g = h // hkv
    if g > 1:
        q = q.reshape(*lead, hkv, g * q_len, d)  # [..., H, Q, d] -> [..., Hkv, G*Q, d]: a K/V head's queries
    scaled = q.dtype in HALF or scale_scores
    if not scaled and scale != 1.0:
        q = q * scale

    def scores_of(keys: Tensor, mask: Tensor | None) -> Tensor:
        scores = scores32(q, keys) if scaled else torch.matmul(q, keys)  # [..., Hkv, G*Q, K]
        if scaled and scale != 1.0:
            scores.mul_(scale)
        scores = soft_cap(scores, softcap)
        if mask is not None and g > 1:  # [..., Hkv, G, Q, K] + [..., 1, 1, Q|1, K]
            return (scores.view(*lead, hkv, g, q_len, -1) + mask.unsqueeze(-3)).view(*lead, hkv, g * q_len, -1)
        if mask is not None:
            scores += mask
        return scores

    scores = scores_of(keys_t, bias)
    if then is not None:
        scores = torch.cat((scores, scores_of(then[0], then[2])), dim=-1)  # [..., Hkv, G*Q, K + K']
    probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [..., Hkv, G*Q, K (+ K')]
    if then is None:
        out = value_sum(probs, values, chunk)
    else:
        k = keys_t.shape[-1]
        out = value_sum(probs[..., :k], values, chunk) + value_sum(probs[..., k:], then[1], then[3])
    return out.view(*lead, h, q_len, d).to(q.dtype)  # [..., Hkv, G*Q, d] -> [..., H, Q, d], in the queries' dtype


def value_sum(probs: Tensor, values: Tensor, chunk: int | None) -> Tensor:
    """``probs @ values``: [..., Hkv, Q', K] x [..., Hkv, K, d] -> [..., Hkv, Q', d]; by chunks of ``chunk`` keys
    summed (:func:`attention`)."""
    if chunk is None:
        return torch.matmul(probs, values)
    *lead, rows, k_len = probs.shape
    c = k_len // chunk
    probs = probs.view(*lead, rows, c, chunk).transpose(-3, -2)  # [..., C, Q', chunk]
    parts = torch.matmul(probs, values.view(*lead, c, chunk, values.shape[-1]))  # [..., C, Q', d]
    return parts.sum(dim=-3)  # [..., Q', d]


def rotary_tables(
    rotary: torch.nn.Module, x: Tensor, at: Tensor, kinds: list[str], per_type: bool
) -> dict[str, tuple[Tensor, Tensor]]:
    """RoPE's cos and sin at positions ``at`` ([1]: a batch's step, or [N]: a row's each) from the model's own
    rotary module, [1|N, 1, r] each: for each of ``kinds`` (layer types) once; ``per_type``: the module has a table
    per layer type (Gemma3, T5Gemma 2), else one."""
    tables = {}
    for kind in dict.fromkeys(kinds):  # in order, once each
        cos, sin = rotary(x, at[None], kind) if per_type else rotary(x, at[None])
        tables[kind] = cos[0, :, None], sin[0, :, None]  # [1, N, r] -> [N, 1, r]
    return tables


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """Gemma's soft-capping: ``tanh(x / cap) * cap`` (``None``: ``x``), in transformers' order."""
    return x if cap is None else torch.tanh(x / cap) * cap


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE over the first ``cos.shape[-1]`` features of each head (all of them but where the rotary factor is
    partial, Phi-3): ``x`` [N, H, d], ``cos``/``sin`` [N|1, 1, r]."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


Block = tuple[
    Tensor, Tensor, Tensor | None
]  # keys [G, Hkv, d, K], values [G, Hkv, K, d], bias (below) or None


def attend_blocks(q: Tensor, blocks: list[Block], scale: float, softcap: float | None = None) -> Tensor:
    """Grouped-query attention of ``q`` [N, H, d] (rows input-major, ``R = N / G`` per input) over blocks of keys
    under one float32 softmax, in the blocks' order (a decoder-only cache: its prompt and its generated positions).
    A block's bias is additive float32, [G|1, 1, Rq|1, 1, K] (0 or ``-inf``), over the scores viewed as [G, Hkv, R,
    H/Hkv, K]. ``softcap`` (Gemma2): scaled scores become ``tanh(s / softcap) * softcap`` before the bias. Returns
    [N, H*d]."""
    n, h, d = q.shape
    b, hkv = blocks[0][0].shape[:2]
    r, g = n // b, h // hkv
    qg = (
        q.view(b, r, hkv, g, d).transpose(1, 2).reshape(b, hkv, r * g, d)
    )  # one input's beams x one head's group
    parts = []
    for keys_t, _, bias in blocks:
        scores = scores32(qg, keys_t).mul_(scale)  # [B, Hkv, R*G, K] float32
        scores = soft_cap(scores, softcap)
        if bias is not None:
            scores = (scores.view(b, hkv, r, g, -1) + bias).view(b, hkv, r * g, -1)
        parts.append(scores)
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1).to(blocks[0][1].dtype)  # [B, Hkv, R*G, sum K]
    out, at = None, 0
    for keys_t, values, _ in blocks:
        k = keys_t.shape[-1]
        part = torch.matmul(probs[..., at : at + k], values)  # [B, Hkv, R*G, d]
        out = part if out is None else out.add_(part)
        at += k
    assert out is not None
    out = out.view(b, hkv, r, g, d).transpose(1, 2).reshape(n, h * d)  # [B, R, Hkv, G, d] -> [N, H*d]
    return out.to(q.dtype)
