"""Phi-3 (``phi3``) on the shared decoder-only decoder: Llama's layer with q|k|v and gate|up fused in the checkpoint, rotary
positions (partial where the config says)."""

from __future__ import annotations

from torch import Tensor, nn

from seqgen_cli.models.families.llama import llama_facts
from seqgen_cli.models.layers import Causal, CausalLayer, projection


def phi3_layer(layer: nn.Module, int8: bool) -> CausalLayer:
    """A Phi-3 layer: ``qkv_proj`` (q|k|v) and ``gate_up_proj`` (gate|up) fused in the checkpoint."""
    at, mlp = layer.self_attn, layer.mlp
    maps = {
        "qkv": projection(at.qkv_proj, int8),
        "o": projection(at.o_proj, int8),
        "gate_up": projection(mlp.gate_up_proj, int8),
        "down": projection(mlp.down_proj, int8),
    }
    qkv, gate_up, down, act = maps["qkv"], maps["gate_up"], maps["down"], mlp.activation_fn
    q_size, kv_size = at.config.num_attention_heads * at.head_dim, at.config.num_key_value_heads * at.head_dim

    def split(h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(qkv(h).split((q_size, kv_size, kv_size), dim=-1))  # [N, H*d | Hkv*d | Hkv*d]

    def feed_forward(h: Tensor) -> Tensor:
        g, u = gate_up(h).chunk(2, dim=-1)  # [N, 2F] -> 2 x [N, F]
        return down(u * act(g))

    return CausalLayer(
        ln_in=layer.input_layernorm,
        qkv=split,
        o=maps["o"],
        scale=float(at.scaling),
        ln_mlp=layer.post_attention_layernorm,
        mlp=feed_forward,
        maps=maps,
    )


FAMILIES: dict[str, Causal] = {"phi3": Causal(reader=phi3_layer, position_kind="rotary", facts=llama_facts)}
