"""Fast backend for T5 v1.0, T5 v1.1 / Flan-T5 and mT5 over the checkpoint's own modules.

Quirks, each as transformers does them: unscaled attention (scale 1) with a learned relative-position bias
from the first block's self-attention, shared by all blocks; for an incremental query at position ``t`` the
bias row ``t`` (picked by the cache's device position) of a ``[T, T]`` table (unidirectional buckets) built once per
call; RMSNorm (``T5LayerNorm``);
ReLU (v1.0) or gated-GELU (v1.1/Flan) feed-forward (the module's activation and its dtype cast before ``wo``);
fp16 clamping after each sub-layer; v1.0's tied-embedding rescale ``d_model ** -0.5`` before the LM head. Every
product goes through :func:`~seqgen_cli.models.linear_maps.linear` (oneDNN on the CPU: a row's result does not depend
on the other rows of the step).
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
from seqgen_cli.search.protocol import Batch


def _feed_forward(ff: nn.Module, int8: bool) -> Linear:
    """``T5DenseActDense`` / ``T5DenseGatedActDense`` (no dropout at inference) over :func:`linear` maps."""
    wo = linear(ff.wo.weight, None, int8)
    if hasattr(ff, "wi_0"):  # gated: act(wi_0 x) * wi_1 x
        wi_0, wi_1 = linear(ff.wi_0.weight, None, int8), linear(ff.wi_1.weight, None, int8)
        return lambda x: wo((ff.act(wi_0(x)) * wi_1(x)).to(ff.wo.weight.dtype))
    wi = linear(ff.wi.weight, None, int8)
    return lambda x: wo(ff.act(wi(x)).to(ff.wo.weight.dtype))


class _Block:
    """One decoder block's weights (views of the model's parameters) and its linear maps (over those views, or
    int8 copies)."""

    def __init__(self, block: nn.Module, int8: bool = False) -> None:
        sa, ca, ff = block.layer[0], block.layer[1], block.layer[2]
        self.ln_self = sa.layer_norm
        self.qkv_w, _ = fuse_linears([sa.SelfAttention.q, sa.SelfAttention.k, sa.SelfAttention.v])  # [3I, D]
        self.qkv = linear(self.qkv_w, None, int8)
        self.o = linear(sa.SelfAttention.o.weight, None, int8)
        self.ln_cross = ca.layer_norm
        self.cq = linear(ca.EncDecAttention.q.weight, None, int8)
        self.ckv_w, self.ckv_b = fuse_linears([ca.EncDecAttention.k, ca.EncDecAttention.v])  # [2I, D], None
        self.ckv = linear(self.ckv_w, self.ckv_b, int8)
        self.co = linear(ca.EncDecAttention.o.weight, None, int8)
        self.ln_ff = ff.layer_norm
        self.ff = _feed_forward(ff.DenseReluDense, int8)


def _clamp_fp16(x: torch.Tensor) -> torch.Tensor:
    """T5Block's fp16 overflow guard, sync-free (as transformers writes it)."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(x.dtype).max
    limit = torch.where(torch.isinf(x).any(), top - 1000, top)
    return torch.clamp(x, min=-limit, max=limit)


class T5Backend(EncoderDecoderBackend):
    """:class:`~seqgen_cli.search.protocol.ModelBackend` for t5 / mt5 checkpoints (incl. Flan-T5)."""

    def __init__(self, model: PreTrainedModel, int8: bool = False) -> None:
        """``int8`` (``--dtype int8``, CPU): the decoder's linear maps and the LM head as int8 copies of the float32
        weights, the model's own encoder quantized in place (as the BART family's)."""
        cfg = model.config
        dec = model.get_decoder()
        blocks = [_Block(b, int8) for b in dec.block]
        super().__init__(model, dec.embed_tokens.weight, blocks, int(cfg.num_heads), int(cfg.d_kv))
        self.rel_attn = dec.block[0].layer[0].SelfAttention  # owns relative_attention_bias
        self.ln_final = dec.final_layer_norm
        self.out_scale = float(cfg.d_model) ** -0.5 if getattr(cfg, "scale_decoder_outputs", False) else None
        self.int8 = int8
        if int8:
            self.lm = linear(self.lm_w, self.lm_head.bias, int8)
            quantize_linears(self.encoder)

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[EncoderDecoderState, None]:
        state, _ = super().start(batch, rows_per_input, max_new_tokens)
        t = state.max_len
        state.self_bias = self.rel_attn.compute_bias(t, t, device=self.device).to(self.dtype)  # [1, H, T, T]
        return state, None

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int:
        """The caches (:meth:`EncoderDecoderBackend.cache_bytes`) and the relative position bias [1, H, T, T]."""
        t = max(1, new_tokens)
        bias = self.heads * t * t * self.dtype.itemsize
        return super().cache_bytes(inputs, width, rows_per_input, new_tokens) + bias

    @torch.inference_mode()
    def open_lanes(self, lanes: int, rows_per_input: int, max_new_tokens: int) -> EncoderDecoderState:
        state = super().open_lanes(lanes, rows_per_input, max_new_tokens)
        t = state.max_len
        state.self_bias = self.rel_attn.compute_bias(t, t, device=self.device).to(self.dtype)  # [1, H, T, T]
        return state

    def decode(self, state: EncoderDecoderState, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V]."""
        cache = state.cache
        cache.begin(state.self_bias.index_select(2, cache.position))  # [1, H, 1, T], shared by all blocks
        x = F.embedding(tokens, self.embed)  # [N, D]
        for i, blk in enumerate(self.dec_layers):
            a = self_attention(blk.qkv(blk.ln_self(x)), cache, i, self.heads, 1.0)  # [N, I]
            x = _clamp_fp16(x + blk.o(a))
            a = cross_attention(
                blk.cq(blk.ln_cross(x)), state.cross_k[i], state.cross_v[i], state.cross_mask, 1.0
            )
            x = _clamp_fp16(x + blk.co(a))
            x = _clamp_fp16(x + blk.ff(blk.ln_ff(x)))
        x = self.ln_final(x)
        if self.out_scale is not None:
            x = x * self.out_scale
        return self.lm(x)  # [N, V] (bias: None unless the head was replaced)
