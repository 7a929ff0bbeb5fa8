"""Fast backend for the BART family: BART / DistilBART, mBART, Marian, Pegasus.

One architecture with switches, read off the transformers modules (their own weights, no conversion):

=========  =============  ==================  ===========  ===================  ==========  ==========
family     positions      pos. offset         norm         layernorm_embedding  final norm  activation
=========  =============  ==================  ===========  ===================  ==========  ==========
bart       learned        2                   post         yes                  no          gelu
mbart      learned        2                   pre          yes                  yes         gelu
marian     sinusoidal     0                   post         no                   no          swish
pegasus    sinusoidal     0                   pre          no                   yes         relu
=========  =============  ==================  ===========  ===================  ==========  ==========

``scale_embedding`` (sqrt(d_model)) and ``final_logits_bias`` come from the model too. Forced BOS (mBART)
and the pad-token ban (Marian) are logits processors in the engine.

``int8=True`` (``--dtype int8``, CPU): the decoder's linear layers (fused q/k/v, cross k/v, out-projections,
feed-forward) and the LM head (with ``final_logits_bias`` folded into its bias) become dynamic-quantized
int8 copies of the float32 weights (:mod:`seqgen_cli.models.linear_maps`), and the model's own encoder is
quantized in place. Float32 runs the very same ``F.linear`` calls as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from seqgen_cli.models.encoder_decoder import (
    EncoderDecoderBackend,
    EncoderDecoderState,
    cross_attention,
    self_attention,
)
from seqgen_cli.models.fuse import fuse_linears
from seqgen_cli.models.linear_maps import Linear, linear, quantize_linears

PRE_NORM = {"mbart", "pegasus"}


class _Layer:
    """One decoder layer's weights (views of the model's parameters) and its linear maps (float32 over those
    views, or int8 copies)."""

    def __init__(self, layer: nn.Module, int8: bool = False) -> None:
        sa, ca = layer.self_attn, layer.encoder_attn

        def lin(module: nn.Module) -> Linear:
            return linear(module.weight, module.bias, int8)

        self.qkv_w, self.qkv_b = fuse_linears([sa.q_proj, sa.k_proj, sa.v_proj])  # [3D, D], [3D]
        self.qkv = linear(self.qkv_w, self.qkv_b, int8)
        self.o = lin(sa.out_proj)
        self.scale = float(sa.scaling)
        self.ln_self = layer.self_attn_layer_norm
        self.cq = lin(ca.q_proj)
        self.ckv_w, self.ckv_b = fuse_linears([ca.k_proj, ca.v_proj])  # [2D, D], [2D]
        self.ckv = linear(self.ckv_w, self.ckv_b, int8)
        self.co = lin(ca.out_proj)
        self.ln_cross = layer.encoder_attn_layer_norm
        self.fc1, self.fc2, self.act = lin(layer.fc1), lin(layer.fc2), layer.activation_fn
        self.ln_ffn = layer.final_layer_norm


class BartBackend(EncoderDecoderBackend):
    """:class:`~seqgen_cli.search.protocol.ModelBackend` for bart / mbart / marian / pegasus checkpoints."""

    def __init__(self, model: PreTrainedModel, int8: bool = False) -> None:
        cfg = model.config
        dec = model.get_decoder()
        heads = int(cfg.decoder_attention_heads)
        emb = dec.embed_tokens
        layers = [_Layer(layer, int8) for layer in dec.layers]
        super().__init__(model, emb.weight, layers, heads, int(cfg.d_model) // heads)
        self.pre_norm = cfg.model_type in PRE_NORM
        self.embed_scale = getattr(emb, "embed_scale", None) or getattr(dec, "embed_scale", 1.0)
        self.positions = dec.embed_positions.weight  # [P (+ offset), D]
        self.pos_offset = int(getattr(dec.embed_positions, "offset", 0))  # 2 for learned BART positions
        self.max_position_embeddings = self.positions.shape[0] - self.pos_offset
        self.ln_embed = getattr(dec, "layernorm_embedding", None)
        self.ln_final = getattr(dec, "layer_norm", None)
        self.int8 = int8
        bias = getattr(model, "final_logits_bias", None)
        if bias is not None:  # one head with both biases folded in: [V]
            head_b = self.lm_head.bias
            self.lm = linear(self.lm_w, bias.view(-1) if head_b is None else head_b + bias.view(-1), int8)
        elif int8:
            self.lm = linear(self.lm_w, self.lm_head.bias, int8)
        if int8:
            quantize_linears(self.encoder)

    def decode(self, state: EncoderDecoderState, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V]."""
        cache = state.cache
        cache.begin()
        x = F.embedding(tokens, self.embed) * self.embed_scale  # [N, D]
        x = x + self.positions.index_select(0, cache.position + self.pos_offset)  # [1, D]
        if self.ln_embed is not None:
            x = self.ln_embed(x)
        pre = self.pre_norm
        for i, lay in enumerate(self.dec_layers):
            # self-attention over this row's history
            h = lay.ln_self(x) if pre else x
            a = self_attention(lay.qkv(h), cache, i, self.heads, lay.scale)  # [N, D]
            x = x + lay.o(a)
            if not pre:
                x = lay.ln_self(x)
            # cross-attention: the R beams of an input share its keys/values
            h = lay.ln_cross(x) if pre else x
            a = cross_attention(lay.cq(h), state.cross_k[i], state.cross_v[i], state.cross_mask, lay.scale)
            x = x + lay.co(a)
            if not pre:
                x = lay.ln_cross(x)
            # feed-forward
            h = lay.ln_ffn(x) if pre else x
            x = x + lay.fc2(lay.act(lay.fc1(h)))
            if not pre:
                x = lay.ln_ffn(x)
        if self.ln_final is not None:
            x = self.ln_final(x)
        return self.lm(x)  # [N, V], final_logits_bias included
