"""The layers every family file fills, and the descriptions its decoder reads (``families/``).

A family file describes its decoder (:class:`Seq2Seq`, :class:`Causal`: what differs between families, as switches
the shared decoders read) and names a *reader*: one decoder layer of the transformers model (or of seqgen's own tree)
-> the shared decoder's layer (:class:`Seq2SeqLayer`, :class:`CausalLayer`: the model's own norms and its linear maps
over the model's parameters, or views of them, or int8 copies), and its *facts*: the model -> what its decoder is
beside the layers (:class:`DecoderFacts`, :class:`CausalFacts`: embeddings, positions, norms, heads), read by the
attribute names only the family file knows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from seqgen_cli.models.attention import Block, Keys, attend_blocks, attention, rope
from seqgen_cli.models.linear_maps import Linear, dense, linear
from seqgen_cli.shapes import CROSS_CHUNK


class LayerCache(Protocol):
    """What a decoder layer may call on its cache (``models/kv_cache.py``): nothing else of it."""

    def update(self, layer: int, k: Tensor, v: Tensor, sliding: bool = False) -> list[Block]:
        """Store this step's keys and values of ``layer``; the blocks its queries attend, each with its bias."""
        ...


class SourceCache(LayerCache, Protocol):
    """An encoder-decoder's cache: the source's cross-attention K/V too."""

    def source(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """``layer``'s source keys [B, Hkv, d, S] (transposed), values [B, Hkv, S, d] and mask [B, 1, 1, S]."""
        ...


class Step(NamedTuple):
    """What a decoder layer reads in one step beside its input: the cache (:class:`LayerCache`; an
    encoder-decoder's a :class:`SourceCache`) and RoPE's cos/sin per layer type (``None``: no rotary positions)."""

    cache: LayerCache | SourceCache
    rope: dict[str, tuple[Tensor, Tensor]] | None = None


@dataclass(frozen=True)
class Place:
    """Where a layer sits in its decoder and how the family computes around it (the decoder sets it once)."""

    index: int  # the layer's number: its cache entries, its cross K/V
    heads: int  # query heads
    kv_heads: int  # K/V heads (grouped-query attention: fewer)
    head_dim: int
    sliding: bool = False  # attends only the keys within the cache's window
    rope: str = "full_attention"  # its rotary table (by layer type)
    pre_norm: bool = True  # the norm before each sub-layer (else after its residual sum: BART, Marian)
    clamp: bool = False  # T5's float16 overflow guard after each sub-layer
    scale_scores: bool = False  # the attention scale multiplies q.k, not q (transformers' eager attention)


def clamp_fp16(x: Tensor) -> Tensor:
    """T5's float16 overflow guard after a sub-layer, sync-free (as transformers writes it)."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(x.dtype).max
    limit = torch.where(torch.isinf(x).any(), top - 1000, top)
    return torch.clamp(x, min=-limit, max=limit)


# -- encoder-decoders -------------------------------------------------------------------------------------------


@dataclass
class Seq2SeqLayer:
    """One decoder layer of an encoder-decoder: self-attention over its cache, cross-attention over the source's
    K/V (the ``R`` rows of an input share them), feed-forward; norms (the model's modules) and linear maps over its
    weights. ``layer(x, step)``: [N, D] -> [N, D]."""

    ln_self: nn.Module
    qkv_w: Tensor | None  # [(H + 2 Hkv) d, D]: q|k|v fused, the model's parameters re-pointed at slices of it
    # (fuse.py); int8: None
    qkv: Linear
    o: Linear
    scale: float  # attention scale (T5: 1, unscaled)
    ln_cross: nn.Module | None  # None: no cross-attention sub-layer (merged attention)
    cq: Linear | None
    ckv_w: Tensor | None  # [2 Hkv d, D_enc]: cross-attention k|v fused; int8: None
    ckv: Linear  # the source's keys and values: [B, S, D_enc] -> [B, S, 2 Hkv d]
    co: Linear | None
    ln_ff: nn.Module
    ff: Linear  # the whole feed-forward: [N, D] -> [N, D]
    maps: dict[str, Linear]  # every linear map of the layer by name (int8 checks, tests)
    ln_self_out: nn.Module | None = None  # on each sub-layer's output, before the residual (T5Gemma)
    ln_cross_out: nn.Module | None = None
    ln_ff_out: nn.Module | None = None
    softcap: float | None = None  # attention logit soft-capping, self and cross (T5Gemma)
    q_norm: nn.Module | None = None  # per head, before RoPE; ``k_norm`` on the source's keys too (T5Gemma 2)
    k_norm: nn.Module | None = None
    layer_type: str = "full_attention"  # its rotary table, where the model has one per layer type (T5Gemma 2)
    at: Place | None = None  # set by the decoder

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        x = self.residual(x, self.ln_self, self.ln_self_out, lambda h: self.self_attention(h, step))
        x = self.residual(x, self.ln_cross, self.ln_cross_out, lambda h: self.cross_attention(h, step))
        return self.residual(x, self.ln_ff, self.ln_ff_out, self.ff)

    def residual(self, x: Tensor, norm: nn.Module, out: nn.Module | None, sub: Callable[[Tensor], Tensor]) -> Tensor:
        """A sub-layer and its residual sum: the norm before it (pre-norm) or after the sum, the sub-layer's output
        normed first where the family norms it (T5Gemma), T5's float16 guard after the sum."""
        pre = self.at.pre_norm
        y = sub(norm(x) if pre else x)
        x = x + (y if out is None else out(y))
        x = clamp_fp16(x) if self.at.clamp else x
        return x if pre else norm(x)

    def self_attention(self, h: Tensor, step: Step) -> Tensor:
        """[N, D] -> [N, D]: this step's q/k/v (q/k normed, rotated where the family does), k/v into the cache, the
        attention over each row's history (and, merged, the source's keys), projected."""
        at, n = self.at, h.shape[0]
        h_d, kv_d = at.heads * at.head_dim, at.kv_heads * at.head_dim
        q, k, v = self.qkv(h).split((h_d, kv_d, kv_d), dim=-1)  # [N, H*d], [N, Hkv*d], [N, Hkv*d]
        q, k, v = q.view(n, -1, at.head_dim), k.view(n, -1, at.head_dim), v.view(n, -1, at.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if step.rope is not None:
            cos, sin = step.rope[at.rope]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        ((keys_t, values, bias),) = step.cache.update(at.index, k, v, at.sliding)  # keys_t [B, Hkv, d, span*R]
        b = keys_t.shape[0]
        qb = q.view(b, n // b, at.heads, at.head_dim).transpose(1, 2)  # [N, H, d] -> [B, H, Rq, d]
        out = attention(qb, keys_t, values, bias, self.scale, None, self.softcap, at.scale_scores, self.source(step))
        return self.o(out.transpose(1, 2).reshape(n, h_d))  # [B, H, Rq, d] -> [B, Rq, H, d] -> [N, H*d] -> [N, D]

    def source(self, step: Step) -> Keys | None:
        """The source's keys attended under the self-attention's softmax (merged attention), or ``None``."""
        return None

    def cross_attention(self, h: Tensor, step: Step) -> Tensor:
        """[N, D] -> [N, D]: the step's queries (N = B*R, input-major) against the input's source K/V: the ``R``
        rows of an input as its query positions (FastSeq's trick), the values summed by ``CROSS_CHUNK`` chunks."""
        at, i = self.at, self.at.index
        q = self.cq(h)  # [N, H*d]
        keys_t, values, mask = step.cache.source(i)  # [B, Hkv, d, S], [B, Hkv, S, d], [B, 1, 1, S]
        b, n = keys_t.shape[0], q.shape[0]
        q = q.view(b, n // b, at.heads, at.head_dim).transpose(1, 2)  # [N, H*d] -> [B, H, R, d]
        out = attention(
            q, keys_t, values, mask, self.scale, CROSS_CHUNK, self.softcap, at.scale_scores
        )  # [B, H, R, d]
        return self.co(out.transpose(1, 2).reshape(n, -1))  # [B, R, H, d] -> [N, H*d] -> [N, D]

    def source_keys(self, keys: Tensor) -> Tensor:
        """The source's keys [B, S, Hkv, d] as this layer attends them."""
        return keys


@dataclass
class MergedLayer(Seq2SeqLayer):
    """T5Gemma 2's decoder layer: no cross-attention sub-layer; the source's keys (through the same ``k_proj`` and
    ``k_norm``) and values join the decoder's own under the self-attention's one softmax."""

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        x = self.residual(x, self.ln_self, self.ln_self_out, lambda h: self.self_attention(h, step))
        return self.residual(x, self.ln_ff, self.ln_ff_out, self.ff)

    def source(self, step: Step) -> Keys:
        return (*step.cache.source(self.at.index), CROSS_CHUNK)

    def source_keys(self, keys: Tensor) -> Tensor:
        return keys if self.k_norm is None else self.k_norm(keys)


PositionKind = Literal[
    "table", "padded table", "computed", "relative", "relative per layer", "rotary", "rotary per layer type"
]


class PositionTable(Protocol):
    """A decoder's absolute position embeddings, as its family makes them (``families/bart.py``)."""

    def __call__(self, rows: int) -> Tensor:
        """The table, ``rows`` rows at least (a table the module grows on demand grown first): [n, D], ``n >= rows``."""
        ...


class RelativeBias(Protocol):
    """A decoder's relative position bias, as its family computes it (``families/t5.py``)."""

    layers: int  # L': 1 (the first block's, shared by every block) or every block's own

    def __call__(self, t: int, device: torch.device) -> Tensor:
        """The bias of ``t`` query against ``t`` key positions: [L', H, T, T]."""
        ...


@dataclass(frozen=True)
class DecoderFacts:
    """What an encoder-decoder's decoder is beside its layers' weights, read from the model (transformers' or
    seqgen's own tree) by its family file's ``facts``, which alone knows the names: the shared decoder
    (``encoder_decoder.py``) reads the model through these and the standard ``get_decoder``/``get_encoder``/
    ``get_output_embeddings`` only."""

    heads: int  # query heads
    kv_heads: int  # K/V heads (grouped-query attention: fewer), what the caches hold
    head_dim: int
    embed: Tensor  # the token embeddings [V_in, D]
    layers: Sequence[nn.Module]  # the decoder's layers in order, each read by the family's ``reader``
    config: Any  # the decoder's config: its layer kinds and sliding window (``sliding_layers``)
    ln_embed: nn.Module | None = None  # the norm after the embeddings
    ln_final: nn.Module | None = None  # the norm after the last layer
    rotary: nn.Module | None = None  # RoPE's module, ``(x, positions) -> (cos, sin)``: rotary positions
    position_table: PositionTable | None = None  # absolute positions: their embeddings
    relative_bias: RelativeBias | None = None  # relative positions: their bias (T5)
    embed_scale: float | Tensor | None = None  # embeddings times this (a tensor: in the model's dtype); None: unscaled
    eoi: int | None = None  # T5Gemma 2: the end-of-image token, embedded as ``eoi_embedding``, not its row
    eoi_embedding: Tensor | None = None
    logits_bias: Tensor | None = None  # added to the LM head's bias (the BART family's ``final_logits_bias``)
    out_scale: float | None = None  # the LM head's input times this (T5 v1.0's tied head)
    final_softcap: float | None = None  # the logits soft-capped (T5Gemma)
    pad_position: int | None = None  # a pad token's position row (M2M-100's padded table)
    pos_offset: int = 0  # the position table's first row for position 0 (BART: 2)


@dataclass(frozen=True)
class Seq2Seq:
    """How an encoder-decoder family's decoder differs from the others (each family file's table)."""

    reader: Callable[[nn.Module, bool], Seq2SeqLayer]
    pre_norm: bool
    position_kind: PositionKind  # how its tokens get position ids
    facts: Callable[[Any], DecoderFacts]  # the model -> its decoder's facts
    clamp_fp16: bool = False  # T5's overflow guard after each sub-layer in float16
    scale_scores: bool = False  # the attention scale multiplies q.k, not q (transformers' eager attention)
    table: str | None = None  # the config field sizing the decoder's fixed position table (past it: IndexError)
    source_limit: bool = True  # False: the encoder's positions set no limit on an input (T5's ``n_positions``)
    refuse: Callable[[Any], str | None] | None = None  # config -> why a variant is not this family's decoder


# -- decoder-only ---------------------------------------------------------------------------------------------------


@dataclass
class CausalLayer:
    """One decoder-only layer: attention over its cache (the prompt's K/V and the generated positions), MLP; norms
    (the model's modules, ``None`` where the family has none) and linear maps. ``layer(x, step)``: [N, D] -> [N, D]."""

    ln_in: nn.Module  # before attention
    qkv: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]  # [N, D] -> q [N, H*d], k, v [N, Hkv*d]
    o: Linear
    scale: float
    ln_mlp: nn.Module  # before the MLP
    mlp: Linear  # the whole MLP: [N, D] -> [N, D]
    q_norm: nn.Module | None = None  # per head, before RoPE (Qwen3, Gemma3)
    k_norm: nn.Module | None = None
    ln_attn_out: nn.Module | None = None  # on the attention output, before the residual (Gemma2/3)
    ln_mlp_out: nn.Module | None = None  # on the MLP output, before the residual (Gemma2/3)
    softcap: float | None = None  # attention logit soft-capping (Gemma2)
    layer_type: str = "full_attention"  # its rotary table, where the model has one per layer type (Gemma3)
    maps: dict[str, Linear] = field(default_factory=dict)  # every linear map of the layer by name (int8 checks)
    at: Place | None = None  # set by the decoder

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        at, n = self.at, x.shape[0]
        q, k, v = self.qkv(self.ln_in(x))  # [N, H*d], [N, Hkv*d], [N, Hkv*d]
        q, k, v = q.view(n, at.heads, at.head_dim), k.view(n, at.kv_heads, at.head_dim), v.view(n, at.kv_heads, at.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if step.rope is not None:
            cos, sin = step.rope[at.rope]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = self.o(causal_attention(step.cache, at.index, q, k, v, self.scale, self.softcap, at.sliding))  # [N, D]
        x = x + (a if self.ln_attn_out is None else self.ln_attn_out(a))
        m = self.mlp(self.ln_mlp(x))
        return x + (m if self.ln_mlp_out is None else self.ln_mlp_out(m))


def causal_attention(
    cache: Any,
    layer: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    softcap: float | None = None,
    sliding: bool = False,
) -> Tensor:
    """This step's ``k``/``v`` ([N, Hkv, d], after any RoPE) into ``cache`` (a batch's or the lanes'); ``q`` [N, H, d]
    attends the prompt and the generated positions (``sliding``: those within the cache's window) under one float32
    softmax -> [N, H*d]."""
    return attend_blocks(q, cache.update(layer, k, v, sliding), scale, softcap)


@dataclass(frozen=True)
class CausalFacts:
    """What a decoder-only model's decoder is beside its layers' weights, read from the model by its family
    file's ``facts``, which alone knows the names: the shared decoder (``decoder_only.py``) reads the model through
    these and the standard ``base_model``/``get_output_embeddings`` only."""

    heads: int  # query heads
    kv_heads: int  # K/V heads (grouped-query attention: fewer), what the caches hold
    head_dim: int
    max_positions: int  # the positions the model knows (its learned table's rows, or its config's limit)
    embed: nn.Module  # the token embedding (it scales where the family does: Gemma)
    layers: Sequence[nn.Module]  # the decoder's layers in order, each read by the family's ``reader``
    final_norm: nn.Module  # the norm after the last layer
    learned: nn.Module | None = None  # learned absolute positions (GPT-2's ``wpe``): ids [N] -> [N, D]
    rotary: nn.Module | None = None  # RoPE's module, ``(x, positions) -> (cos, sin)``
    final_softcap: float | None = None  # the logits soft-capped (Gemma2)


@dataclass(frozen=True)
class Causal:
    """How a decoder-only family's decoder differs from the others (each family file's table)."""

    reader: Callable[[nn.Module, bool], CausalLayer]
    position_kind: Literal["learned", "rotary", "rotary per layer type"]  # how its tokens get position ids
    facts: Callable[[Any], CausalFacts]  # the model -> its decoder's facts
    table: str | None = None  # the config field sizing the fixed position table (past it: IndexError)
    refuse: Callable[[Any], str | None] | None = None  # config -> why a variant is not this family's decoder


def projection(module: nn.Linear, int8: bool) -> Linear:
    """A Llama-style projection: :func:`dense` over the model's own weight in float32 (packing measured no gain
    there), or an int8 copy."""
    return linear(module.weight, module.bias, True) if int8 else partial(dense, weight=module.weight, bias=module.bias)


def sliding_layers(cfg: Any, layers: int) -> tuple[list[bool], int | None]:
    """Which of the ``layers`` decoder layers slide, and their window: the config's layer kinds, or every layer
    where it has a window and no kinds (Mistral, Phi-3); window ``None`` where none slides."""
    window = getattr(cfg, "sliding_window", None)
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
    sliding = [kind == "sliding_attention" for kind in kinds]
    return sliding, int(window) if any(sliding) and window else None
