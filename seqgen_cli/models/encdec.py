"""What the fast encoder-decoder backends share: state, cross-attention once per input, reorder and drop.

Cross-attention keys/values are projected once per *input* (``[B, H, S, d]``), never per beam. A step's
``N = B * R`` queries are viewed as ``[B, H, R, d]``, so the ``R`` beams of an input act as query positions
against that input's keys (FastSeq's trick); they are never reordered (beams stay within their input) and
only shrink when inputs finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from seqgen_cli.models.kv_cache import KV_CACHES, BackPointerCache, BeamMaskCache, CopyCache
from seqgen_cli.search.protocol import Batch

SelfCache = CopyCache | BackPointerCache | BeamMaskCache


@dataclass
class EncDecState:
    cross_k: list[torch.Tensor]  # per decoder layer [B, H, S, d]
    cross_v: list[torch.Tensor]  # per decoder layer [B, H, S, d]
    cross_mask: torch.Tensor  # [B, 1, 1, S] bool, True = attend
    cache: SelfCache  # self-attention, preallocated for max_len positions
    rows_per_input: int
    max_len: int  # positions the self-attention cache holds
    t: int = 0  # decoder positions fed so far (host counter)
    self_bias: torch.Tensor | None = None  # T5: relative position bias [1, H, T, T] (query, key)


def cross_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q`` [N, H*d] (N = B*R, input-major), ``k``/``v`` [B, H, S, d], ``mask`` [B, 1, 1, S] -> [N, H*d]."""
    b, h, _, d = k.shape
    n = q.shape[0]
    q = q.view(b, n // b, h, d).transpose(1, 2)  # [B, H, R, d]: beams as query positions
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, H, R, d]
    return out.transpose(1, 2).reshape(n, h * d)


def self_attention(qkv: torch.Tensor, cache: SelfCache, layer: int, heads: int, scale: float) -> torch.Tensor:
    """``qkv`` [N, 3*H*d] for this step; writes k/v into ``cache``; returns the attention output [N, H*d]."""
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)  # [N, H, d] each
    return cache.attend(layer, q, k, v, scale)


class EncoderDecoderBackend:
    """Protocol plumbing shared by the BART-family and T5 backends; subclasses provide the model math."""

    is_encoder_decoder = True
    vocab_size: int
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __init__(self, cache: str = "beam-mask") -> None:
        self.cache_cls = KV_CACHES[cache]

    def _encode(self, batch: Batch) -> torch.Tensor:  # [B, S, D]
        raise NotImplementedError

    def _cross_kv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # [B, S, D] -> ([B, H, S, d], [B, H, S, d])

    @torch.inference_mode()
    def start(self, batch: Batch, rows_per_input: int, max_new_tokens: int) -> tuple[EncDecState, None]:
        hidden = self._encode(batch)  # [B, S, D], the model's own encoder, once per input
        bsz = hidden.shape[0]
        cross = [self._cross_kv(i, hidden) for i in range(self.layers)]
        mask = batch.attention_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, S]
        max_len = max(1, max_new_tokens)  # step() is called at most max_new_tokens times
        cache = self.cache_cls(
            self.layers, bsz, rows_per_input, self.heads, max_len, self.head_dim, self.dtype, hidden.device
        )
        state = EncDecState(
            cross_k=[k for k, _ in cross],
            cross_v=[v for _, v in cross],
            cross_mask=mask,
            cache=cache,
            rows_per_input=rows_per_input,
            max_len=max_len,
        )
        return state, None

    @torch.inference_mode()
    def reorder(self, state: EncDecState, rows: torch.Tensor) -> None:
        state.cache.reorder(rows)

    @torch.inference_mode()
    def drop(self, state: EncDecState, keep: torch.Tensor) -> None:
        r = state.rows_per_input
        rows = (keep[:, None] * r + torch.arange(r, device=keep.device)).reshape(-1)  # [B' * R]
        state.cross_k = [k.index_select(0, keep) for k in state.cross_k]
        state.cross_v = [v.index_select(0, keep) for v in state.cross_v]
        state.cross_mask = state.cross_mask.index_select(0, keep)
        state.cache.keep(keep, rows)

    def cache_nbytes(self, state: EncDecState) -> dict[str, int]:
        """Bytes held for the search: cross-attention K/V (per input) and the self-attention cache."""
        cross = sum(k.nbytes + v.nbytes for k, v in zip(state.cross_k, state.cross_v, strict=True))
        return {"cross": cross, "self": state.cache.nbytes}
