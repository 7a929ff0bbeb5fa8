"""Every fast family as a description over the two shared decoders (``encoder_decoder.py``, ``decoder_only.py``).

A family is a row of :data:`FAMILIES` (``config.model_type`` -> description) and, where its modules are named or
shaped differently, a *reader*: a function that takes one decoder layer of the transformers model and returns its
weights as the shared decoder's layer (:class:`Seq2SeqLayer`, :class:`CausalLayer`: the model's own parameters, or
views of them, or int8 copies). Everything else is a switch the decoder reads. Adding a family is a row, a reader
only if none of the five fits, and a fixture (tests/test_families.py).

Encoder-decoders (:class:`Seq2Seq`; the encoder is always the model's own):

=========  ========  ====  ==============================================  =====================  ===========
family     reader    norm  positions                                       embedding norm         final norm
=========  ========  ====  ==============================================  =====================  ===========
bart, led  bart      post  table (learned; BART's offset 2)                layernorm_embedding    -
mbart      bart      pre   table (learned, offset 2)                       layernorm_embedding    layer_norm
marian     bart      post  table (sinusoidal)                              -                      -
pegasus    bart      pre   table (sinusoidal)                              -                      layer_norm
m2m_100    bart      pre   table (sinusoidal; a pad token takes row pad)   -                      layer_norm
pegasus_x  bart      pre   computed sinusoid (tabled once)                 -                      layer_norm
t5, mt5,   t5        pre   relative bias of the first block                -                      final_layer_norm
longt5
umt5       t5        pre   relative bias of every block                    -                      final_layer_norm
t5gemma    t5gemma   pre   rotary                                          (times sqrt(hidden))   norm
t5gemma2   t5gemma2  pre   rotary per layer type                           (the module's scale)   norm
=========  ========  ====  ==============================================  =====================  ===========

T5Gemma's decoder is Gemma 2's with cross-attention: an RMSNorm after each sub-layer too, grouped-query K/V heads
in both attentions (cached as K/V heads only), soft-capped attention and final logits, sliding-window layers.
T5Gemma 2's is Gemma 3's with its cross-attention merged into self-attention: the source's keys (through the same
projections and ``k_norm``) join the decoder's own under one softmax.

Decoder-only (:class:`Causal`; the prompt's prefill is always the model's own forward):

=============  =======  ================  =======================================================================
family         reader   positions         else
=============  =======  ================  =======================================================================
gpt2           gpt2     learned           LayerNorm, fused q|k|v (Conv1D), GELU MLP
llama,         llama    rotary            RMSNorm, SwiGLU, grouped-query K/V heads; Qwen2's q/k/v biases
mistral, qwen2
qwen3          llama    rotary            + q/k RMSNorm per head
phi3           phi3     rotary (partial)  fused q|k|v and gate|up projections
gemma2         llama    rotary            + norms after attention and MLP, attention and final logit soft-capping
gemma3_text    llama    rotary per layer  + q/k norms, norms after attention and MLP
                        type
=============  =======  ================  =======================================================================

Sliding-window layers (Mistral, Qwen2's windowed layers, Phi-3, Gemma2/3, T5Gemma) mask the keys ``sliding_window``
or more positions back (the caches' ``windowed`` biases). A variant a decoder does not reproduce exactly (a
length-dependent RoPE, an attention kind not written) has its reason in :func:`refusal`; such a model runs the
generic backend, which names the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from torch import Tensor, nn

from seqgen_cli.models.fuse import concat_linears, fuse_linears
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


def bart_layer(layer: nn.Module, int8: bool) -> Seq2SeqLayer:
    """A BART-named decoder layer (``self_attn``, ``encoder_attn``, ``fc1``/``fc2``; BART, mBART, Marian, Pegasus,
    M2M-100 / NLLB, LED, Pegasus-X)."""
    sa, ca = layer.self_attn, layer.encoder_attn

    def lin(module: nn.Module) -> Linear:
        return linear(module.weight, module.bias, int8)

    fuse = concat_linears if int8 else fuse_linears  # int8: the fused float32 weight only while copied
    qkv_w, qkv_b = fuse([sa.q_proj, sa.k_proj, sa.v_proj])  # [3D, D], [3D]
    ckv_w, ckv_b = fuse([ca.k_proj, ca.v_proj])  # [2D, D], [2D]
    maps = dict(
        qkv=linear(qkv_w, qkv_b, int8), o=lin(sa.out_proj), cq=lin(ca.q_proj), ckv=linear(ckv_w, ckv_b, int8),
        co=lin(ca.out_proj), fc1=lin(layer.fc1), fc2=lin(layer.fc2),
    )  # fmt: skip
    fc1, fc2, act = maps["fc1"], maps["fc2"], layer.activation_fn
    return Seq2SeqLayer(
        ln_self=layer.self_attn_layer_norm, qkv_w=None if int8 else qkv_w, qkv=maps["qkv"], o=maps["o"],
        scale=float(sa.scaling), ln_cross=layer.encoder_attn_layer_norm, cq=maps["cq"],
        ckv_w=None if int8 else ckv_w, ckv=maps["ckv"], co=maps["co"],
        ln_ff=layer.final_layer_norm, ff=lambda x: fc2(act(fc1(x))), maps=maps,
    )  # fmt: skip


def _t5_feed_forward(ff: nn.Module, maps: dict[str, Linear], int8: bool) -> Linear:
    """``T5DenseActDense`` / ``T5DenseGatedActDense`` (no dropout at inference), with the dtype cast before ``wo``;
    its maps go into ``maps``."""
    wo = maps["wo"] = linear(ff.wo.weight, None, int8)
    if hasattr(ff, "wi_0"):  # gated: act(wi_0 x) * wi_1 x
        wi_0 = maps["wi_0"] = linear(ff.wi_0.weight, None, int8)
        wi_1 = maps["wi_1"] = linear(ff.wi_1.weight, None, int8)
        return lambda x: wo((ff.act(wi_0(x)) * wi_1(x)).to(ff.wo.weight.dtype))
    wi = maps["wi"] = linear(ff.wi.weight, None, int8)
    return lambda x: wo(ff.act(wi(x)).to(ff.wo.weight.dtype))


def t5_block(block: nn.Module, int8: bool) -> Seq2SeqLayer:
    """A T5-named decoder block (``layer[0].SelfAttention``, ``layer[1].EncDecAttention``, ``layer[2]`` feed-forward;
    T5, mT5, LongT5, UMT5): unscaled attention."""
    sa, ca, ff = block.layer[0], block.layer[1], block.layer[2]
    att, cross = sa.SelfAttention, ca.EncDecAttention
    fuse = concat_linears if int8 else fuse_linears  # int8: the fused float32 weight only while copied
    qkv_w, _ = fuse([att.q, att.k, att.v])  # [3I, D]
    ckv_w, ckv_b = fuse([cross.k, cross.v])  # [2I, D], None
    maps = dict(
        qkv=linear(qkv_w, None, int8), o=linear(att.o.weight, None, int8), cq=linear(cross.q.weight, None, int8),
        ckv=linear(ckv_w, ckv_b, int8), co=linear(cross.o.weight, None, int8),
    )  # fmt: skip
    return Seq2SeqLayer(
        ln_self=sa.layer_norm, qkv_w=None if int8 else qkv_w, qkv=maps["qkv"], o=maps["o"], scale=1.0,
        ln_cross=ca.layer_norm, cq=maps["cq"], ckv_w=None if int8 else ckv_w, ckv=maps["ckv"], co=maps["co"],
        ln_ff=ff.layer_norm,
        ff=_t5_feed_forward(ff.DenseReluDense, maps, int8), maps=maps,
        relative=att if getattr(att, "has_relative_attention_bias", False) else None,
    )  # fmt: skip


def t5gemma_layer(layer: nn.Module, int8: bool) -> Seq2SeqLayer:
    """A T5Gemma decoder layer (Gemma 2's with cross-attention: ``self_attn``, ``cross_attn``, ``mlp``; an RMSNorm
    before and after each): grouped-query K/V heads in both attentions, soft-capped scores, a gated MLP."""
    sa, ca, mlp = layer.self_attn, layer.cross_attn, layer.mlp

    def lin(module: nn.Module) -> Linear:
        return linear(module.weight, module.bias, int8)

    fuse = concat_linears if int8 else fuse_linears  # int8: the fused float32 weight only while copied
    qkv_w, qkv_b = fuse([sa.q_proj, sa.k_proj, sa.v_proj])  # [(H + 2 Hkv) d, D]
    ckv_w, ckv_b = fuse([ca.k_proj, ca.v_proj])  # [2 Hkv d, D_enc]
    maps = dict(
        qkv=linear(qkv_w, qkv_b, int8), o=lin(sa.o_proj), cq=lin(ca.q_proj), ckv=linear(ckv_w, ckv_b, int8),
        co=lin(ca.o_proj), gate=lin(mlp.gate_proj), up=lin(mlp.up_proj), down=lin(mlp.down_proj),
    )  # fmt: skip
    gate, up, down, act = maps["gate"], maps["up"], maps["down"], mlp.act_fn
    return Seq2SeqLayer(
        ln_self=layer.pre_self_attn_layernorm, qkv_w=None if int8 else qkv_w, qkv=maps["qkv"], o=maps["o"],
        scale=float(sa.scaling), ln_cross=layer.pre_cross_attn_layernorm, cq=maps["cq"],
        ckv_w=None if int8 else ckv_w, ckv=maps["ckv"], co=maps["co"], ln_ff=layer.pre_feedforward_layernorm,
        ff=lambda x: down(act(gate(x)) * up(x)), maps=maps,
        ln_self_out=layer.post_self_attn_layernorm, ln_cross_out=layer.post_cross_attn_layernorm,
        ln_ff_out=layer.post_feedforward_layernorm, softcap=sa.attn_logit_softcapping,
    )  # fmt: skip


def t5gemma2_layer(layer: nn.Module, int8: bool) -> Seq2SeqLayer:
    """A T5Gemma 2 decoder layer (Gemma 3's, its self-attention *merged* with cross-attention: the source's keys and
    values come from the same ``k_proj`` / ``v_proj``, its keys through ``k_norm`` too, and join the decoder's own
    under one softmax); q/k norms, an RMSNorm before and after each sub-layer."""
    sa, mlp = layer.self_attn, layer.mlp

    def lin(module: nn.Module) -> Linear:
        return linear(module.weight, module.bias, int8)

    fuse = concat_linears if int8 else fuse_linears  # int8: the fused float32 weight only while copied
    qkv_w, qkv_b = fuse([sa.q_proj, sa.k_proj, sa.v_proj])  # [(H + 2 Hkv) d, D]
    q_rows = sa.q_proj.out_features
    kv_b = None if qkv_b is None else qkv_b[q_rows:]
    maps = dict(
        qkv=linear(qkv_w, qkv_b, int8), o=lin(sa.o_proj), ckv=linear(qkv_w[q_rows:], kv_b, int8),
        gate=lin(mlp.gate_proj), up=lin(mlp.up_proj), down=lin(mlp.down_proj),
    )  # fmt: skip
    gate, up, down, act = maps["gate"], maps["up"], maps["down"], mlp.act_fn
    return Seq2SeqLayer(
        ln_self=layer.pre_self_attn_layernorm, qkv_w=None if int8 else qkv_w, qkv=maps["qkv"], o=maps["o"],
        scale=float(sa.scaling), ln_cross=None, cq=None, ckv_w=None, ckv=maps["ckv"], co=None,
        ln_ff=layer.pre_feedforward_layernorm, ff=lambda x: down(act(gate(x)) * up(x)), maps=maps,
        ln_self_out=layer.post_self_attn_layernorm, ln_ff_out=layer.post_feedforward_layernorm,
        softcap=sa.attn_logit_softcapping, merged=True, q_norm=sa.q_norm, k_norm=sa.k_norm,
        layer_type=sa.layer_type or "full_attention",
    )  # fmt: skip


Positions = Literal[
    "table", "padded table", "computed", "relative", "relative per layer", "rotary", "rotary per layer type"
]


@dataclass(frozen=True)
class Seq2Seq:
    """How an encoder-decoder family's decoder differs (see the module's table)."""

    reader: Callable[[nn.Module, bool], Seq2SeqLayer]
    pre_norm: bool
    positions: Positions
    embedding_norm: str | None = None  # the decoder's norm after the embeddings, by attribute name
    final_norm: str | None = None  # the decoder's norm after the last layer, by attribute name
    clamp_fp16: bool = False  # T5's overflow guard after each sub-layer in float16
    layers: str = "layers"  # the decoder's list of layers
    scaled_embedding: bool = False  # embeddings times sqrt(hidden size), rounded to the model's dtype (Gemma)
    scale_scores: bool = False  # the attention scale multiplies q.k, not q (transformers' eager attention)


_T5 = dict(reader=t5_block, pre_norm=True, final_norm="final_layer_norm", clamp_fp16=True, layers="block")

# -- decoder-only -----------------------------------------------------------------------------------------------


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


def gpt2_block(block: nn.Module, int8: bool) -> CausalLayer:
    """A GPT-2 block: Conv1D weights [in, out] as maps over their transposed views; c_attn is q|k|v fused."""

    def conv1d(conv: nn.Module) -> Linear:
        return linear(conv.weight.t(), conv.bias, int8)  # weight [in, out] -> [out, in] view

    at, mlp = block.attn, block.mlp
    maps = dict(c_attn=conv1d(at.c_attn), c_proj=conv1d(at.c_proj), c_fc=conv1d(mlp.c_fc), mlp_proj=conv1d(mlp.c_proj))
    c_attn, c_fc, proj, act = maps["c_attn"], maps["c_fc"], maps["mlp_proj"], mlp.act
    return CausalLayer(
        ln_in=block.ln_1, qkv=lambda h: c_attn(h).chunk(3, dim=-1), o=maps["c_proj"], scale=float(at.scaling),
        ln_mlp=block.ln_2, mlp=lambda h: proj(act(c_fc(h))), maps=maps,
    )  # fmt: skip


def _map(module: nn.Linear, int8: bool) -> Linear:
    """A Llama-style projection: :func:`dense` over the model's own weight in float32 (packing measured no gain
    there), or an int8 copy."""
    return linear(module.weight, module.bias, True) if int8 else partial(dense, weight=module.weight, bias=module.bias)


def llama_layer(layer: nn.Module, int8: bool) -> CausalLayer:
    """A Llama-named layer (``self_attn.q_proj``..., ``mlp.gate_proj``/``up_proj``/``down_proj``): Llama, Mistral,
    Qwen2, Qwen3, Gemma2, Gemma3; with the norms each of them has."""
    at, mlp = layer.self_attn, layer.mlp
    maps = dict(
        q=_map(at.q_proj, int8), k=_map(at.k_proj, int8), v=_map(at.v_proj, int8), o=_map(at.o_proj, int8),
        gate=_map(mlp.gate_proj, int8), up=_map(mlp.up_proj, int8), down=_map(mlp.down_proj, int8),
    )  # fmt: skip
    q, k, v, gate, up, down, act = (*(maps[n] for n in ("q", "k", "v", "gate", "up", "down")), mlp.act_fn)
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    return CausalLayer(
        ln_in=layer.input_layernorm, qkv=lambda h: (q(h), k(h), v(h)), o=maps["o"], scale=float(at.scaling),
        ln_mlp=layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
        mlp=lambda h: down(act(gate(h)) * up(h)),
        q_norm=getattr(at, "q_norm", None), k_norm=getattr(at, "k_norm", None),
        ln_attn_out=layer.post_attention_layernorm if gemma else None,
        ln_mlp_out=layer.post_feedforward_layernorm if gemma else None,
        softcap=getattr(at, "attn_logit_softcapping", None),
        layer_type=getattr(at, "layer_type", None) or "full_attention",
        maps=maps,
    )  # fmt: skip


def phi3_layer(layer: nn.Module, int8: bool) -> CausalLayer:
    """A Phi-3 layer: ``qkv_proj`` (q|k|v) and ``gate_up_proj`` (gate|up) fused in the checkpoint."""
    at, mlp = layer.self_attn, layer.mlp
    maps = dict(
        qkv=_map(at.qkv_proj, int8), o=_map(at.o_proj, int8), gate_up=_map(mlp.gate_up_proj, int8),
        down=_map(mlp.down_proj, int8),
    )  # fmt: skip
    qkv, gate_up, down, act = maps["qkv"], maps["gate_up"], maps["down"], mlp.activation_fn
    q_size, kv_size = at.config.num_attention_heads * at.head_dim, at.config.num_key_value_heads * at.head_dim

    def split(h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(qkv(h).split((q_size, kv_size, kv_size), dim=-1))  # [N, H*d | Hkv*d | Hkv*d]

    def feed_forward(h: Tensor) -> Tensor:
        g, u = gate_up(h).chunk(2, dim=-1)  # [N, 2F] -> 2 x [N, F]
        return down(u * act(g))

    return CausalLayer(
        ln_in=layer.input_layernorm, qkv=split, o=maps["o"], scale=float(at.scaling),
        ln_mlp=layer.post_attention_layernorm, mlp=feed_forward, maps=maps,
    )  # fmt: skip


@dataclass(frozen=True)
class Causal:
    """How a decoder-only family's decoder differs (see the module's table)."""

    reader: Callable[[nn.Module, bool], CausalLayer]
    positions: Literal["learned", "rotary", "rotary per layer type"]
    final_norm: str  # the base model's norm after the last layer, by attribute name
    embed: str = "embed_tokens"  # the base model's token embedding (scaled by the module itself where it is)
    layers: str = "layers"


_LLAMA = Causal(reader=llama_layer, positions="rotary", final_norm="norm")

FAMILIES: dict[str, Seq2Seq | Causal] = {
    "bart": Seq2Seq(bart_layer, pre_norm=False, positions="table", embedding_norm="layernorm_embedding"),
    "mbart": Seq2Seq(
        bart_layer, pre_norm=True, positions="table", embedding_norm="layernorm_embedding", final_norm="layer_norm"
    ),
    "marian": Seq2Seq(bart_layer, pre_norm=False, positions="table"),
    "pegasus": Seq2Seq(bart_layer, pre_norm=True, positions="table", final_norm="layer_norm"),
    "m2m_100": Seq2Seq(bart_layer, pre_norm=True, positions="padded table", final_norm="layer_norm"),
    "led": Seq2Seq(bart_layer, pre_norm=False, positions="table", embedding_norm="layernorm_embedding"),
    "pegasus_x": Seq2Seq(bart_layer, pre_norm=True, positions="computed", final_norm="layer_norm"),
    "t5": Seq2Seq(positions="relative", **_T5),  # v1.0, v1.1 and Flan-T5
    "mt5": Seq2Seq(positions="relative", **_T5),
    "longt5": Seq2Seq(positions="relative", **_T5),  # the encoder's local / transient-global attention: its own
    "umt5": Seq2Seq(positions="relative per layer", **_T5),
    "t5gemma": Seq2Seq(
        t5gemma_layer, pre_norm=True, positions="rotary", final_norm="norm", scaled_embedding=True,
        scale_scores=True,
    ),  # fmt: skip
    "t5gemma2": Seq2Seq(t5gemma2_layer, pre_norm=True, positions="rotary per layer type", final_norm="norm"),
    "gpt2": Causal(reader=gpt2_block, positions="learned", final_norm="ln_f", embed="wte", layers="h"),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma2": _LLAMA,
    "gemma3_text": Causal(reader=llama_layer, positions="rotary per layer type", final_norm="norm"),
    "phi3": Causal(reader=phi3_layer, positions="rotary", final_norm="norm"),
}

def sliding_layers(cfg: Any, layers: int) -> tuple[list[bool], int | None]:
    """Which of the ``layers`` decoder layers slide, and their window: the config's layer kinds, or every layer
    where it has a window and no kinds (Mistral, Phi-3); window ``None`` where none slides."""
    window = getattr(cfg, "sliding_window", None)
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
    sliding = [kind == "sliding_attention" for kind in kinds]
    return sliding, int(window) if any(sliding) and window else None


STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # frequencies that do not depend on the sequence length


def length_dependent_rope(config: Any) -> str | None:
    """The ``rope_type`` of ``config`` (a decoder's own, each layer type's) whose frequencies transformers picks
    by the sequence length in each call, or ``None``: ``longrope`` (the long or the short factors by the batch's
    furthest position; Phi-3 also runs the whole sequence again once its *padded* length passes
    ``original_max_position_embeddings``) and the ``dynamic`` kinds (NTK scaling to the furthest position). Such a
    model's outputs, ``generate()``'s too, depend on the padding and on the lengths of the inputs beside it, so
    seqgen runs it unpadded, in batches of one length (``Generator.width``)."""
    cfg = getattr(config, "decoder", None) or config  # T5Gemma: the decoder's own config
    ropes = getattr(cfg, "rope_parameters", None) or {}
    per_type = [v for v in ropes.values() if isinstance(v, dict)] or [ropes]  # Gemma3: one per layer type
    for rope in per_type:
        kind = str(rope.get("rope_type", "default"))
        if kind == "longrope" or "dynamic" in kind:  # transformers' dynamic_rope_update: these two
            return kind
    return None


def refusal(model: Any) -> str | None:
    """Why the family's decoder would not reproduce this variant exactly, or ``None``."""
    cfg = model.config
    family = FAMILIES.get(cfg.model_type)
    if cfg.model_type == "gpt2" and getattr(cfg, "add_cross_attention", False):
        return "GPT-2 with cross-attention is not a decoder-only LM"
    if family is None or not family.positions.startswith("rotary"):
        return None
    cfg = getattr(cfg, "decoder", None) or cfg  # T5Gemma: the decoder's own config
    ropes = getattr(cfg, "rope_parameters", None) or {}
    per_type = [v for v in ropes.values() if isinstance(v, dict)] or [ropes]  # Gemma3: one per layer type
    for rope in per_type:
        kind = rope.get("rope_type", "default")
        if kind not in STATIC_ROPE:
            return f"rope_type {kind!r} (length-dependent RoPE) is not supported by the fast backend"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 is not supported by the fast backend"
    types = getattr(cfg, "layer_types", None) or ()
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        return f"attention kinds {sorted(set(types))} are not supported by the fast backend"
    return None
