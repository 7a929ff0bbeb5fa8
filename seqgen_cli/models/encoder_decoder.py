"""What the fast encoder-decoder backends (BART family, T5) share: encoder, cross-attention, reorder, drop.

The model's own encoder runs once per input. Cross-attention keys/values are projected once per *input*
(``[B, H, S, d]``), never per beam: a step's ``N = B * R`` queries are viewed as ``[B, H, R, d]``, so the
``R`` beams of an input act as query positions against that input's keys (FastSeq's trick). They are never
reordered (beams stay within their input) and only shrink when inputs finish. Self-attention goes through
:class:`~seqgen_cli.models.kv_cache.EncoderDecoderKVCache`.

Subclasses build their per-layer weight views (with ``ckv``: the fused cross-attention K|V linear map) and
implement ``step``; ``lm`` is the LM head as a linear map (:func:`~seqgen_cli.models.quantize.linear`; the
BART backend rebuilds it with ``final_logits_bias`` folded in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from seqgen_cli.models.kv_cache import EncoderDecoderKVCache, attention
from seqgen_cli.models.quantize import linear
from seqgen_cli.search.protocol import Batch


@dataclass
class EncoderDecoderState:
    cross_k: list[torch.Tensor]  # per decoder layer [B, H, d, S]: keys transposed
    cross_v: list[torch.Tensor]  # per decoder layer [B, H, S, d]
    cross_mask: torch.Tensor  # [B, 1, 1, S] float32 additive: 0 = attend, -inf = padding
    cache: EncoderDecoderKVCache  # self-attention, preallocated for max_len positions
    max_len: int  # positions the self-attention cache holds
    t: int = 0  # decoder positions fed so far (host counter)
    self_bias: torch.Tensor | None = None  # T5: relative position bias [1, H, T, T] (query, key)


def cross_attention(
    q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q`` [N, H*d] (N = B*R, input-major), ``k_t`` [B, H, d, S], ``v`` [B, H, S, d], ``mask`` additive
    [B, 1, 1, S] -> [N, H*d]."""
    b, h, d, _ = k_t.shape
    n = q.shape[0]
    q = q.view(b, n // b, h, d).transpose(1, 2)  # [N, H*d] -> [B, H, R, d]: beams as query positions
    out = attention(q, k_t, v, mask, scale)  # [B, H, R, d]
    return out.transpose(1, 2).reshape(n, h * d)  # [B, R, H, d] -> [N, H*d]


def self_attention(
    qkv: torch.Tensor, cache: EncoderDecoderKVCache, layer: int, heads: int, scale: float
) -> torch.Tensor:
    """``qkv`` [N, 3*H*d] for this step; writes k/v into ``cache``; returns the attention output [N, H*d]."""
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)  # [N, 3, H, d] -> [N, H, d] each
    return cache.attend(layer, q, k, v, scale)


class EncoderDecoderBackend:
    """Protocol glue shared by the BART-family and T5 backends; subclasses implement ``step``."""

    is_encoder_decoder = True

    def __init__(
        self, model: PreTrainedModel, embed: torch.Tensor, dec_layers: list[Any], heads: int, head_dim: int
    ) -> None:
        """``embed``: decoder input embeddings [V_in, D]; ``dec_layers``: per-layer weight views."""
        self.model = model.eval()
        self.encoder = model.get_encoder()
        self.embed = embed
        self.dec_layers = dec_layers
        self.layers = len(dec_layers)
        self.heads = heads
        self.head_dim = head_dim
        self.lm_head = model.get_output_embeddings()
        self.lm_w = self.lm_head.weight  # [V, D]
        self.lm = linear(self.lm_w, self.lm_head.bias)  # [N, D] -> [N, V]
        self.vocab_size = int(self.lm_w.shape[0])
        self.dtype = embed.dtype
        self.device = embed.device

    def _cross_kv(self, hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's cross-attention keys (transposed) and values: [B, S, D] -> L x ([B, H, d, S], [B, H, S, d])."""
        b, s, _ = hidden.shape
        out = []
        for lay in self.dec_layers:
            kv = lay.ckv(hidden).view(b, s, 2, self.heads, self.head_dim)  # [B, S, 2, H, d]
            out.append(
                (kv[:, :, 0].permute(0, 2, 3, 1).contiguous(), kv[:, :, 1].transpose(1, 2).contiguous())
            )
        return out

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[EncoderDecoderState, None]:
        enc = self.encoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, return_dict=True)
        hidden = enc.last_hidden_state  # [B, S, D], the model's own encoder, once per input
        cross = self._cross_kv(hidden)
        mask = torch.where(batch.attention_mask.bool(), 0.0, float("-inf"))[:, None, None, :]  # [B, 1, 1, S]
        max_len = max(1, max_new_tokens)  # step() is called at most max_new_tokens times
        cache = EncoderDecoderKVCache(
            self.layers,
            hidden.shape[0],
            rows_per_input,
            self.heads,
            max_len,
            self.head_dim,
            self.dtype,
            hidden.device,
        )
        state = EncoderDecoderState(
            cross_k=[k for k, _ in cross],
            cross_v=[v for _, v in cross],
            cross_mask=mask,
            cache=cache,
            max_len=max_len,
        )
        return state, None

    @torch.inference_mode()
    def reorder(self, state: EncoderDecoderState, rows: torch.Tensor) -> None:
        state.cache.reorder(rows)

    @torch.inference_mode()
    def drop(self, state: EncoderDecoderState, keep: torch.Tensor, rows: torch.Tensor) -> None:
        state.cross_k = [k.index_select(0, keep) for k in state.cross_k]
        state.cross_v = [v.index_select(0, keep) for v in state.cross_v]
        state.cross_mask = state.cross_mask.index_select(0, keep)
        state.cache.keep(keep, rows, used=state.t)

    def cache_nbytes(self, state: EncoderDecoderState) -> dict[str, int]:
        """Bytes held for the search: cross-attention K/V (per input) and the self-attention cache."""
        cross = sum(k.nbytes + v.nbytes for k, v in zip(state.cross_k, state.cross_v, strict=True))
        return {"cross": cross, "self": state.cache.nbytes}
