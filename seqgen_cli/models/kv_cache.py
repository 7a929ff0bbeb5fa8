"""The self-attention caches of the fast backends: preallocated, written in place, never moved by beam reordering.

Both caches are one shape of thing over one :class:`~seqgen_cli.models.lane_table.LaneTable` (steps, back-pointers,
spans: the table's module docstring), their keys and values in the storage of ``models/kv_store.py``:

- ``fixed`` (:class:`~seqgen_cli.models.kv_store.FixedKV`): a region fixed per input and attended by all its ``R``
  rows, with its bias (padding masked): an encoder-decoder's source (the cross-attention K/V), a decoder-only's
  prompt (its prefill's K/V);
- ``generated`` (:class:`~seqgen_cli.models.kv_store.KV`): each row's own K/V, written a position per step.

:class:`EncoderDecoderKVCache` attends its fixed region through cross-attention (``source``),
:class:`DecoderOnlyKVCache` under one softmax with the generated positions. Each holds a batch or the refill
engine's lanes (``search/refill.py``). They store; ``models/attention.py`` attends. One contract
(:class:`KVCache`): ``begin(bias)`` once per step builds the biases every layer adds (``bias``: a relative position
bias, where the model has one); ``update(layer, k, v, sliding)`` stores a step's keys and values and returns the
blocks a query attends, each with its additive bias; ``restart``, ``put_fixed``, ``widen``, ``keep``,
``keep_into``, ``empty`` and ``nbytes_by_part`` alike on both.

Beams. The keys and values of a lane's ``R`` rows lie side by side (``[..., T, R, d]``), so all positions of a lane
are a free view of ``T * R`` keys: ``R`` times the score FLOPs on tiny matrices instead of copying or gathering the
cache every step.

Static caches (``make_static()``: capture, lanes): unwritten positions are zeros (masked keys must still be finite:
``nan - inf`` is ``nan``); off it they are never read, so they are allocated empty. Only ``keep`` (inputs leaving)
reallocates, copying the positions written so far. The capture path keeps its static caches for later batches
(``models/capture.py``): ``reset`` restarts one in place, ``keep_into`` copies what ``keep`` keeps into another
one's tensors, ``empty`` allocates one.

Every layer has its own K and V tensors (``models/kv_store.py``): under ``torch.compile`` a write through a view of
one tensor holding all layers is functionalized into a copy of that whole tensor per write (``index_put`` +
``select_scatter`` + ``copy_``); a write into a tensor of its own stays an in-place ``index_put_``
(``tests/models/test_inductor.py``).

Nothing here syncs with the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqgen_cli.models.attention import Block, kv_dtype
from seqgen_cli.models.kv_store import KV, FixedKV, padding_bias, select_into
from seqgen_cli.models.lane_table import LaneTable


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, positions: int) -> int:
    """Bytes of the keys and values of ``positions`` positions (summed over rows) in ``layers`` layers of
    ``kv_heads`` K/V heads (grouped-query attention: the K/V heads, not the query heads), held in ``dtype``
    (:func:`~seqgen_cli.models.attention.kv_dtype`)."""
    return layers * kv_heads * head_dim * 2 * dtype.itemsize * positions


class KVCache(LaneTable):
    """What both caches are (module docstring): the ``fixed`` region and the ``generated`` positions over the lane
    table, this step's biases (:meth:`begin`) and where lanes write; restarted, joined, widened and kept alike."""

    def __init__(self, fixed: FixedKV, generated: KV, r: int, max_len: int, window: int | None, own: bool):
        """Over a table of ``r`` rows per lane (input), ``max_len`` positions; ``own``: a step counter per lane."""
        self.fixed, self.generated, self.window = fixed, generated, window
        first = generated.keys[0]
        super().__init__(first.shape[0], r, max_len, first.device, own_steps=own)
        self.generated_bias: Tensor | None = None  # this step's, of the generated positions; None: all seen
        self.sliding_bias: Tensor | None = None  # the same in the layers that slide (``window``)
        self.key_rows: Tensor | None = None  # lanes: where each lane's generated keys start (``lane_rows``)
        self.value_rows: Tensor | None = None  # the same for the values
        self.where_k: Tensor | None = None  # lanes: where this step's keys go (``at_steps``); None: a batch
        self.where_v: Tensor | None = None  # the same for the values

    def begin(self, bias: Tensor | None = None) -> None:
        """A step starts (before the layers): the biases every layer adds, built once, and where lanes write.
        ``bias``: a relative position bias [L', H, Q, T] (an encoder-decoder with one), else ``None``."""
        raise NotImplementedError

    def update(self, layer: int, k: Tensor, v: Tensor, sliding: bool = False) -> list[Block]:
        """Store this step's ``k``/``v`` ([N, Hkv, d]) of ``layer``; returns the blocks a query attends, each with
        its additive bias (``sliding``: a layer that slides)."""
        raise NotImplementedError

    def buffers(self) -> list[Tensor]:
        return self.generated.tensors()

    def make_static(self) -> None:
        """As :meth:`LaneTable.make_static`; the fixed values get storage of their own too (a prefill's are views of
        its projection's output, which they would keep alive: a kept cache lives on)."""
        super().make_static()
        self.fixed.values = [v.contiguous() for v in self.fixed.values]

    @property
    def width(self) -> int:
        """The fixed region's columns (a batch's source or prompt width, or the lanes')."""
        return self.fixed.width

    def fixed_inputs(
        self, keys: list[Tensor], values: list[Tensor], mask: Tensor
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """What the backend hands over (:meth:`restart`, :meth:`put_fixed`) as the fixed region holds it: keys
        [B, Hkv, d, w] (transposed), values [B, Hkv, w, d] per layer, bias [B, 1, 1, W]."""
        return keys, values, mask

    def restart(self, keys: list[Tensor], values: list[Tensor], mask: Tensor) -> None:
        """A kept static cache (``models/capture.py``) takes a new batch's fixed region (this cache's shape) as a
        new cache would, copied into its tensors; the generated positions restart."""
        self.fixed.restart(*self.fixed_inputs(keys, values, mask))
        self.reset()

    def put_fixed(self, lanes: Tensor, keys: list[Tensor], values: list[Tensor], mask: Tensor) -> None:
        """Lanes: the fixed regions of joiners taking lanes ``lanes`` ([J] int64), in columns ``[0, w)``; the rest
        of their lanes' columns masked."""
        self.fixed.put(lanes, *self.fixed_inputs(keys, values, mask))

    def widen(self, width: int) -> None:
        """Lanes: room for fixed regions of ``width`` columns: every lane's grows, masked, on the right."""
        self.fixed.widen(width)

    def keep(self, inputs: Tensor, rows: Tensor, used: int) -> None:
        """Keep only inputs ``inputs`` ([B'] int64), i.e. rows ``rows`` ([B' * R]); copies only the ``used``
        generated positions written so far (zeros after them on the static path)."""
        self.fixed.keep(inputs)
        self.generated.keep(inputs, used, zero=self.static)
        self.ptr = self.ptr.index_select(0, rows)

    def keep_into(self, into: KVCache, inputs: Tensor, rows: Tensor, used: int) -> None:
        """:meth:`keep` into the kept static cache ``into`` (``inputs.shape[0]`` inputs, same width and positions):
        the fixed regions, the ``used`` generated positions (the rest zeros), the back-pointers and the step;
        ``self`` is left as it is."""
        self.fixed.keep_into(into.fixed, inputs)
        self.generated.keep_into(into.generated, inputs, used)
        select_into(into.ptr, self.ptr, rows)
        into.steps.copy_(self.steps)

    def nbytes_by_part(self) -> dict[str, int]:
        """Bytes held: the fixed region's K/V (per input) and its bias, the generated K/V, the back-pointers."""
        return {
            "fixed": self.fixed.nbytes,
            "fixed_bias": self.fixed.bias.nbytes,
            "generated": self.generated.nbytes,
            "pointers": self.ptr.nbytes,
        }


class EncoderDecoderKVCache(KVCache):
    """What an encoder-decoder's decoder attends: the fixed region is each layer's cross-attention keys and values,
    once per input (never per beam: an input's ``R`` rows query them together; :meth:`source`), the generated
    positions its self-attention keys and values [B, H, T, R, d], per row; a batch's (``B`` inputs) or ``L`` lanes,
    each at its own step (:meth:`lanes`, the refill engine's). Back-pointers and the relative position bias as one
    additive bias per step, one :func:`attention` per layer. Generated keys are not stored transposed: a [d, T*R]
    layout puts a head's d rows T*R floats apart, which at Marian's 511 positions cost more per step than the GEMM
    gained."""

    def __init__(
        self,
        keys: list[Tensor],
        values: list[Tensor],
        mask: Tensor,
        rows_per_input: int,
        max_len: int,
        window: int | None = None,
        lanes: bool = False,
    ) -> None:
        """Take the source's keys [B, Hkv, d, S] (transposed) and values [B, Hkv, S, d] per layer, in
        :func:`~seqgen_cli.models.attention.kv_dtype`, and its mask [B, 1, 1, S] (additive float32: 0 = attend, -inf
        = padding); allocate ``max_len`` self-attention positions of ``Hkv`` heads (grouped-query attention: fewer
        than the queries') in that dtype. ``window``: the sliding window of the layers that slide (a query sees the
        keys less than ``window`` positions before it); only where ``max_len`` positions reach past it. ``lanes``:
        ``B`` lanes at their own steps (static: zeros, a span bucket attended)."""
        b, h, _, d = values[0].shape
        # Unread positions need no zeros off the static path: empty pages are only touched as positions are written.
        # Allocated first: past any memory they fail at once, before the table's zeros are written.
        shape = (b, h, max_len, rows_per_input, d)  # [B, H, T, R, d]: keys and values alike
        dtype, device = values[0].dtype, values[0].device
        generated = KV.empty(len(keys), shape, shape, 2, 2, dtype, device)
        window = window if window is not None and max_len > window else None
        super().__init__(FixedKV(keys, values, mask), generated, rows_per_input, max_len, window, lanes)
        self.heads, self.head_dim = h, d
        self.key_rows = self.value_rows = self.lane_rows(h)  # lanes: [L, H], where a head's position 0 lies
        if lanes:
            self.make_static()

    @classmethod
    def lanes(
        cls,
        layers: int,
        lanes: int,
        rows_per_input: int,
        heads: int,
        head_dim: int,
        max_len: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        window: int | None = None,
    ) -> EncoderDecoderKVCache:
        """``lanes`` empty lanes (sources of ``width`` columns until a wider one joins, :meth:`widen`), K/V in
        ``dtype`` (:func:`~seqgen_cli.models.attention.kv_dtype`). An empty lane attends one zero key: finite,
        ignored."""
        mask = torch.full((lanes, 1, 1, width), float("-inf"), device=device)  # [L, 1, 1, W]
        mask[..., 0] = 0.0
        kv = (lanes, heads, head_dim, width), (lanes, heads, width, head_dim)  # [L, H, d, W], [L, H, W, d]
        keys = [torch.zeros(kv[0], dtype=dtype, device=device) for _ in range(layers)]
        values = [torch.zeros(kv[1], dtype=dtype, device=device) for _ in range(layers)]
        return cls(keys, values, mask, rows_per_input, max_len, window, lanes=True)

    def source(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """What ``layer``'s cross-attention attends: the source's keys [B, Hkv, d, S] (transposed), values
        [B, Hkv, S, d] and mask [B, 1, 1, S]."""
        return self.fixed.keys[layer], self.fixed.values[layer], self.fixed.bias

    def begin(self, bias: Tensor | None = None) -> None:
        """A step starts (before the layers). ``bias``: the relative position bias [L', H, Q, T] of the rows' query
        positions against every key position (Q = 1: a batch's one step; Q = N: each row's lane's; L' = 1, shared
        by the layers, or one per layer)."""
        h, r, span, lanes = self.heads, self.r, self.span, self.steps.shape[0]
        if bias is not None:  # [L', H, Q, T] -> [L', 1|L, H, 1|Rq, span] -> [L', 1|L, H, 1|Rq, span*R]
            layers, q = bias.shape[0], bias.shape[2] // lanes  # q: query positions per lane (1|Rq)
            bias = bias[..., :span].view(layers, h, lanes, q, span).transpose(1, 2).float()
            bias = bias[..., None].expand(-1, -1, -1, -1, -1, r).reshape(layers, lanes, h, q, span * r)
        self.claim()
        seen = self.visible_keys()  # [B|L|1, Rq, span*R]; None: a row sees all of the first t+1 positions
        if seen is not None:  # [B|L|1, 1, Rq, span*R], or with a bias [L', B|L, H, Rq, span*R]
            bias = torch.where(seen[:, None], 0.0 if bias is None else bias, float("-inf"))
        self.generated_bias = bias
        if self.window is not None:  # the sliding layers': keys ``window`` or more positions back masked too
            near = self.near_keys(self.window)[:, None, None]  # [1|L, 1, 1, span*R]
            bias = bias if bias is not None else torch.zeros(near.shape, device=near.device)
            self.sliding_bias = bias.masked_fill(~near, float("-inf"))
        self.where_k = self.where_v = self.at_steps(self.key_rows)

    def layer_bias(self, layer: int, sliding: bool = False) -> Tensor | None:
        """The additive bias ``layer``'s self-attention adds to its scores (:meth:`begin`): [B|L|1, 1|H, Rq, span*R];
        ``sliding``: with its window (a layer that slides)."""
        bias = self.sliding_bias if sliding and self.sliding_bias is not None else self.generated_bias
        if bias is None or bias.dim() == 4:
            return bias
        return bias[layer if bias.shape[0] > 1 else 0]

    def update(self, layer: int, k: Tensor, v: Tensor, sliding: bool = False) -> list[Block]:
        """Store this step's ``k``/``v`` ([N, H, d]) of ``layer``; returns one block: the keys (transposed) and
        values of the first ``span`` positions, [B, H, d, span*R] and [B, H, span*R, d] (views), and the bias
        (:meth:`layer_bias`)."""
        keys, values = self.generated.keys[layer], self.generated.values[layer]  # [B, H, T, R, d]
        b, h, r, d, span = keys.shape[0], self.heads, self.r, self.head_dim, self.span
        k, v = k.to(keys.dtype), v.to(values.dtype)  # float32 where the CPU attends half precision, else no-ops
        self.write(keys, 2, k.view(b, r, h, d).transpose(1, 2), self.where_k)  # [N, H, d] -> [B, H, R, d]
        self.write(values, 2, v.view(b, r, h, d).transpose(1, 2), self.where_v)  # [N, H, d] -> [B, H, R, d]
        keys_t = keys[:, :, :span].view(b, h, span * r, d).transpose(-1, -2)  # contiguous per (b, h): no copy
        return [(keys_t, values[:, :, :span].view(b, h, span * r, d), self.layer_bias(layer, sliding))]

    def empty(self, inputs: int) -> EncoderDecoderKVCache:
        """A static cache like this one for ``inputs`` inputs: zeros (what :meth:`keep_into` fills)."""
        cache = EncoderDecoderKVCache(*self.fixed.zeros(inputs), self.r, self.max_len, self.window)
        cache.make_static()
        return cache


class DecoderOnlyKVCache(KVCache):
    """Decoder-only self-attention: the fixed region is the prompt's K/V, once per input, shared by its beams, then
    the generated K/V; a batch's, or ``L`` lanes at their own steps (:meth:`lanes`, the refill engine's).

    ``Hkv`` = K/V heads (never repeated for grouped-query attention). Keys are stored transposed, generated ones too
    ([B, Hkv, d, T, R]): CPU ``bmm`` is ~2x faster on a contiguous ``K^T`` than on a transposed view
    (docs/EXPERIMENTS.md, "Fast decoder-only decoders"). Prompt and generated scores share one float32 softmax
    (exact): a batch's in transformers' order, prompt first; lanes' generated first, so the columns of an input's
    real keys depend on its own width and the span only, and a wider fixed region (:meth:`widen`) only adds masked
    columns at the end.

    Lanes: a lane's fixed region (``W`` columns) holds a joiner's prefill as it came, left-padded to its own width
    ``w`` (a function of its length, ``widths``), in columns ``[0, w)``; the rest is masked (zeros, or a previous
    input's stale keys).
    """

    def __init__(
        self,
        keys: list[Tensor],
        values: list[Tensor],
        mask: Tensor,
        rows_per_input: int,
        max_len: int,
        window: int | None = None,
        lanes: bool = False,
    ) -> None:
        """Take the prefill's K/V ([B, Hkv, W, d] per layer) and mask [B, W]; allocate ``max_len`` positions.
        ``window``: the sliding window of the layers that slide (a query sees the keys less than ``window``
        positions before it; ``update(..., sliding=True)``). ``lanes``: ``B`` lanes at their own steps."""
        b, hkv, _, d = keys[0].shape
        r, max_len = rows_per_input, max(max_len, 1)
        dtype = kv_dtype(keys[0].dtype, keys[0].device)  # float32 where the CPU attends half precision
        # [B, Hkv, W, d] -> [B, Hkv, d, W]: one copy (the prefill's freed), in the cache's dtype
        keys_t = [k.transpose(-1, -2).contiguous().to(dtype) for k in keys]
        values = [v.to(dtype) for v in values]  # a no-op where the dtype is the prefill's
        # unread positions need no zeros off the static path; allocated first, as the encoder-decoder cache's
        shapes = (b, hkv, d, max_len, r), (b, hkv, max_len, r, d)  # [B, Hkv, d, T, R], [B, Hkv, T, R, d]
        generated = KV.empty(len(keys), *shapes, 3, 2, dtype, keys[0].device)
        fixed = FixedKV(keys_t, values, padding_bias(mask, mask.shape[1]))  # bias [B, 1, 1, W]
        super().__init__(fixed, generated, r, max_len, window, lanes)
        self.sliding_fixed_bias: Tensor | None = None  # the sliding layers' prompt bias (``window``)
        self.widths = torch.zeros(b, dtype=torch.long, device=keys[0].device) if lanes else None  # lanes: [L]
        self.key_rows, self.value_rows = self.lane_rows(hkv * d), self.lane_rows(hkv)  # lanes: [L, Hkv*d|Hkv]
        if lanes:
            self.make_static()

    @classmethod
    def lanes(
        cls,
        layers: int,
        lanes: int,
        rows_per_input: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        window: int | None = None,
    ) -> DecoderOnlyKVCache:
        """``lanes`` empty lanes (fixed regions of ``width`` columns, all masked until a join)."""
        shape = (lanes, kv_heads, width, head_dim)  # [L, Hkv, W, d]
        kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        mask = torch.zeros(lanes, width, dtype=torch.long, device=device)
        return cls(kv, [x.clone() for x in kv], mask, rows_per_input, max_len, window, lanes=True)

    def fixed_inputs(
        self, keys: list[Tensor], values: list[Tensor], mask: Tensor
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """A prefill's K/V [B, Hkv, w, d] per layer and mask [B, w] (``w <= W``) as the fixed region holds them."""
        dtype = self.fixed.keys[0].dtype
        keys_t = [k.transpose(-1, -2).to(dtype) for k in keys]  # [B, Hkv, d, w]
        return keys_t, [v.to(dtype) for v in values], padding_bias(mask, self.width)

    def put_fixed(self, lanes: Tensor, keys: list[Tensor], values: list[Tensor], mask: Tensor) -> None:
        assert self.widths is not None
        super().put_fixed(lanes, keys, values, mask)
        self.widths.index_fill_(0, lanes, mask.shape[1])

    def begin(self, bias: Tensor | None = None) -> None:
        """A step starts: the generated positions' bias once for all layers (and the sliding layers' biases), and
        where lanes write. No decoder-only family has a relative position bias (``bias``)."""
        assert bias is None, "a decoder-only cache takes no relative position bias"
        self.claim()
        seen = self.visible_keys()  # [B|L|1, Rq, span*R]; None: a row sees all of the first t+1 positions
        self.generated_bias = None
        if seen is not None:
            seen = seen[:, None, :, None]  # [B|L|1, 1, Rq, 1, span*R]
            zeros = torch.zeros(seen.shape, device=seen.device, dtype=torch.float32)
            self.generated_bias = zeros.masked_fill_(~seen, float("-inf"))
        if self.window is not None:  # the sliding layers': columns and keys ``window`` or more back masked
            width = self.width if self.widths is None else self.widths  # a batch's, or each lane's own [L]
            near = self.near_columns(self.window, width, self.width)[:, None, None, :]  # [1|L, 1, 1, W]
            fixed = self.fixed.bias.masked_fill(~near, float("-inf"))  # [B|L, 1, 1, W]
            self.sliding_fixed_bias = fixed[:, :, :, None]  # [B|L, 1, 1, 1, W]
            near = self.near_keys(self.window)[:, None, None, None]  # [1|L, 1, 1, 1, span*R]
            generated = torch.zeros(near.shape, device=near.device).masked_fill_(~near, float("-inf"))
            self.sliding_bias = generated if self.generated_bias is None else generated + self.generated_bias
        self.where_k, self.where_v = self.at_steps(self.key_rows), self.at_steps(self.value_rows)

    def update(self, layer: int, k: Tensor, v: Tensor, sliding: bool = False) -> list[Block]:
        """Store this step's ``k``/``v`` ([N, Hkv, d], after any RoPE) of ``layer``; returns what a query attends, in
        score order (the class's docstring): the prompt's keys [B, Hkv, d, W], values [B, Hkv, W, d] and bias, and
        the first ``span`` generated positions' [B, Hkv, d, span*R], [B, Hkv, span*R, d] (views) and bias;
        ``sliding``: the biases of the sliding window."""
        b, r, hkv, d, span = self.fixed.bias.shape[0], self.r, k.shape[1], k.shape[2], self.span
        # keys [B, Hkv, d, T, R], values [B, Hkv, T, R, d]; this step's k/v [N, Hkv, d]
        keys, values = self.generated.keys[layer], self.generated.values[layer]
        k, v = k.to(keys.dtype), v.to(values.dtype)  # float32 where the CPU attends half precision, else no-ops
        self.write(keys, 3, k.view(b, r, hkv, d).permute(0, 2, 3, 1), self.where_k)  # [B, Hkv, d, R]
        self.write(values, 2, v.view(b, r, hkv, d).transpose(1, 2), self.where_v)  # [B, Hkv, R, d]
        keys_t = keys[:, :, :, :span].view(b, hkv, d, span * r)  # position-major: index s*R + beam
        values = values[:, :, :span].view(b, hkv, span * r, d)
        fixed_bias, generated_bias = self.fixed.bias[:, :, :, None], self.generated_bias  # [B, 1, 1, 1, W]
        if sliding and self.sliding_bias is not None:
            fixed_bias, generated_bias = self.sliding_fixed_bias, self.sliding_bias
        fixed = (self.fixed.keys[layer], self.fixed.values[layer], fixed_bias)
        generated = (keys_t, values, generated_bias)
        return [generated, fixed] if self.own_steps else [fixed, generated]

    def empty(self, inputs: int) -> DecoderOnlyKVCache:
        """A static cache like this one for ``inputs`` inputs: zeros, prompts all masked (what :meth:`keep_into`
        fills)."""
        _, hkv, d, width = self.fixed.keys[0].shape
        kv = [self.fixed.values[0].new_zeros(inputs, hkv, width, d) for _ in self.fixed.keys]
        mask = torch.zeros(inputs, width, dtype=torch.long, device=kv[0].device)
        cache = DecoderOnlyKVCache(kv, [x.clone() for x in kv], mask, self.r, self.max_len, self.window)
        cache.make_static()
        return cache
