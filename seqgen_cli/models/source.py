"""The encoder-decoder decoder's source side: the model's own encoder, run once per input, and every decoder
layer's cross-attention keys and values over its output.

The encoder is the model's own module (float32 and bfloat16 on the CPU: a copy of its module tree that shares its
weights, its ``nn.Linear`` layers on oneDNN, ``linear_maps.onednn_copy``; ``generate()`` keeps the model's own;
int8: the model's own, quantized in place). Cross-attention keys/values are projected once per *input*
(``[B, Hkv, S, d]``), never per beam, through each layer's fused K|V map; the keys are held transposed. Both in
``kv_dtype`` (``attention.kv_dtype``): the CPU attends half precision in float32, so there they are widened once per
input, not per step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqgen_cli.models.attention import kv_dtype
from seqgen_cli.models.layers import Seq2SeqLayer
from seqgen_cli.models.linear_maps import quantize_linears
from seqgen_cli.search.protocol import Batch

Source = tuple[list[Tensor], list[Tensor], Tensor]  # per layer keys [B, Hkv, d, W], values [B, Hkv, W, d]; mask


def source_mask(mask: Tensor) -> Tensor:
    """A source's attention mask [B, W] (1: a token) as the additive mask its keys are attended with: [B, 1, 1, W]."""
    return torch.where(mask.bool(), 0.0, float("-inf"))[:, None, None, :]


class SourceEncoder:
    """The model's encoder (``encoder``: a oneDNN copy or, int8, the model's own, quantized here) and the decoder
    ``layers``' cross-attention K/V over its output, ``kv_heads`` heads of ``head_dim``, for a model in ``dtype``
    (the K/V in :attr:`kv_dtype`) on ``device``."""

    def __init__(
        self,
        encoder: nn.Module,
        layers: Sequence[Seq2SeqLayer],
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        int8: bool,
    ) -> None:
        self.encoder, self.layers, self.kv_heads, self.head_dim = encoder, layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.kv_dtype = kv_dtype(dtype, device)  # the CPU's half: float32 K/V (module docstring)
        if int8:
            quantize_linears(self.encoder)

    def run(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The model's encoder: [B, S] ids and mask -> last hidden state [B, S, D]."""
        enc = self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        return enc.last_hidden_state

    def views(self, hidden: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        """Each layer's cross-attention keys (transposed) and values in turn, as views of its K|V projection:
        [B, S, D] -> ([B, Hkv, d, S], [B, Hkv, S, d])."""
        b, s, _ = hidden.shape
        for lay in self.layers:
            kv = lay.ckv(hidden).view(b, s, 2, self.kv_heads, self.head_dim)  # [B, S, D] -> [B, S, 2, Hkv, d]
            k = lay.source_keys(kv[:, :, 0])  # [B, S, Hkv, d] (T5Gemma 2: normed)
            yield k.permute(0, 2, 3, 1), kv[:, :, 1].transpose(1, 2)

    def held(self, x: Tensor) -> Tensor:
        """Cross-attention keys or values as the state holds them: contiguous, in ``kv_dtype`` (one copy either way;
        ``to`` alone would return a view of the projection where the dtype already matches)."""
        if x.dtype == self.kv_dtype:
            return x.contiguous()
        return x.to(self.kv_dtype, memory_format=torch.contiguous_format)

    def whole(self, batch: Batch) -> Source:
        """Every input of ``batch`` ([B, W]) at the batch's width: each layer's keys [B, Hkv, d, W] and values
        [B, Hkv, W, d], and the mask [B, 1, 1, W]."""
        hidden = self.run(batch.input_ids, batch.attention_mask)  # [B, W, D]
        cross = [(self.held(k), self.held(v)) for k, v in self.views(hidden)]
        return [k for k, _ in cross], [v for _, v in cross], source_mask(batch.attention_mask)

    def encode(self, batch: Batch, width: int) -> Source:
        """Every layer's cross-attention keys [B, Hkv, d, W] and values [B, Hkv, W, d] and the mask [B, 1, 1, W]
        over ``width`` (W, whole ``CROSS_CHUNK`` chunks) source positions. The encoder runs once per input, for each
        group of inputs of one own width (``batch.widths``) at that width: an input's encoder and cross K/V are what
        they are with any neighbours; positions past an input's width hold zeros, masked."""
        b, s = batch.input_ids.shape
        widths = batch.widths or (s,) * b
        if len(set(widths)) == 1 and widths[0] == width == s:  # one group at the batch's width: no copies
            return self.whole(batch)
        mask = source_mask(F.pad(batch.attention_mask, (0, width - s)))  # [B, W] -> [B, 1, 1, W]
        hd = (self.kv_heads, self.head_dim)
        keys = [torch.zeros((b, *hd, width), dtype=self.kv_dtype, device=self.device) for _ in self.layers]
        values = [torch.zeros((b, hd[0], width, hd[1]), dtype=self.kv_dtype, device=self.device) for _ in keys]
        for w in sorted(set(widths)):
            rows = torch.tensor([i for i, x in enumerate(widths) if x == w], device=self.device)  # [G]
            hidden = self.run(batch.input_ids[rows, :w], batch.attention_mask[rows, :w])  # [G, w, D]
            for key, value, (k, v) in zip(keys, values, self.views(hidden), strict=True):
                key[rows, :, :, :w] = k.to(key.dtype)  # [G, Hkv, d, w] (the CPU's half: float32)
                value[rows, :, :w] = v.to(value.dtype)  # [G, Hkv, w, d]
        return keys, values, mask
