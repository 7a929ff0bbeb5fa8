"""Llama and the families written as it is, on the shared decoder-only decoder: rotary positions, RMSNorm, SwiGLU,
grouped-query K/V heads.

=============  ================  ========================================================================
family         positions         beyond Llama's layer
=============  ================  ========================================================================
llama,         rotary            - (Qwen2: q/k/v biases)
mistral, qwen2
qwen3          rotary            q/k RMSNorm per head
gemma2         rotary            norms after attention and MLP, attention and final logit soft-capping
gemma3_text    rotary per layer  q/k norms, norms after attention and MLP
               type
=============  ================  ========================================================================
"""

from __future__ import annotations

from torch import nn

from seqgen_cli.models.layers import Causal, CausalLayer, projection


def llama_layer(layer: nn.Module, int8: bool) -> CausalLayer:
    """A Llama-named layer (``self_attn.q_proj``..., ``mlp.gate_proj``/``up_proj``/``down_proj``): Llama, Mistral,
    Qwen2, Qwen3, Gemma2, Gemma3; with the norms each of them has."""
    at, mlp = layer.self_attn, layer.mlp
    maps = dict(
        q=projection(at.q_proj, int8), k=projection(at.k_proj, int8), v=projection(at.v_proj, int8), o=projection(at.o_proj, int8),
        gate=projection(mlp.gate_proj, int8), up=projection(mlp.up_proj, int8), down=projection(mlp.down_proj, int8),
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


_LLAMA = Causal(reader=llama_layer, positions="rotary", final_norm="norm")
FAMILIES: dict[str, Causal] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma2": _LLAMA,
    "gemma3_text": Causal(reader=llama_layer, positions="rotary per layer type", final_norm="norm"),
}
