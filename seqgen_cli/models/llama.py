"""Fast cached backend for Llama-style models (RoPE, RMSNorm, SwiGLU, GQA) over the checkpoint's own weights.

Also serves Mistral and Qwen2 (same blocks; Qwen2's q/k/v biases go through ``linear_maps.dense``) when they use full
attention in every layer; sliding-window configs are refused.

Only the ``num_key_value_heads`` K/V heads are cached; query groups broadcast against them in
``DecoderOnlyKVCache.attend``.
RoPE cos/sin come from the model's own rotary module (so its rope type/scaling is honoured exactly).
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqgen_cli.models.decoder_only import DecoderOnlyBackend, DecoderOnlyState, self_attention
from seqgen_cli.models.linear_maps import dense
from seqgen_cli.models.linear_maps import linear as linear_map

STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # frequencies do not depend on the sequence length


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def linear(x: Tensor, m: torch.nn.Linear) -> Tensor:
    return dense(x, m.weight, m.bias)


class LlamaBackend(DecoderOnlyBackend):
    """``ModelBackend`` for ``Llama/Mistral/Qwen2ForCausalLM``: the model's own modules, no weight copies."""

    def __init__(self, model: torch.nn.Module) -> None:
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
        self.lm = linear_map(head.weight, head.bias)

    def decode(self, state: DecoderOnlyState, tokens: Tensor) -> Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V] (float32)."""
        m = self.base
        state.cache.begin()
        x = m.embed_tokens(tokens)  # [N, D]
        N = x.shape[0]
        H, Hkv, d = self.n_head, self.n_kv, self.head_dim
        cos, sin = m.rotary_emb(x, (state.start_pos + state.cache.position)[None])  # [1, N, d]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, d]
        for i, layer in enumerate(m.layers):
            at = layer.self_attn
            h = layer.input_layernorm(x)
            q = linear(h, at.q_proj).view(N, H, d)
            k = linear(h, at.k_proj).view(N, Hkv, d)
            v = linear(h, at.v_proj).view(N, Hkv, d)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            x = x + linear(self_attention(state.cache, i, q, k, v, at.scaling), at.o_proj)
            h = layer.post_attention_layernorm(x)
            mlp = layer.mlp
            x = x + linear(mlp.act_fn(linear(h, mlp.gate_proj)) * linear(h, mlp.up_proj), mlp.down_proj)
        x = m.norm(x)
        return self.lm(x).float()  # [N, V]
