"""The layers every family file fills, and the descriptions its decoder reads (``families/``).

A family file describes its decoder (:class:`Seq2Seq`, :class:`Causal`: what differs between families, as switches
the shared decoders read) and names a *reader*: one decoder layer of the transformers model (or of seqgen's own tree)
-> the shared decoder's layer (:class:`Seq2SeqLayer`, :class:`CausalLayer`: the model's own norms and its linear maps
over the model's parameters, or views of them, or int8 copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from torch import Tensor, nn

from seqgen_cli.models.linear_maps import Linear, dense, linear

# -- encoder-decoders -------------------------------------------------------------------------------------------


@dataclass
class Seq2SeqLayer:
    """One decoder layer of an encoder-decoder: norms (the model's modules) and linear maps over its weights."""

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
    relative: nn.Module | None = None  # the self-attention module that owns this layer's relative bias (UMT5)
    ln_self_out: nn.Module | None = None  # on each sub-layer's output, before the residual (T5Gemma)
    ln_cross_out: nn.Module | None = None
    ln_ff_out: nn.Module | None = None
    softcap: float | None = None  # attention logit soft-capping, self and cross (T5Gemma)
    merged: bool = False  # the source's keys under the self-attention's softmax, no cross sub-layer (T5Gemma 2)
    q_norm: nn.Module | None = None  # per head, before RoPE; ``k_norm`` on the source's keys too (T5Gemma 2)
    k_norm: nn.Module | None = None
    layer_type: str = "full_attention"  # its rotary table, where the model has one per layer type (T5Gemma 2)


Positions = Literal[
    "table", "padded table", "computed", "relative", "relative per layer", "rotary", "rotary per layer type"
]


@dataclass(frozen=True)
class Seq2Seq:
    """How an encoder-decoder family's decoder differs from the others (each family file's table)."""

    reader: Callable[[nn.Module, bool], Seq2SeqLayer]
    pre_norm: bool
    positions: Positions
    embedding_norm: str | None = None  # the decoder's norm after the embeddings, by attribute name
    final_norm: str | None = None  # the decoder's norm after the last layer, by attribute name
    clamp_fp16: bool = False  # T5's overflow guard after each sub-layer in float16
    layers: str = "layers"  # the decoder's list of layers
    scaled_embedding: bool = False  # embeddings times sqrt(hidden size), rounded to the model's dtype (Gemma)
    scale_scores: bool = False  # the attention scale multiplies q.k, not q (transformers' eager attention)
    table: str | None = None  # the config field sizing the decoder's fixed position table (past it: IndexError)
    source_limit: bool = True  # False: the encoder's positions set no limit on an input (T5's ``n_positions``)
    refuse: Callable[[Any], str | None] | None = None  # config -> why a variant is not this family's decoder


# -- decoder-only ---------------------------------------------------------------------------------------------------


@dataclass
class CausalLayer:
    """One decoder-only layer: norms (the model's modules, ``None`` where the family has none) and linear maps."""

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


@dataclass(frozen=True)
class Causal:
    """How a decoder-only family's decoder differs from the others (each family file's table)."""

    reader: Callable[[nn.Module, bool], CausalLayer]
    positions: Literal["learned", "rotary", "rotary per layer type"]
    final_norm: str  # the base model's norm after the last layer, by attribute name
    embed: str = "embed_tokens"  # the base model's token embedding (scaled by the module itself where it is)
    layers: str = "layers"
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
