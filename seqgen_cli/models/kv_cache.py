"""Preallocated decoder self-attention caches, written in place, with three beam-reorder strategies.

All are allocated once for the maximum length ``T`` (no growing concatenation); step ``t`` writes position
``t`` of every row and attends over positions ``[0, t]``. They differ in what a beam reorder costs:

* :class:`CopyCache` (``[L, N, H, T, d]``) moves the filled prefix of every layer at reorder time
  (transformers' ``reorder_cache`` minus the concatenation).
* :class:`BackPointerCache` (``[L, N, H, T, d]``) never moves keys; back-pointers ``src[n, p]`` (which beam
  of row ``n``'s input wrote position ``p`` of its history; ``[N, T]`` int64) are reordered instead and every
  layer gathers its keys/values through them on read.
* :class:`BeamMaskCache` (``[L, B, H, T, R, d]``) never moves or gathers keys either: the ``R`` beams of an
  input are its query positions against *all* ``(t+1) * R`` keys its beams wrote, and the back-pointers
  become a boolean attention mask (query beam ``q`` sees key ``(p, r)`` iff ``src[q, p] == r``). One SDPA
  per layer, keys read once, in place; the mask is built once per step for all layers.

Measured in ``docs/BENCHMARKS.md``; ``BeamMaskCache`` is the default. Positions are host integers (the step
counter), so nothing here syncs with the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CopyCache:
    """Reorder copies the filled prefix; reads are strided views."""

    def __init__(
        self,
        layers: int,
        inputs: int,
        rows_per_input: int,
        heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layers, inputs * rows_per_input, heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, N, H, T, d]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, N, H, T, d]
        self.len = 0  # this step's position t
        self.bias: torch.Tensor | None = None

    def begin(self, t: int, bias: torch.Tensor | None = None) -> None:
        """Step ``t`` starts; ``bias`` [1, H, 1, t+1]: additive attention bias over positions (T5)."""
        self.len, self.bias = t, bias

    def _kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.len
        self.k[layer, :, :, t] = k
        self.v[layer, :, :, t] = v
        return self.k[layer, :, :, : t + 1], self.v[layer, :, :, : t + 1]  # [N, H, t+1, d]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store this step's ``k``/``v`` ([N, H, d]); attend ``q`` [N, H, d] over the row's history -> [N, H*d]."""
        keys, values = self._kv(layer, k, v)
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=self.bias, scale=scale)
        return out.reshape(q.shape[0], -1)  # [N, H, 1, d] -> [N, H*d]

    def reorder(self, rows: torch.Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64); called after step ``t`` wrote position ``t``."""
        t = self.len + 1
        self.k[:, :, :, :t] = self.k[:, :, :, :t].index_select(1, rows)
        self.v[:, :, :, :t] = self.v[:, :, :, :t].index_select(1, rows)

    def keep(self, inputs: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep only inputs ``inputs`` ([B'] int64), i.e. rows ``rows`` ([B' * R])."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class BackPointerCache(CopyCache):
    """Reorder permutes back-pointers ([N, T] int64); reads gather keys through them."""

    def __init__(
        self,
        layers: int,
        inputs: int,
        rows_per_input: int,
        heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(layers, inputs, rows_per_input, heads, max_len, head_dim, dtype, device)
        self.r = rows_per_input
        self.src = torch.zeros(inputs * rows_per_input, max_len, dtype=torch.long, device=device)  # [N, T]
        self.reordered = False  # host flag: greedy and sampling never gather
        self._flat: torch.Tensor | None = None  # [N * H * (t+1)] gather index for this step

    def begin(self, t: int, bias: torch.Tensor | None = None) -> None:
        super().begin(t, bias)
        _, n, h, T, _ = self.k.shape
        dev = self.src.device
        self.src[:, t] = torch.arange(n, device=dev) % self.r
        if not self.reordered:
            self._flat = None
            return
        base = torch.arange(n, device=dev) // self.r * self.r  # [N] first row of the row's input
        phys = base[:, None] + self.src[:, : t + 1]  # [N, t+1] physical row holding (n, p)
        pos = torch.arange(t + 1, device=dev)
        heads = torch.arange(h, device=dev)
        # index into a layer viewed as [N * H * T, d]: (phys * H + h) * T + p
        self._flat = ((phys[:, None, :] * h + heads[None, :, None]) * T + pos[None, None, :]).reshape(-1)

    def _kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super()._kv(layer, k, v)
        if self._flat is None:
            return keys, values
        n, h, t1, d = keys.shape
        keys = self.k[layer].view(-1, d).index_select(0, self._flat).view(n, h, t1, d)
        values = self.v[layer].view(-1, d).index_select(0, self._flat).view(n, h, t1, d)
        return keys, values

    def reorder(self, rows: torch.Tensor) -> None:
        self.src = self.src.index_select(0, rows)
        self.reordered = True

    def keep(self, inputs: torch.Tensor, rows: torch.Tensor) -> None:
        super().keep(inputs, rows)
        self.src = self.src.index_select(0, rows)  # beam indices stay valid within an input

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.src.nbytes


class BeamMaskCache:
    """Beams as query positions over all their input's keys; back-pointers as the attention mask."""

    def __init__(
        self,
        layers: int,
        inputs: int,
        rows_per_input: int,
        heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layers, inputs, heads, max_len, rows_per_input, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, B, H, T, R, d]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, B, H, T, R, d]
        self.r = rows_per_input
        self.src = torch.zeros(inputs * rows_per_input, max_len, dtype=torch.long, device=device)  # [N, T]
        self.beams = torch.arange(rows_per_input, device=device)  # [R]
        self.reordered = False  # host flag: before any reorder, row n's history is all its own
        self.len = 0
        self.mask: torch.Tensor | None = None

    def begin(self, t: int, bias: torch.Tensor | None = None) -> None:
        """Step ``t`` starts; ``bias`` [1, H, 1, t+1]: additive attention bias over positions (T5)."""
        self.len = t
        _, b, h, _, r, _ = self.k.shape
        self.src[:, t] = self.beams.repeat(b)
        if r == 1 or not self.reordered:
            visible = None
            if r > 1:  # own beam only
                visible = (self.beams[:, None] == self.beams).view(1, r, 1, r).expand(b, r, t + 1, r)
        else:
            visible = self.src.view(b, r, -1)[:, :, : t + 1, None] == self.beams  # [B, Rq, t+1, R]
        if visible is not None:
            visible = visible.reshape(b, 1, r, (t + 1) * r)  # [B, 1, Rq, (t+1)*R], key index p*R + r
        if bias is not None:
            bias = bias[..., None].expand(1, h, 1, t + 1, r).reshape(1, h, 1, (t + 1) * r)
            if visible is not None:
                bias = bias.masked_fill(~visible, float("-inf"))  # [B, H, Rq, (t+1)*R]
            self.mask = bias
        else:
            self.mask = visible

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store this step's ``k``/``v`` ([N, H, d]); attend ``q`` [N, H, d] over the row's history -> [N, H*d]."""
        t = self.len
        _, b, h, _, r, d = self.k.shape
        kl, vl = self.k[layer], self.v[layer]  # [B, H, T, R, d]
        kl[:, :, t] = k.view(b, r, h, d).transpose(1, 2)
        vl[:, :, t] = v.view(b, r, h, d).transpose(1, 2)
        keys = kl[:, :, : t + 1].view(b, h, (t + 1) * r, d)  # contiguous per (b, h): no copy
        values = vl[:, :, : t + 1].view(b, h, (t + 1) * r, d)
        qb = q.view(b, r, h, d).transpose(1, 2)  # [B, H, Rq, d]
        out = F.scaled_dot_product_attention(
            qb, keys, values, attn_mask=self.mask, scale=scale
        )  # [B, H, Rq, d]
        return out.transpose(1, 2).reshape(b * r, h * d)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move."""
        self.src = self.src.index_select(0, rows)
        self.reordered = True

    def keep(self, inputs: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep only inputs ``inputs`` ([B'] int64), i.e. rows ``rows`` ([B' * R])."""
        self.k = self.k.index_select(1, inputs)
        self.v = self.v.index_select(1, inputs)
        self.src = self.src.index_select(0, rows)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.src.nbytes


KV_CACHES = {"beam-mask": BeamMaskCache, "backptr": BackPointerCache, "copy": CopyCache}
