"""GPT-2 (``gpt2``) on the shared decoder-only decoder: learned positions (``wpe``), LayerNorm, fused q|k|v (a Conv1D),
a GELU MLP."""

from __future__ import annotations

from typing import Any

from torch import nn

from seqgen_cli.models.layers import Causal, CausalFacts, CausalLayer
from seqgen_cli.models.linear_maps import Linear, linear


def gpt2_block(block: nn.Module, int8: bool) -> CausalLayer:
    """A GPT-2 block: Conv1D weights [in, out] as maps over their transposed views; c_attn is q|k|v fused."""

    def conv1d(conv: nn.Module) -> Linear:
        return linear(conv.weight.t(), conv.bias, int8)  # weight [in, out] -> [out, in] view

    at, mlp = block.attn, block.mlp
    maps = dict(
        c_attn=conv1d(at.c_attn), c_proj=conv1d(at.c_proj), c_fc=conv1d(mlp.c_fc), mlp_proj=conv1d(mlp.c_proj)
    )
    c_attn, c_fc, proj, act = maps["c_attn"], maps["c_fc"], maps["mlp_proj"], mlp.act
    return CausalLayer(
        ln_in=block.ln_1,
        qkv=lambda h: c_attn(h).chunk(3, dim=-1),
        o=maps["c_proj"],
        scale=float(at.scaling),
        ln_mlp=block.ln_2,
        mlp=lambda h: proj(act(c_fc(h))),
        maps=maps,
    )


def gpt2_facts(model: Any) -> CausalFacts:
    """GPT-2's names: ``wte``, ``wpe`` (its learned positions: ``n_positions`` of them), the blocks ``h``,
    ``ln_f``; ``n_head`` heads, each its own K/V head."""
    cfg, base = model.config, model.base_model
    heads = int(cfg.n_head)
    return CausalFacts(
        heads=heads,
        kv_heads=heads,
        head_dim=int(base.h[0].attn.head_dim),
        max_positions=int(cfg.n_positions),
        embed=base.wte,
        layers=base.h,
        final_norm=base.ln_f,
        learned=base.wpe,
    )


def refuse(config: Any) -> str | None:
    """GPT-2 with cross-attention (a decoder of an encoder-decoder) is not this decoder's."""
    if getattr(config, "add_cross_attention", False):
        return "GPT-2 with cross-attention is not a decoder-only LM"
    return None


FAMILIES: dict[str, Causal] = {
    "gpt2": Causal(
        reader=gpt2_block, position_kind="learned", facts=gpt2_facts, table="n_positions", refuse=refuse
    ),
}
