"""The BART family: BART, mBART, Marian, Pegasus, M2M-100 / NLLB, LED, Pegasus-X.

Its decoder layer (``self_attn``, ``encoder_attn``, ``fc1``/``fc2``; :func:`bart_layer`) on the shared
encoder-decoder decoder, each model type a row of :data:`FAMILIES` (its norms: :data:`NORMS`):

=========  ====  ==============================================  =====================  ===========
family     norm  positions                                       embedding norm         final norm
=========  ====  ==============================================  =====================  ===========
bart, led  post  table (learned; BART's offset 2)                layernorm_embedding    -
mbart      pre   table (learned, offset 2)                       layernorm_embedding    layer_norm
marian     post  table (sinusoidal)                              -                      -
pegasus    pre   table (sinusoidal)                              -                      layer_norm
m2m_100    pre   table (sinusoidal; a pad token takes row pad)   -                      layer_norm
pegasus_x  pre   computed sinusoid (tabled once)                 -                      layer_norm
=========  ====  ==============================================  =====================  ===========

And its own module tree (``Tree``, for ``own_model.load``: BART, mBART, Marian, Pegasus, M2M-100 / NLLB):
transformers' names, the rows' positions and :data:`NORMS`' norms, the encoder's forward as transformers' (sdpa
with its boolean padding mask).
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
from seqgen_cli.models.layers import PositionKind as Kind
from seqgen_cli.models.linear_maps import Linear, linear
from seqgen_cli.models.tree import ACTIVATIONS, EncoderOutput, OwnSeq2Seq, embedding


def bart_layer(layer: nn.Module, int8: bool) -> Seq2SeqLayer:
    """A BART-named decoder layer (``self_attn``, ``encoder_attn``, ``fc1``/``fc2``; BART, mBART, Marian, Pegasus,
    M2M-100 / NLLB, LED, Pegasus-X)."""
    sa, ca = layer.self_attn, layer.encoder_attn

    def lin(module: nn.Module) -> Linear:
        return linear(module.weight, module.bias, int8)

    fuse = concat_linears if int8 else fuse_linears  # int8: the fused float32 weight only while copied
    qkv_w, qkv_b = fuse([sa.q_proj, sa.k_proj, sa.v_proj])  # [3D, D], [3D]
    ckv_w, ckv_b = fuse([ca.k_proj, ca.v_proj])  # [2D, D], [2D]
    maps = {
        "qkv": linear(qkv_w, qkv_b, int8),
        "o": lin(sa.out_proj),
        "cq": lin(ca.q_proj),
        "ckv": linear(ckv_w, ckv_b, int8),
        "co": lin(ca.out_proj),
        "fc1": lin(layer.fc1),
        "fc2": lin(layer.fc2),
    }
    fc1, fc2, act = maps["fc1"], maps["fc2"], layer.activation_fn
    return Seq2SeqLayer(
        ln_self=layer.self_attn_layer_norm,
        qkv_w=None if int8 else qkv_w,
        qkv=maps["qkv"],
        o=maps["o"],
        scale=float(sa.scaling),
        ln_cross=layer.encoder_attn_layer_norm,
        cq=maps["cq"],
        ckv_w=None if int8 else ckv_w,
        ckv=maps["ckv"],
        co=maps["co"],
        ln_ff=layer.final_layer_norm,
        ff=lambda x: fc2(act(fc1(x))),
        maps=maps,
    )


@dataclass
class BartPositions:
    """The decoder's absolute position embeddings (``layers.PositionTable``) by the row's ``positions``: a table
    (``embed_positions.weight``), M2M-100's sinusoids its module grows on demand (``weights``, as in
    ``generate()``), or Pegasus-X's computed sinusoid, tabled once per growth (its rows are what the module computes
    for those positions)."""

    kind: Kind  # the row's ``positions``
    module: nn.Module  # the decoder's ``embed_positions``
    dtype: torch.dtype
    device: torch.device
    held: torch.Tensor | None = None  # Pegasus-X's table so far

    def __call__(self, rows: int) -> torch.Tensor:
        """[n, D], ``n >= rows`` (where the table grows)."""
        if self.kind == "computed":  # Pegasus-X: reads only the shape, dtype and device of what it is given
            if self.held is None or self.held.shape[0] < rows:
                zeros = torch.zeros((1, rows, 1), dtype=self.dtype, device=self.device)  # [1, rows, 1]
                self.held = self.module(zeros)[0]  # [rows, D]
            return self.held
        if self.kind == "padded table":  # M2M-100, NLLB: ask for the rows up to ``rows - 1``: it makes them
            if self.module.weights.shape[0] < rows:
                pad = self.module.padding_idx
                ids = torch.full((1, rows - pad - 1), pad + 1, device=self.device)  # [1, rows - pad - 1]
                self.module(ids)
            return self.module.weights
        return self.module.weight


def bart_facts(model: Any) -> DecoderFacts:
    """The decoder's heads, its embeddings' scale (``scale_embedding``: on the embedding module, or on the decoder in
    older layouts), its norms (:data:`NORMS`), its position table and that table's offset (M2M-100: the pad row),
    ``final_logits_bias``."""
    cfg, dec = model.config, model.get_decoder()
    heads = int(cfg.decoder_attention_heads)
    weight = dec.embed_tokens.weight  # [V_in, D]
    scale = getattr(dec.embed_tokens, "embed_scale", None) or getattr(dec, "embed_scale", 1.0)
    pos = dec.embed_positions
    pad = pos.padding_idx if cfg.model_type == "m2m_100" else None
    first, last = (getattr(dec, name) if name else None for name in NORMS[cfg.model_type])
    return DecoderFacts(
        heads,
        heads,
        weight.shape[1] // heads,
        embed=weight,
        layers=dec.layers,
        config=getattr(dec, "config", None) or cfg,  # own trees: the model's
        ln_embed=first,
        ln_final=last,
        position_table=BartPositions(FAMILIES[cfg.model_type].position_kind, pos, weight.dtype, weight.device),
        embed_scale=None if scale == 1.0 else scale,
        logits_bias=getattr(model, "final_logits_bias", None),
        pad_position=pad,
        pos_offset=pad + 1 if pad is not None else int(getattr(pos, "offset", 0)),
    )


_TABLE = "max_position_embeddings"  # the decoder's position table: learned, or Marian's and Pegasus's sinusoids
_BART = dict(reader=bart_layer, facts=bart_facts)
FAMILIES: dict[str, Seq2Seq] = {
    "bart": Seq2Seq(pre_norm=False, position_kind="table", table=_TABLE, **_BART),
    "mbart": Seq2Seq(pre_norm=True, position_kind="table", table=_TABLE, **_BART),
    "marian": Seq2Seq(pre_norm=False, position_kind="table", table=_TABLE, **_BART),
    "pegasus": Seq2Seq(pre_norm=True, position_kind="table", table=_TABLE, **_BART),
    "m2m_100": Seq2Seq(pre_norm=True, position_kind="padded table", **_BART),
    "led": Seq2Seq(pre_norm=False, position_kind="table", table="max_decoder_position_embeddings", **_BART),
    "pegasus_x": Seq2Seq(pre_norm=True, position_kind="computed", **_BART),
}
# each model type's norms by transformers' attribute names: after the embeddings, after the last layer
NORMS: dict[str, tuple[str | None, str | None]] = {
    "bart": ("layernorm_embedding", None),
    "mbart": ("layernorm_embedding", "layer_norm"),
    "marian": (None, None),
    "pegasus": (None, "layer_norm"),
    "m2m_100": (None, "layer_norm"),
    "led": ("layernorm_embedding", None),
    "pegasus_x": (None, "layer_norm"),
}
SINUSOIDS = ("marian", "pegasus")  # position tables made from a formula where the checkpoint has none
# transformers' class of those tables, made faster while transformers loads the model (``loading.fast_sinusoids``)
SINUSOID_CLASSES = {"marian": "MarianSinusoidalPositionalEmbedding", "pegasus": "PegasusSinusoidalPositionalEmbedding"}




class Attention(nn.Module):
    """BART-named attention projections; :meth:`forward` is the encoder's self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.head_dim = dim // heads
        self.scaling = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, S, D], ``mask`` [B, 1, S, S] bool (True: attend) or ``None`` -> [B, S, D]."""
        b, s, _ = x.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # [B, S, D] -> [B, H, S, d]
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling)
        out = out.transpose(1, 2).contiguous()  # [B, H, S, d] -> [B, S, H, d]
        return self.out_proj(out.reshape(b, s, -1).contiguous())  # [B, S, D]


class Layer(nn.Module):
    """An encoder layer (:meth:`forward`) or, with ``cross``, a decoder layer (read by ``families.bart_layer``)."""

    def __init__(self, dim: int, heads: int, ffn: int, act: str, pre_norm: bool, cross: bool = False) -> None:
        super().__init__()
        self.self_attn, self.self_attn_layer_norm = Attention(dim, heads), nn.LayerNorm(dim)
        if cross:
            self.encoder_attn, self.encoder_attn_layer_norm = Attention(dim, heads), nn.LayerNorm(dim)
        self.fc1, self.fc2, self.final_layer_norm = nn.Linear(dim, ffn), nn.Linear(ffn, dim), nn.LayerNorm(dim)
        self.activation_fn, self.pre_norm = ACTIVATIONS[act], pre_norm

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[B, S, D] -> [B, S, D]: attention, then the feed-forward, each norm before (mBART, Pegasus, M2M-100)
        or after its residual sum (BART, Marian)."""
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
            return x + self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.self_attn(x, mask))
        return self.final_layer_norm(x + self.fc2(self.activation_fn(self.fc1(x))))


class Positions(nn.Module):
    """A stack's absolute positions: ``table`` (BART, mBART: learned, ``offset`` 2; Marian, Pegasus: sinusoids
    from 0) as ``weight``, or M2M-100's sinusoids as ``weights`` with a zero row at ``padding_idx`` and positions
    counted over non-padding tokens from ``padding_idx + 1``."""

    def __init__(self, rows: int, dim: int, offset: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.offset, self.padding_idx = offset, padding_idx
        if padding_idx is None:
            self.weight = nn.Parameter(torch.empty(rows + offset, dim), requires_grad=False)
        else:  # not in checkpoints: made here, as M2M100SinusoidalPositionalEmbedding.get_embedding makes it
            self.register_buffer("weights", padded_sinusoids(rows + offset, dim, padding_idx), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] ids -> the positions to add: [B, S, D] (padded) or [S, D]."""
        if self.padding_idx is None:
            at = torch.arange(input_ids.shape[1], device=input_ids.device) + self.offset  # [S]
            return self.weight.index_select(0, at)
        mask = input_ids.ne(self.padding_idx).int()  # [B, S]
        at = torch.cumsum(mask, dim=1).type_as(mask) * mask + self.padding_idx  # pads keep padding_idx
        b, s = input_ids.shape
        if self.padding_idx + 1 + s > self.weights.shape[0]:  # grows on demand, as transformers' module does
            rows = self.padding_idx + 1 + s + self.offset
            self.weights = padded_sinusoids(rows, self.weights.shape[1], self.padding_idx).to(self.weights)
        return self.weights.index_select(0, at.long().view(-1)).view(b, s, -1)


def padded_sinusoids(rows: int, dim: int, padding_idx: int) -> torch.Tensor:
    """M2M-100's (fairseq's) sinusoids: [rows, dim], sin | cos halves, zeros at ``padding_idx``."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)  # [D/2]
    angle = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)  # [rows, D/2]
    table = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).view(rows, -1)  # [rows, D (-1)]
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    table[padding_idx, :] = 0
    return table


class Stack(nn.Module):
    """An encoder (:meth:`forward`) or a decoder (its parts, read by the fast backend)."""

    def __init__(self, cfg: Any, description: Seq2Seq, decoder: bool) -> None:
        super().__init__()
        side = "decoder" if decoder else "encoder"
        dim, heads = cfg.d_model, getattr(cfg, f"{side}_attention_heads")
        ffn, count = getattr(cfg, f"{side}_ffn_dim"), getattr(cfg, f"{side}_layers")
        self.embed_tokens = embedding(getattr(cfg, f"{side}_vocab_size", None) or cfg.vocab_size, dim)
        self.embed_scale = math.sqrt(dim) if cfg.scale_embedding else 1.0
        padded = description.position_kind == "padded table"
        offset = 2 if cfg.model_type in ("bart", "mbart") or padded else 0
        self.embed_positions = Positions(cfg.max_position_embeddings, dim, offset, cfg.pad_token_id if padded else None)
        act, pre = cfg.activation_function, description.pre_norm
        self.layers = nn.ModuleList(Layer(dim, heads, ffn, act, pre, cross=decoder) for _ in range(count))
        self.norms = NORMS[cfg.model_type]  # by transformers' attribute names
        for name in self.norms:
            if name:
                setattr(self, name, nn.LayerNorm(dim))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_dict: bool = True
    ) -> EncoderOutput:
        """The encoder: [B, S] ids and mask -> ``last_hidden_state`` [B, S, D]."""
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids) * self.embed_scale  # [B, S, D]
        x = x + self.embed_positions(input_ids)
        first, last = (getattr(self, name) if name else None for name in self.norms)
        if first is not None:
            x = first(x)
        mask = None  # transformers' sdpa mask: none without padding, else [B, 1, S, S] True where a key is a token
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.bool()[:, None, None, :].expand(b, 1, s, s)
        for layer in self.layers:
            x = layer(x, mask)
        if last is not None:
            x = last(x)
        return EncoderOutput(x)


class Tree(OwnSeq2Seq):
    """A BART-family checkpoint: ``model.shared`` (where encoder and decoder share it), ``model.encoder`` /
    ``model.decoder``, ``lm_head``, ``final_logits_bias`` (not M2M-100)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        description = FAMILIES[config.model_type]
        assert isinstance(description, Seq2Seq)
        dim = config.d_model
        self.model = nn.Module()
        if sharing(config):
            self.model.shared = embedding(config.vocab_size, dim)
        self.model.encoder = Stack(config, description, decoder=False)
        self.model.decoder = Stack(config, description, decoder=True)
        vocab = self.model.decoder.embed_tokens.num_embeddings
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if config.model_type != "m2m_100":
            self.register_buffer("final_logits_bias", torch.zeros(1, vocab))

    def ties(self) -> dict[str, str]:
        """transformers' tied weights (target -> source), none without ``tie_word_embeddings``."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return {}
        if not sharing(self.config):
            return {"lm_head.weight": "model.decoder.embed_tokens.weight"}
        return {
            "lm_head.weight": "model.shared.weight",
            "model.encoder.embed_tokens.weight": "model.shared.weight",
            "model.decoder.embed_tokens.weight": "model.shared.weight",
        }

    def complete(self, tensors: dict[str, torch.Tensor]) -> None:
        """A zero ``final_logits_bias`` and Marian's and Pegasus's sinusoids where the checkpoint has none."""
        if "final_logits_bias" not in tensors and hasattr(self, "final_logits_bias"):
            tensors["final_logits_bias"] = torch.zeros(1, self.lm_head.out_features)
        for side in ("encoder", "decoder") if self.config.model_type in SINUSOIDS else ():
            key = f"model.{side}.embed_positions.weight"
            if key not in tensors:
                tensors[key] = sinusoids(self.config.max_position_embeddings, self.config.d_model)

    def finish(self) -> None:
        """M2M-100's sinusoids, made on the meta device with the tree: made again here, in float32 and then in the
        weights' dtype (transformers makes them in the default dtype ``from_pretrained`` sets)."""
        dtype = self.lm_head.weight.dtype
        for stack in (self.model.encoder, self.model.decoder):
            pos = stack.embed_positions
            if pos.padding_idx is not None:
                pos.weights = padded_sinusoids(pos.weights.shape[0], self.config.d_model, pos.padding_idx).to(dtype)


def sharing(config: Any) -> bool:
    """Whether encoder and decoder take their token embeddings from ``model.shared`` (all but Marian's
    ``share_encoder_decoder_embeddings=False``)."""
    return config.model_type != "marian" or bool(getattr(config, "share_encoder_decoder_embeddings", True))


def sinusoids(rows: int, dim: int) -> torch.Tensor:
    """Marian's and Pegasus's position table, [rows, dim] float32."""
    with torch.device("meta"):
        shape = embedding(rows, dim)  # sinusoid_table reads its shape and dtype
    return sinusoid_table(shape)


def sinusoid_table(embedding: torch.nn.Embedding) -> torch.Tensor:
    """transformers' Marian/Pegasus ``create_weight``, vectorised (also put in its place while transformers loads a
    model: ``loading.fast_sinusoids``): sin of even features in the first half, cos of odd ones in the second;
    [n_pos, dim] in the embedding's dtype."""
    import numpy as np

    n_pos, dim = embedding.weight.shape
    j = np.arange(dim)
    position_enc = np.arange(n_pos)[:, None] / np.power(10000, 2 * (j // 2) / dim)  # [n_pos, dim] float64
    out = torch.empty(n_pos, dim, dtype=embedding.weight.dtype, requires_grad=False)
    sentinel = dim // 2 if dim % 2 == 0 else (dim // 2) + 1
    out[:, 0:sentinel] = torch.FloatTensor(np.sin(position_enc[:, 0::2]))
    out[:, sentinel:] = torch.FloatTensor(np.cos(position_enc[:, 1::2]))
    return out


TREES = dict.fromkeys(("bart", "mbart", "marian", "pegasus", "m2m_100"), Tree)
