"""Preallocated decoder self-attention cache, written in place, with two beam-reorder strategies.

Both hold ``[L, N, H, T, d]`` keys and values allocated once for the maximum length ``T`` (no growing
concatenation); step ``t`` writes position ``t`` of every row. They differ in what ``reorder`` costs:

* :class:`CopyCache` moves the filled prefix ``[:t]`` of every layer at reorder time (what transformers does,
  minus the concatenation), and attention reads a strided view of the buffer.
* :class:`BackPointerCache` never moves keys: a row's position ``p`` stays where the row that wrote it put it.
  ``src[n, p]`` (the beam, within row ``n``'s input, that wrote position ``p`` of row ``n``'s history) is
  reordered instead (``[N, T]`` int64, tiny), and attention reads keys through one gather per layer.

Positions are host integers (the step counter), so nothing here syncs with the device.
"""

from __future__ import annotations

import torch


class CopyCache:
    """Reorder copies the filled prefix; reads are strided views."""

    def __init__(
        self, layers: int, rows: int, heads: int, max_len: int, head_dim: int, rows_per_input: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (layers, rows, heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, N, H, T, d]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, N, H, T, d]
        self.len = 0  # filled positions

    def begin(self, t: int) -> None:
        """Step ``t`` starts (positions ``[0, t)`` are filled)."""
        self.len = t

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's ``k``/``v`` ([N, H, d]); return keys/values so far ([N, H, t+1, d] each)."""
        t = self.len
        self.k[layer, :, :, t] = k
        self.v[layer, :, :, t] = v
        return self.k[layer, :, :, : t + 1], self.v[layer, :, :, : t + 1]

    def reorder(self, rows: torch.Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64)."""
        t = self.len + 1  # called after step t wrote position t
        self.k[:, :, :, :t] = self.k[:, :, :, :t].index_select(1, rows)
        self.v[:, :, :, :t] = self.v[:, :, :, :t].index_select(1, rows)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows ``rows`` ([N'] int64, ascending)."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class BackPointerCache:
    """Reorder permutes back-pointers ([N, T] int64); reads gather keys through them."""

    def __init__(
        self, layers: int, rows: int, heads: int, max_len: int, head_dim: int, rows_per_input: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (layers, rows, heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, N, H, T, d]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, N, H, T, d]
        self.r = rows_per_input
        self.src = torch.zeros(rows, max_len, dtype=torch.long, device=device)  # [N, T] beam that wrote (n, p)
        self.len = 0
        self.reordered = False  # host flag: any reorder since start (greedy/sampling never gather)
        self._flat: torch.Tensor | None = None  # [N * H * (t+1)] gather index for this step

    def begin(self, t: int) -> None:
        """Step ``t`` starts: position ``t`` of row ``n`` will be written by row ``n`` itself."""
        self.len = t
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
        # flat index into a layer viewed as [N * H * T, d]: ((phys * H + h) * T + p)
        self._flat = ((phys[:, None, :] * h + heads[None, :, None]) * T + pos[None, None, :]).reshape(-1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's ``k``/``v`` ([N, H, d]); return keys/values in row order ([N, H, t+1, d] each)."""
        t = self.len
        kl, vl = self.k[layer], self.v[layer]  # [N, H, T, d]
        kl[:, :, t] = k
        vl[:, :, t] = v
        if self._flat is None:
            return kl[:, :, : t + 1], vl[:, :, : t + 1]
        n, h, _, d = kl.shape
        keys = kl.view(-1, d).index_select(0, self._flat).view(n, h, t + 1, d)
        values = vl.view(-1, d).index_select(0, self._flat).view(n, h, t + 1, d)
        return keys, values

    def reorder(self, rows: torch.Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move."""
        self.src = self.src.index_select(0, rows)
        self.reordered = True

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows ``rows`` (all rows of the kept inputs, ascending); beam indices stay valid."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)
        self.src = self.src.index_select(0, rows)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.src.nbytes


KV_CACHES = {"copy": CopyCache, "backptr": BackPointerCache}
