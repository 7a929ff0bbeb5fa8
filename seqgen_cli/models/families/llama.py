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

from typing import Any

from torch import nn

from seqgen_cli.models.layers import Causal, CausalFacts, CausalLayer, projection


def llama_layer(layer: nn.Module, int8: bool) -> CausalLayer:
    """A Llama-named layer (``self_attn.q_proj``..., ``mlp.gate_proj``/``up_proj``/``down_proj``): Llama, Mistral,
    Qwen2, Qwen3, Gemma2, Gemma3; with the norms each of them has."""
    at, mlp = layer.self_attn, layer.mlp
    names = {"q": at.q_proj, "k": at.k_proj, "v": at.v_proj, "o": at.o_proj}
    names |= {"gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
    maps = {name: projection(module, int8) for name, module in names.items()}
    q, k, v, gate, up, down, act = (*(maps[n] for n in ("q", "k", "v", "gate", "up", "down")), mlp.act_fn)
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    return CausalLayer(
        ln_in=layer.input_layernorm,
        qkv=lambda h: (q(h), k(h), v(h)),
        o=maps["o"],
        scale=float(at.scaling),
        ln_mlp=layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
        mlp=lambda h: down(act(gate(h)) * up(h)),
        q_norm=getattr(at, "q_norm", None),
        k_norm=getattr(at, "k_norm", None),
        ln_attn_out=layer.post_attention_layernorm if gemma else None,
        ln_mlp_out=layer.post_feedforward_layernorm if gemma else None,
        softcap=getattr(at, "attn_logit_softcapping", None),
        layer_type=getattr(at, "layer_type", None) or "full_attention",
        maps=maps,
    )


def llama_facts(model: Any) -> CausalFacts:
    """Llama's names (and Phi-3's): ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``; the config's heads and
    K/V heads, the attention's ``head_dim``; Gemma2's logits soft-capping."""
    cfg, base = model.config, model.base_model
    heads = int(cfg.num_attention_heads)
    return CausalFacts(
        heads=heads,
        kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(base.layers[0].self_attn, "head_dim", None) or cfg.hidden_size // heads),
        max_positions=int(cfg.max_position_embeddings),
        embed=base.embed_tokens,
        layers=base.layers,
        final_norm=base.norm,
        rotary=base.rotary_emb,
        final_softcap=getattr(cfg, "final_logit_softcapping", None),
    )


_LLAMA = Causal(reader=llama_layer, position_kind="rotary", facts=llama_facts)
FAMILIES: dict[str, Causal] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma2": _LLAMA,
    "gemma3_text": Causal(reader=llama_layer, position_kind="rotary per layer type", facts=llama_facts),
}
