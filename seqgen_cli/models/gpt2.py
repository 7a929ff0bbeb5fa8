"""Fast cached backend for GPT-2 (``GPT2LMHeadModel``) over the checkpoint's own weights.

Conv1D weights are [in, out] (``x @ W + b``): each runs as a :func:`~seqgen_cli.models.linear_maps.linear` map over
the transposed view (oneDNN on the CPU: a row's result does not depend on the other rows of the step), as does the
LM head; c_attn is already a fused q|k|v projection; learned absolute positions; the MLP activation is the
module's own (``gelu_new`` for gpt2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from seqgen_cli.models.decoder_only import DecoderOnlyBackend, DecoderOnlyState, self_attention
from seqgen_cli.models.linear_maps import Linear, linear


class _Block:
    """One block's Conv1D maps ([N, in] -> [N, out]): over the weights, or int8 copies."""

    def __init__(self, block: torch.nn.Module, int8: bool = False) -> None:
        def conv1d(conv: torch.nn.Module) -> Linear:
            return linear(conv.weight.t(), conv.bias, int8)  # weight [in, out] -> [out, in] view

        self.c_attn, self.c_proj = conv1d(block.attn.c_attn), conv1d(block.attn.c_proj)
        self.c_fc, self.mlp_proj = conv1d(block.mlp.c_fc), conv1d(block.mlp.c_proj)


class GPT2Backend(DecoderOnlyBackend):
    """``ModelBackend`` for GPT-2 over the model's own modules and weights (the linear maps pack a copy, see
    ``models/linear_maps.py``)."""

    def __init__(self, model: torch.nn.Module, int8: bool = False) -> None:
        """``int8`` (``--dtype int8``, CPU): the blocks' maps and the LM head as int8 copies; the prompt's prefill
        stays the model's own forward in float32."""
        cfg = model.config
        if getattr(cfg, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention is not a decoder-only LM")
        self.model = model
        self.base = model.transformer
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_position_embeddings = model.config.n_positions
        self.n_head = cfg.n_head
        self.n_layers, self.n_kv, self.head_dim = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head
        self.blocks = [_Block(block, int8) for block in self.base.h]
        head = model.get_output_embeddings()
        self.lm = linear(head.weight, head.bias, int8)
        self.int8 = int8

    def decode(self, state: DecoderOnlyState, tokens: Tensor) -> Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V] (float32)."""
        tr = self.base
        state.cache.begin()
        x = tr.wte(tokens) + tr.wpe(state.start_pos + state.cache.position)  # [N, D]
        N, D = x.shape
        H = self.n_head
        for i, (block, maps) in enumerate(zip(tr.h, self.blocks, strict=True)):
            attn = block.attn
            h = F.layer_norm(x, (D,), block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
            q, k, v = maps.c_attn(h).split(D, dim=-1)  # 3 x [N, D]
            # [N, D] -> [N, H, d] each; attention output [N, D]
            a = self_attention(
                state.cache, i, q.view(N, H, -1), k.view(N, H, -1), v.view(N, H, -1), attn.scaling
            )
            x = x + maps.c_proj(a)
            h = F.layer_norm(x, (D,), block.ln_2.weight, block.ln_2.bias, block.ln_2.eps)
            x = x + maps.mlp_proj(block.mlp.act(maps.c_fc(h)))
        x = F.layer_norm(x, (D,), tr.ln_f.weight, tr.ln_f.bias, tr.ln_f.eps)
        return self.lm(x).float()  # [N, V]
