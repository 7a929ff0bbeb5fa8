"""Fast cached backend for Llama-style models (RoPE, RMSNorm, SwiGLU, GQA) over the checkpoint's own weights.

Also serves Mistral and Qwen2 (same blocks; Qwen2's q/k/v biases go through ``linear_maps.dense``) when they use full
attention in every layer; sliding-window configs are refused.

Only the ``num_key_value_heads`` K/V heads are cached; query groups broadcast against them in
``DecoderOnlyKVCache.attend``.
RoPE cos/sin come from the model's own rotary module (so its rope type/scaling is honoured exactly).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from seqgen_cli.models.decoder_only import DecoderOnlyBackend, DecoderOnlyState, self_attention
from seqgen_cli.models.linear_maps import Linear, dense
from seqgen_cli.models.linear_maps import linear as linear_map

STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # frequencies do not depend on the sequence length


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Block:
    """One layer's linear maps ([N, in] -> [N, out]): :func:`dense` over the model's own weights, or int8 copies."""

    def __init__(self, layer: torch.nn.Module, int8: bool) -> None:
        def lin(m: torch.nn.Linear) -> Linear:
            return linear_map(m.weight, m.bias, True) if int8 else partial(dense, weight=m.weight, bias=m.bias)

        at, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = lin(at.q_proj), lin(at.k_proj), lin(at.v_proj), lin(at.o_proj)
        self.gate, self.up, self.down = lin(mlp.gate_proj), lin(mlp.up_proj), lin(mlp.down_proj)


class LlamaBackend(DecoderOnlyBackend):
    """``ModelBackend`` for ``Llama/Mistral/Qwen2ForCausalLM``: the model's own modules, no weight copies."""

    def __init__(self, model: torch.nn.Module, int8: bool = False) -> None:
        """``int8`` (``--dtype int8``, CPU): every layer's maps and the LM head as int8 copies; the prompt's prefill
        stays the model's own forward in float32."""
        cfg = model.config
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in STATIC_ROPE:
            raise ValueError(
                f"rope_type {rope!r} (length-dependent RoPE) is not supported by the fast backend"
            )
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            raise ValueError("pretraining_tp > 1 is not supported by the fast backend")
        if getattr(cfg, "sliding_window", None) is not None or any(
            t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()
        ):
            raise ValueError("sliding-window attention is not supported by the fast backend")
        self.model = model
        self.base = model.model
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_position_embeddings = model.config.max_position_embeddings
        attn = self.base.layers[0].self_attn
        self.n_head, self.head_dim = cfg.num_attention_heads, attn.head_dim
        self.n_kv = cfg.num_key_value_heads
        self.n_layers = len(self.base.layers)
        head = model.get_output_embeddings()
        self.lm = linear_map(head.weight, head.bias, int8)
        self.blocks = [_Block(layer, int8) for layer in self.base.layers]
        self.int8 = int8

    def decode(self, state: DecoderOnlyState, tokens: Tensor) -> Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V] (float32)."""
        m = self.base
        state.cache.begin()
        x = m.embed_tokens(tokens)  # [N, D]
        N = x.shape[0]
        H, Hkv, d = self.n_head, self.n_kv, self.head_dim
        cos, sin = m.rotary_emb(x, (state.start_pos + state.cache.position)[None])  # [1, N, d]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, d]
        for i, (layer, maps) in enumerate(zip(m.layers, self.blocks, strict=True)):
            h = layer.input_layernorm(x)
            q = maps.q(h).view(N, H, d)
            k = maps.k(h).view(N, Hkv, d)
            v = maps.v(h).view(N, Hkv, d)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            x = x + maps.o(self_attention(state.cache, i, q, k, v, layer.self_attn.scaling))
            h = layer.post_attention_layernorm(x)
            x = x + maps.down(layer.mlp.act_fn(maps.gate(h)) * maps.up(h))
        x = m.norm(x)
        return self.lm(x).float()  # [N, V]
