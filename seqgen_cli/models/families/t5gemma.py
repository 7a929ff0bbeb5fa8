"""T5Gemma (``t5gemma``) and T5Gemma 2 (``t5gemma2``).

T5Gemma's decoder layer (:func:`t5gemma_layer`) is Gemma 2's with cross-attention: an RMSNorm before and after each
sub-layer, grouped-query K/V heads in both attentions (cached as K/V heads only), rotary positions, soft-capped
attention and final logits, sliding-window layers, embeddings times sqrt(hidden) in the model's dtype, the scale on
the product q.k (transformers' eager attention). T5Gemma 2's (:func:`t5gemma2_layer`) is Gemma 3's with its
cross-attention *merged* into self-attention: the source's keys (through the same projections and ``k_norm``) join
the decoder's own under one softmax; a rotary table per layer type; q/k norms.

And T5Gemma's own module tree (``Tree``, for ``own_model.load``): transformers' names
(``model.encoder.layers.0.self_attn.q_proj``, ``lm_head.out_proj``), each stack with its own config
(``config.encoder`` / ``config.decoder``), and the encoder's forward as transformers' eager attention computes it
(the only one T5Gemma has): embeddings times sqrt(hidden) in the dtype, RoPE from the stack's rotary module,
grouped-query K/V heads repeated, scores scaled after the product and soft-capped, padding and a sliding layer's
window at the dtype's minimum, RMS norms ``(1 + w)`` in float32 before and after each sub-layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from seqgen_cli.models.attention import rotate_half, soft_cap
from seqgen_cli.models.fuse import concat_linears, fuse_linears
from seqgen_cli.models.layers import DecoderFacts, MergedLayer, Seq2Seq, Seq2SeqLayer
from seqgen_cli.models.linear_maps import Linear, linear
from seqgen_cli.models.tree import ACTIVATIONS, EncoderOutput, OwnSeq2Seq, embedding


def t5gemma_layer(layer: nn.Module, int8: bool) -> Seq2SeqLayer:
    """A T5Gemma decoder layer (Gemma 2's with cross-attention: ``self_attn``, ``cross_attn``, ``mlp``; an RMSNorm
    before and after each): grouped-query K/V heads in both attentions, soft-capped scores, a gated MLP."""
    sa, ca, mlp = layer.self_attn, layer.cross_attn, layer.mlp

    def lin(module: nn.Module) -> Linear:
        return linear(module.weight, module.bias, int8)

    fuse = concat_linears if int8 else fuse_linears  # int8: the fused float32 weight only while copied
    qkv_w, qkv_b = fuse([sa.q_proj, sa.k_proj, sa.v_proj])  # [(H + 2 Hkv) d, D]
    ckv_w, ckv_b = fuse([ca.k_proj, ca.v_proj])  # [2 Hkv d, D_enc]
    maps = {
        "qkv": linear(qkv_w, qkv_b, int8),
        "o": lin(sa.o_proj),
        "cq": lin(ca.q_proj),
        "ckv": linear(ckv_w, ckv_b, int8),
        "co": lin(ca.o_proj),
        "gate": lin(mlp.gate_proj),
        "up": lin(mlp.up_proj),
        "down": lin(mlp.down_proj),
    }
    gate, up, down, act = maps["gate"], maps["up"], maps["down"], mlp.act_fn
    return Seq2SeqLayer(
        ln_self=layer.pre_self_attn_layernorm,
        qkv_w=None if int8 else qkv_w,
        qkv=maps["qkv"],
        o=maps["o"],
        scale=float(sa.scaling),
        ln_cross=layer.pre_cross_attn_layernorm,
        cq=maps["cq"],
        ckv_w=None if int8 else ckv_w,
        ckv=maps["ckv"],
        co=maps["co"],
        ln_ff=layer.pre_feedforward_layernorm,
        ff=lambda x: down(act(gate(x)) * up(x)),
        maps=maps,
        ln_self_out=layer.post_self_attn_layernorm,
        ln_cross_out=layer.post_cross_attn_layernorm,
        ln_ff_out=layer.post_feedforward_layernorm,
        softcap=sa.attn_logit_softcapping,
    )


def t5gemma2_layer(layer: nn.Module, int8: bool) -> MergedLayer:
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
    maps = {
        "qkv": linear(qkv_w, qkv_b, int8),
        "o": lin(sa.o_proj),
        "ckv": linear(qkv_w[q_rows:], kv_b, int8),
        "gate": lin(mlp.gate_proj),
        "up": lin(mlp.up_proj),
        "down": lin(mlp.down_proj),
    }
    gate, up, down, act = maps["gate"], maps["up"], maps["down"], mlp.act_fn
    return MergedLayer(
        ln_self=layer.pre_self_attn_layernorm,
        qkv_w=None if int8 else qkv_w,
        qkv=maps["qkv"],
        o=maps["o"],
        scale=float(sa.scaling),
        ln_cross=None,
        cq=None,
        ckv_w=None,
        ckv=maps["ckv"],
        co=None,
        ln_ff=layer.pre_feedforward_layernorm,
        ff=lambda x: down(act(gate(x)) * up(x)),
        maps=maps,
        ln_self_out=layer.post_self_attn_layernorm,
        ln_ff_out=layer.post_feedforward_layernorm,
        softcap=sa.attn_logit_softcapping,
        q_norm=sa.q_norm,
        k_norm=sa.k_norm,
        layer_type=sa.layer_type or "full_attention",
    )


def t5gemma_facts(model: Any) -> DecoderFacts:
    """The decoder's stack config (its grouped-query heads, the logits' soft-cap), its ``layers``, ``norm`` and
    ``rotary_emb``; T5Gemma's embeddings times sqrt(hidden), as transformers writes it: a tensor of the model's
    dtype."""
    dec = model.get_decoder()
    weight = dec.embed_tokens.weight
    scale = torch.tensor(weight.shape[1] ** 0.5, dtype=weight.dtype, device=weight.device)
    return replace(_stack_facts(dec), embed_scale=scale)


def t5gemma2_facts(model: Any) -> DecoderFacts:
    """T5Gemma 2's: the embedding module's own scale, and its end-of-image token embedded as its own vector."""
    embed = model.get_decoder().embed_tokens
    facts = _stack_facts(model.get_decoder())
    return replace(facts, embed_scale=embed.embed_scale, eoi=embed.eoi_token_index, eoi_embedding=embed.eoi_embedding)


def _stack_facts(dec: nn.Module) -> DecoderFacts:
    """What both T5Gemma decoders name alike: the stack's config, ``embed_tokens``, ``layers``, ``norm``,
    ``rotary_emb``."""
    dcfg = dec.config
    return DecoderFacts(
        int(dcfg.num_attention_heads),
        int(dcfg.num_key_value_heads),
        int(dcfg.head_dim),
        embed=dec.embed_tokens.weight,
        layers=dec.layers,
        config=dcfg,
        ln_final=dec.norm,
        rotary=dec.rotary_emb,
        final_softcap=dcfg.final_logit_softcapping,
    )


_GEMMA = dict(pre_norm=True, source_limit=False)
FAMILIES: dict[str, Seq2Seq] = {
    "t5gemma": Seq2Seq(t5gemma_layer, position_kind="rotary", facts=t5gemma_facts, scale_scores=True, **_GEMMA),
    "t5gemma2": Seq2Seq(t5gemma2_layer, position_kind="rotary per layer type", facts=t5gemma2_facts, **_GEMMA),
}


class Norm(nn.Module):
    """``T5GemmaRMSNorm``: RMS in float32, times ``1 + weight`` in float32, back to the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Rotary(nn.Module):
    """``T5GemmaRotaryEmbedding`` for the default RoPE: ``inv_freq`` made by :meth:`make` (not a checkpoint weight);
    ``(x, position_ids [B, Q]) -> cos, sin [B, Q, d]`` in ``x``'s dtype."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.base, self.dim = float(cfg.rope_parameters["rope_theta"]), int(cfg.head_dim)
        self.register_buffer("inv_freq", torch.empty(self.dim // 2), persistent=False)

    def make(self) -> None:
        """The inverse frequencies, as transformers computes them."""
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim
        self.inv_freq = 1.0 / (self.base**exponent)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # [B, Q, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, Q, d]
        return (emb.cos() * 1.0).to(x.dtype), (emb.sin() * 1.0).to(x.dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' ``repeat_kv``: [B, Hkv, S, d] -> [B, Hkv * groups, S, d]."""
    b, hkv, s, d = x.shape
    if groups == 1:
        return x
    return x[:, :, None, :, :].expand(b, hkv, groups, s, d).reshape(b, hkv * groups, s, d)


class Attention(nn.Module):
    """``T5GemmaSelfAttention`` / ``T5GemmaCrossAttention``'s projections and settings (the fast decoder reads
    them); :meth:`forward` is the encoder's self-attention."""

    def __init__(self, cfg: Any, source_dim: int, layer_type: str | None) -> None:
        super().__init__()
        h, hkv, d, dim, bias = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.attention_bias
        self.head_dim, self.num_key_value_groups = d, h // hkv
        self.scaling, self.attn_logit_softcapping = cfg.query_pre_attn_scalar**-0.5, cfg.attn_logit_softcapping
        self.layer_type = layer_type
        self.q_proj = nn.Linear(dim, h * d, bias=bias)
        self.k_proj, self.v_proj = nn.Linear(source_dim, hkv * d, bias=bias), nn.Linear(source_dim, hkv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, dim, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, S, D], ``cos``/``sin`` [1, S, d], ``mask`` additive [B, 1, S, S] or ``None`` -> [B, S, D]."""
        b, s, _ = x.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # [B, S, H*d] -> [B, H, S, d]
        k = self.k_proj(x).view(shape).transpose(1, 2)  # [B, Hkv, S, d]
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, S, d]
        q, k = (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
        k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)  # [B, H, S, d]
        scores = soft_cap(torch.matmul(q, k.transpose(2, 3)) * self.scaling, self.attn_logit_softcapping)
        if mask is not None:
            scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, H, S, S]
        out = torch.matmul(probs, v).transpose(1, 2).contiguous()  # [B, S, H, d]
        return self.o_proj(out.reshape(b, s, -1).contiguous())


class MLP(nn.Module):
    """``T5GemmaMLP``: ``down(act(gate x) * up x)``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim, ffn = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)
        self.act_fn = ACTIVATIONS[cfg.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """``T5GemmaEncoderLayer`` / ``T5GemmaDecoderLayer`` (with ``cross_attn``): an RMSNorm before and after each
    sub-layer; :meth:`forward` is the encoder's."""

    def __init__(self, cfg: Any, i: int, cross: int | None) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, dim, cfg.layer_types[i])
        self.pre_self_attn_layernorm, self.post_self_attn_layernorm = Norm(dim, eps), Norm(dim, eps)
        self.mlp = MLP(cfg)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = Norm(dim, eps), Norm(dim, eps)
        if cross is not None:
            self.cross_attn = Attention(cfg, cross, None)
            self.pre_cross_attn_layernorm, self.post_cross_attn_layernorm = Norm(dim, eps), Norm(dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.post_self_attn_layernorm(self.self_attn(self.pre_self_attn_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Stack(nn.Module):
    """``T5GemmaEncoder`` / ``T5GemmaDecoder``: ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``, its own
    ``config``; :meth:`forward` is the encoder's."""

    def __init__(self, cfg: Any, cross: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg, i, cross) for i in range(cfg.num_hidden_layers))
        self.rotary_emb = Rotary(cfg)

    def masks(self, attention_mask: torch.Tensor | None, s: int, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
        """Each layer kind's additive mask [B, 1, S, S] as transformers' eager masks make it (0, or the dtype's
        minimum: a padded key; in a sliding layer a key more than ``sliding_window`` positions either side), or
        ``None`` where nothing is masked."""
        window = self.config.sliding_window
        padded = attention_mask is not None and not bool(attention_mask.all())
        pos = torch.arange(s, device=self.embed_tokens.weight.device)
        out: dict[str, torch.Tensor | None] = {}
        for kind, near in (("full_attention", None), ("sliding_attention", (pos[:, None] - pos).abs() <= window)):
            if not padded and (near is None or s < window):
                out[kind] = None
                continue
            keep = torch.ones((1, 1, s, s), dtype=torch.bool, device=pos.device) if near is None else near[None, None]
            if padded:
                keep = keep & attention_mask.bool()[:, None, None, :]  # [B, 1, S, S]
            out[kind] = torch.where(keep, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)
        return out

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_dict: bool = True
    ) -> EncoderOutput:
        """The encoder: [B, S] ids and mask -> ``last_hidden_state`` [B, S, D]."""
        s = input_ids.shape[1]
        x = self.embed_tokens(input_ids)  # [B, S, D]
        if attention_mask is None:  # as transformers: the padding is where the pad token is
            attention_mask = (input_ids != self.config.pad_token_id).long()
        masks = self.masks(attention_mask, s, x.dtype)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        cos, sin = self.rotary_emb(x, torch.arange(s, device=x.device)[None])  # [1, S, d]
        for layer in self.layers:
            x = layer(x, cos, sin, masks[layer.self_attn.layer_type])
        return EncoderOutput(self.norm(x))


class LMHead(nn.Module):
    """``T5GemmaLMHead``: ``out_proj``."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.out_proj = nn.Linear(dim, vocab, bias=False)


class Tree(OwnSeq2Seq):
    """A T5Gemma checkpoint: ``model.encoder`` / ``model.decoder`` (each over its own config), ``lm_head.out_proj``."""

    ATTENTION = "eager"  # transformers' only attention for T5Gemma (soft-capping)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = nn.Module()
        self.model.encoder = Stack(config.encoder)
        self.model.decoder = Stack(config.decoder, cross=config.encoder.hidden_size)
        self.lm_head = LMHead(config.decoder.hidden_size, config.decoder.vocab_size)

    def ties(self) -> dict[str, str]:
        """transformers' tied weights (target -> source): the head is the decoder's embedding where tied."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return {}
        return {"lm_head.out_proj.weight": "model.decoder.embed_tokens.weight"}

    def finish(self) -> None:
        for stack in (self.model.encoder, self.model.decoder):
            stack.rotary_emb.make()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head.out_proj

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.out_proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.out_proj.weight.device


TREES = {"t5gemma": Tree}
