"""The T5 family: ``t5`` (T5 v1.0, v1.1, Flan-T5), ``mt5``, ``longt5``, ``umt5``.

Its decoder block (``layer[0].SelfAttention``, ``layer[1].EncDecAttention``, ``layer[2]`` feed-forward;
:func:`t5_block`) on the shared encoder-decoder decoder: pre-norm, unscaled attention, the relative position bias of
the first block (UMT5: of every block), ``final_layer_norm``, float16's overflow guard after each sub-layer. LongT5's
encoder (local / transient-global attention) is the model's own.

And its own module tree (``Tree``, for ``own_model.load``: T5, mT5, UMT5): transformers' names
(``encoder.block.0.layer.0.SelfAttention.q``), the encoder's forward as transformers' (unscaled sdpa over the relative
position bias, the first block's or, UMT5, each block's own; padding masked with the dtype's minimum; RMS norms in
float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from seqgen_cli.models.fuse import concat_linears, fuse_linears
from seqgen_cli.models.layers import DecoderFacts, Seq2Seq, Seq2SeqLayer
from seqgen_cli.models.linear_maps import Linear, linear
from seqgen_cli.models.tree import ACTIVATIONS, EncoderOutput, OwnSeq2Seq, embedding


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
    maps = {
        "qkv": linear(qkv_w, None, int8),
        "o": linear(att.o.weight, None, int8),
        "cq": linear(cross.q.weight, None, int8),
        "ckv": linear(ckv_w, ckv_b, int8),
        "co": linear(cross.o.weight, None, int8),
    }
    return Seq2SeqLayer(
        ln_self=sa.layer_norm,
        qkv_w=None if int8 else qkv_w,
        qkv=maps["qkv"],
        o=maps["o"],
        scale=1.0,
        ln_cross=ca.layer_norm,
        cq=maps["cq"],
        ckv_w=None if int8 else ckv_w,
        ckv=maps["ckv"],
        co=maps["co"],
        ln_ff=ff.layer_norm,
        ff=_t5_feed_forward(ff.DenseReluDense, maps, int8),
        maps=maps,
    )


@dataclass(frozen=True)
class T5Bias:
    """The decoder's relative position bias (``layers.RelativeBias``): the first block's self-attention's, shared by
    every block (UMT5: every block's own), as ``T5Attention.compute_bias`` computes it."""

    owners: tuple[nn.Module, ...]  # the self-attentions that own a bias (``has_relative_attention_bias``)

    @property
    def layers(self) -> int:
        return len(self.owners)

    def __call__(self, t: int, device: torch.device) -> torch.Tensor:
        """[L', H, T, T]: each owner's [1, H, T, T]."""
        return torch.cat([owner.compute_bias(t, t, device=device) for owner in self.owners])


def t5_facts(model: Any) -> DecoderFacts:
    """The decoder's heads (its own config copy; seqgen's tree: the model's), its blocks (``block``), its relative
    bias, ``final_layer_norm``, and T5 v1.0's scaled head input (``scale_decoder_outputs``: its tied LM head reads
    the hidden states times ``d_model ** -0.5``)."""
    cfg, dec = model.config, model.get_decoder()
    dcfg = getattr(dec, "config", None) or cfg
    scaled = getattr(cfg, "scale_decoder_outputs", False)
    attentions = [block.layer[0].SelfAttention for block in dec.block]
    owners = tuple(att for att in attentions if getattr(att, "has_relative_attention_bias", False))
    return DecoderFacts(
        int(dcfg.num_heads),
        int(dcfg.num_heads),
        int(dcfg.d_kv),
        embed=dec.embed_tokens.weight,
        layers=dec.block,
        config=dcfg,
        ln_final=dec.final_layer_norm,
        relative_bias=T5Bias(owners) if owners else None,
        out_scale=float(cfg.d_model) ** -0.5 if scaled else None,
    )


# relative positions: T5's ``n_positions`` limits no input (LongT5's is kept as the limit it always was)
_T5 = dict(reader=t5_block, facts=t5_facts, pre_norm=True, clamp_fp16=True)
FAMILIES: dict[str, Seq2Seq] = {
    "t5": Seq2Seq(position_kind="relative", source_limit=False, **_T5),  # v1.0, v1.1 and Flan-T5
    "mt5": Seq2Seq(position_kind="relative", source_limit=False, **_T5),
    "longt5": Seq2Seq(position_kind="relative", **_T5),  # the encoder's local / transient-global attention: its own
    "umt5": Seq2Seq(position_kind="relative per layer", **_T5),
}


class Norm(nn.Module):
    """``T5LayerNorm``: RMS over the last dimension in float32, no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class Attention(nn.Module):
    """``T5Attention``'s projections; the first block's self-attention owns the relative position bias
    (:meth:`compute_bias`, which the fast decoder reads too); :meth:`forward` is the encoder's self-attention."""

    def __init__(self, cfg: Any, relative: bool, decoder: bool) -> None:
        super().__init__()
        inner, dim = cfg.num_heads * cfg.d_kv, cfg.d_model
        self.q, self.k, self.v = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, dim, bias=False)
        self.key_value_proj_dim, self.is_decoder, self.has_relative_attention_bias = cfg.d_kv, decoder, relative
        self.buckets, self.max_distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        if relative:
            self.relative_attention_bias = embedding(self.buckets, cfg.num_heads)

    def compute_bias(self, query_length: int, key_length: int, device: torch.device | None = None) -> torch.Tensor:
        """The bias of ``query_length`` query against ``key_length`` key positions: [1, H, Q, K]."""
        device = device or self.relative_attention_bias.weight.device
        context = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        bucket = position_bucket(memory - context, not self.is_decoder, self.buckets, self.max_distance)  # [Q, K]
        return self.relative_attention_bias(bucket).permute([2, 0, 1]).unsqueeze(0)  # [Q, K, H] -> [1, H, Q, K]

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x`` [B, S, D], ``bias`` [B | 1, H, S, S] (position bias, padding at the dtype's minimum) -> [B, S, D]."""
        b, s, _ = x.shape
        shape = (b, s, -1, self.key_value_proj_dim)
        q = self.q(x).view(shape).transpose(1, 2)  # [B, S, H*d] -> [B, H, S, d]
        k = self.k(x).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.0, scale=1.0)
        out = out.transpose(1, 2).contiguous()  # [B, H, S, d] -> [B, S, H, d]
        return self.o(out.reshape(b, s, -1).contiguous())  # [B, S, D]


def position_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """``T5Attention._relative_position_bucket``: half the buckets exact distances, half logarithmic up to
    ``max_distance`` (each side's, bidirectional)."""
    out = 0
    if bidirectional:
        buckets //= 2
        out += (relative > 0).to(torch.long) * buckets
        relative = torch.abs(relative)
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    exact = buckets // 2
    large = exact + (
        torch.log(relative.float() / exact) / math.log(max_distance / exact) * (buckets - exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, buckets - 1))
    return out + torch.where(relative < exact, relative, large)


class FeedForward(nn.Module):
    """``T5DenseActDense`` (``wi``) or ``T5DenseGatedActDense`` (``wi_0``, ``wi_1``), then ``wo``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gated, self.act = cfg.is_gated_act, ACTIVATIONS[cfg.dense_act_fn]
        if self.gated:
            self.wi_0, self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False), nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        else:
            self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        if isinstance(w := self.wo.weight, torch.Tensor) and w.dtype != torch.int8:  # int8: a method, no cast
            h = h.to(w.dtype)
        return self.wo(h)


class Sublayer(nn.Module):
    """One of a block's ``layer`` entries: a norm and its attention (``SelfAttention`` / ``EncDecAttention``) or
    feed-forward (``DenseReluDense``)."""

    def __init__(self, cfg: Any, name: str, module: nn.Module) -> None:
        super().__init__()
        self.layer_norm = Norm(cfg.d_model, cfg.layer_norm_epsilon)
        setattr(self, name, module)


class Block(nn.Module):
    """``T5Block``: ``layer`` = self-attention, (decoder: cross-attention,) feed-forward."""

    def __init__(self, cfg: Any, relative: bool, decoder: bool) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Sublayer(cfg, "SelfAttention", Attention(cfg, relative, decoder))])
        if decoder:
            self.layer.append(Sublayer(cfg, "EncDecAttention", Attention(cfg, False, decoder)))
        self.layer.append(Sublayer(cfg, "DenseReluDense", FeedForward(cfg)))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The encoder's block: [B, S, D] -> [B, S, D], each sub-layer's norm before it, its residual after."""
        attn, ff = self.layer[0], self.layer[-1]
        x = x + attn.SelfAttention(attn.layer_norm(x), bias)
        return x + ff.DenseReluDense(ff.layer_norm(x))


class Stack(nn.Module):
    """``T5Stack``: ``embed_tokens``, ``block``, ``final_layer_norm``; :meth:`forward` is the encoder's."""

    def __init__(self, cfg: Any, decoder: bool) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.d_model)
        layers = cfg.num_decoder_layers if decoder else cfg.num_layers
        every = cfg.model_type == "umt5"  # a relative position bias in every block, not only the first
        self.block = nn.ModuleList(Block(cfg, every or i == 0, decoder) for i in range(layers))
        self.final_layer_norm = Norm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_dict: bool = True
    ) -> EncoderOutput:
        """The encoder: [B, S] ids and mask -> ``last_hidden_state`` [B, S, D]."""
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids)  # [B, S, D]
        keep = None  # sdpa's bias mask, as transformers builds it: the bias, the dtype's minimum at padding
        if attention_mask is not None and not bool(attention_mask.all()):
            keep = attention_mask.bool()[:, None, None, :].expand(b, 1, s, s)
        bias = None
        for block in self.block:
            attn = block.layer[0].SelfAttention
            if attn.has_relative_attention_bias:  # the first block's, kept for the rest (UMT5: each block's)
                bias = attn.compute_bias(s, s, device=x.device)  # [1, H, S, S]
                bias = (bias if keep is None else torch.where(keep, bias, torch.finfo(x.dtype).min)).contiguous()
            x = block(x, bias)
        return EncoderOutput(self.final_layer_norm(x))


class Tree(OwnSeq2Seq):
    """A T5 / mT5 / UMT5 checkpoint: ``shared``, ``encoder`` / ``decoder``, ``lm_head``."""

    ENCODER, DECODER = "encoder", "decoder"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.shared = embedding(config.vocab_size, config.d_model)
        self.encoder, self.decoder = Stack(config, decoder=False), Stack(config, decoder=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def ties(self) -> dict[str, str]:
        """transformers' tied weights (target -> source), none without ``tie_word_embeddings``."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return {}
        return dict.fromkeys(("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"), "shared.weight")

    def complete(self, tensors: dict[str, torch.Tensor]) -> None:
        """transformers ignores a cross-attention bias some checkpoints hold."""
        tensors.pop("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight", None)


TREES = dict.fromkeys(("t5", "mt5", "umt5"), Tree)
