"""Fast cached backend for GPT-2 (``GPT2LMHeadModel``) over the checkpoint's own weights.

Conv1D weights are [in, out] (``x @ W + b`` = ``addmm``); c_attn is already a fused q|k|v projection;
learned absolute positions; the MLP activation is the module's own (``gelu_new`` for gpt2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from seqgen_cli.models.decoder_only import DecoderOnlyBackend, DecoderOnlyState


def _conv1d(x: Tensor, conv: torch.nn.Module) -> Tensor:
    """HF Conv1D: [N, in] @ [in, out] + [out]."""
    return torch.addmm(conv.bias, x, conv.weight)


class GPT2Backend(DecoderOnlyBackend):
    """``ModelBackend`` for GPT-2; holds references to the model's modules, no weight copies."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        if getattr(cfg, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention is not a decoder-only LM")
        self.model = model
        self.base = model.transformer
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_position_embeddings = model.config.n_positions
        self.n_head = cfg.n_head
        self.n_layers, self.n_kv, self.head_dim = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head

    def decode(self, state: DecoderOnlyState, tokens: Tensor) -> Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V] (float32)."""
        tr = self.base
        state.cache.begin()
        x = tr.wte(tokens) + tr.wpe(state.start_pos + state.cache.slot)  # [N, D]
        N, D = x.shape
        H = self.n_head
        for i, block in enumerate(tr.h):
            attn = block.attn
            h = F.layer_norm(x, (D,), block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
            q, k, v = _conv1d(h, attn.c_attn).split(D, dim=-1)  # 3 x [N, D]
            # [N, D] -> [N, H, d] each; attention output [N, D]
            a = state.cache.attend(i, q.view(N, H, -1), k.view(N, H, -1), v.view(N, H, -1), attn.scaling)
            x = x + _conv1d(a, attn.c_proj)
            h = F.layer_norm(x, (D,), block.ln_2.weight, block.ln_2.bias, block.ln_2.eps)
            mlp = block.mlp
            x = x + _conv1d(mlp.act(_conv1d(h, mlp.c_fc)), mlp.c_proj)
        x = F.layer_norm(x, (D,), tr.ln_f.weight, tr.ln_f.bias, tr.ln_f.eps)
        return self.model.get_output_embeddings()(x).float()  # [N, V]
