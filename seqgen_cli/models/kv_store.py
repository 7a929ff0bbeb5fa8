"""The keys and values both KV caches hold (``models/kv_cache.py``), and what a cache does with them when inputs
leave (``keep``), are kept for later batches (``keep_into``), join lanes (``put``) or need wider lanes (``widen``).

:class:`KV`: every layer's keys and values, in tensors of its own (under ``torch.compile`` a write into a tensor of
its own stays an in-place ``index_put_``; one into a view of a tensor holding all layers becomes a copy of all of
it, ``tests/models/test_inductor.py``), inputs (lanes) along dim 0, positions along ``key_dim`` / ``value_dim``: a
cache's *generated* region, per row, written a position per step. :class:`FixedKV`: a cache's *fixed* region, one
per input (a source's cross-attention K/V, a prompt's K/V), attended by all its rows, with its additive bias.

Nothing here syncs with the device.
"""

from __future__ import annotations

import torch
from torch import Tensor


def select_into(dst: Tensor, src: Tensor, index: Tensor) -> None:
    """``dst := src.index_select(0, index)``, in ``dst``'s own storage (a kept buffer keeps its address)."""
    if dst.is_contiguous():
        torch.index_select(src, 0, index, out=dst)
    else:
        dst.copy_(src.index_select(0, index))


def keep_positions(x: Tensor, inputs: Tensor, dim: int, used: int, zero: bool) -> Tensor:
    """``x`` [B, ...] for inputs ``inputs`` ([B'] int64) only: a new tensor [B', ...] holding the ``used`` positions
    written so far (along ``dim``); the unwritten ones are zeros if ``zero`` (static step), else unset."""
    new = x.new_empty((inputs.shape[0], *x.shape[1:]))
    copy_positions(new, x, inputs, dim, used, zero)
    return new


def copy_positions(dst: Tensor, src: Tensor, inputs: Tensor, dim: int, used: int, zero: bool = True) -> None:
    """``dst`` [B', ...] (a kept buffer, written in place) := inputs ``inputs`` ([B'] int64) of ``src`` [B, ...]:
    the ``used`` positions written so far (along ``dim``); the rest zeros if ``zero``, else left as they are."""
    dst.narrow(dim, 0, used).copy_(src.narrow(dim, 0, used).index_select(0, inputs))
    if zero:
        dst.narrow(dim, used, src.shape[dim] - used).zero_()


class KV:
    """Every layer's keys and values (``keys[layer]``, ``values[layer]``), inputs along dim 0, positions along
    ``key_dim`` of the keys and ``value_dim`` of the values."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], key_dim: int, value_dim: int) -> None:
        self.keys, self.values, self.key_dim, self.value_dim = keys, values, key_dim, value_dim

    @classmethod
    def empty(
        cls,
        layers: int,
        key_shape: tuple[int, ...],
        value_shape: tuple[int, ...],
        key_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KV:
        """Unset tensors (positions are written before they are read; a static cache zeros them)."""
        keys = [torch.empty(key_shape, dtype=dtype, device=device) for _ in range(layers)]
        values = [torch.empty(value_shape, dtype=dtype, device=device) for _ in range(layers)]
        return cls(keys, values, key_dim, value_dim)

    def tensors(self) -> list[Tensor]:
        return self.keys + self.values

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.tensors())

    def keep(self, inputs: Tensor, used: int | None = None, zero: bool = False) -> None:
        """Keep inputs ``inputs`` ([B'] int64) only, in new tensors: the ``used`` positions written so far (the rest
        zeros if ``zero``, else unset), or all of them (``None``)."""
        if used is None:
            self.keys = [k.index_select(0, inputs) for k in self.keys]
            self.values = [v.index_select(0, inputs) for v in self.values]
        else:
            self.keys = [keep_positions(k, inputs, self.key_dim, used, zero) for k in self.keys]
            self.values = [keep_positions(v, inputs, self.value_dim, used, zero) for v in self.values]

    def keep_into(self, into: KV, inputs: Tensor, used: int | None = None) -> None:
        """:meth:`keep` into ``into``'s tensors (``inputs.shape[0]`` inputs, same positions), in place: the ``used``
        positions (the rest zeros), or all of them (``None``)."""
        pairs = ((into.keys, self.keys, self.key_dim), (into.values, self.values, self.value_dim))
        for dsts, srcs, dim in pairs:
            for dst, src in zip(dsts, srcs, strict=True):
                if used is None:
                    select_into(dst, src, inputs)
                else:
                    copy_positions(dst, src, inputs, dim, used)


class FixedKV(KV):
    """A cache's fixed region: keys [B, Hkv, d, W] (transposed) and values [B, Hkv, W, d] per layer (float32 where
    the CPU attends half precision) and the bias [B, 1, 1, W] (additive float32: 0 = attend, -inf = masked) of ``W``
    columns per input (lane)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], bias: Tensor) -> None:
        super().__init__(keys, values, key_dim=3, value_dim=2)
        self.bias = bias

    @property
    def width(self) -> int:
        return self.bias.shape[-1]

    def keep(self, inputs: Tensor, used: int | None = None, zero: bool = False) -> None:
        super().keep(inputs)
        self.bias = self.bias.index_select(0, inputs)

    def keep_into(self, into: KV, inputs: Tensor, used: int | None = None) -> None:
        assert isinstance(into, FixedKV)
        super().keep_into(into, inputs)
        select_into(into.bias, self.bias, inputs)

    def zeros(self, inputs: int) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Keys, values and bias like these for ``inputs`` inputs, zeros (what :meth:`keep_into` fills)."""
        keys = [k.new_zeros((inputs, *k.shape[1:])) for k in self.keys]
        values = [v.new_zeros((inputs, *v.shape[1:])) for v in self.values]
        return keys, values, self.bias.new_zeros((inputs, *self.bias.shape[1:]))

    def restart(self, keys: list[Tensor], values: list[Tensor], bias: Tensor) -> None:
        """Copied in place (a kept cache keeps its addresses): keys [B, Hkv, d, W], values [B, Hkv, W, d] per layer,
        bias [B, 1, 1, W]."""
        for dst, src in zip(self.keys + self.values, keys + values, strict=True):
            dst.copy_(src)
        self.bias.copy_(bias)

    def put(self, lanes: Tensor, keys: list[Tensor], values: list[Tensor], bias: Tensor) -> None:
        """Lanes ``lanes`` ([J] int64) take keys [J, Hkv, d, w] and values [J, Hkv, w, d] per layer in columns
        ``[0, w)`` (``w <= W``) and the bias [J, 1, 1, W] of all ``W``."""
        w = keys[0].shape[-1]
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[i].narrow(3, 0, w).index_copy_(0, lanes, k)  # [J, Hkv, d, w] of [L, Hkv, d, W]
            self.values[i].narrow(2, 0, w).index_copy_(0, lanes, v)  # [J, Hkv, w, d] of [L, Hkv, W, d]
        self.bias.index_copy_(0, lanes, bias)  # [J, 1, 1, W] of [L, 1, 1, W]

    def widen(self, width: int) -> None:
        """Room for ``width`` columns: every lane's grow on the right, masked (zero keys and values, -inf bias)."""
        grow = width - self.width
        if grow > 0:
            pad = torch.nn.functional.pad
            self.keys = [pad(k, (0, grow)) for k in self.keys]  # [L, Hkv, d, W + grow]
            self.values = [pad(v, (0, 0, 0, grow)) for v in self.values]  # [L, Hkv, W + grow, d]
            self.bias = pad(self.bias, (0, grow), value=float("-inf"))  # [L, 1, 1, W + grow]


def padding_bias(mask: Tensor, width: int) -> Tensor:
    """An attention mask [B, w] (0 = padding) as a fixed region's bias of ``width`` >= w columns, those past ``w``
    masked: [B, W] -> [B, 1, 1, W] (additive float32)."""
    bias = torch.full((mask.shape[0], width), float("-inf"), dtype=torch.float32, device=mask.device)
    bias[:, : mask.shape[1]].masked_fill_(mask != 0, 0.0)
    return bias[:, None, None, :]  # [B, 1, 1, W]
