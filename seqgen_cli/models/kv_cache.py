"""The self-attention caches of the fast backends: preallocated, written in place, never moved by beam reordering.
Two classes over one :class:`~seqgen_cli.models.lane_table.LaneTable` (steps, back-pointers, spans: the table's
module docstring): :class:`EncoderDecoderKVCache` (the source's cross-attention K/V once per input, the decoder's own
per row) and :class:`DecoderOnlyKVCache` (a prompt's, once per input, then the generated ones); each holds a batch or
the refill engine's lanes (``search/refill.py``). They store; ``models/attention.py`` attends. One contract:
``update(layer, k, v, sliding)`` stores a step's keys and values and returns the blocks a query attends, each with
its additive bias.

Beams. The keys and values of a lane's ``R`` rows lie side by side (``[..., T, R, d]``), so all positions of a lane
are a free view of ``T * R`` keys: ``R`` times the score FLOPs on tiny matrices instead of copying or gathering the
cache every step.

Static caches (``make_static()``: capture, lanes): unwritten positions are zeros (masked keys must still be finite:
``nan - inf`` is ``nan``); off it they are never read, so they are allocated empty. Only ``keep`` (inputs leaving)
reallocates, copying the positions written so far. The capture path keeps its static caches for later batches
(``models/capture.py``): ``reset`` restarts one in place, ``keep_into`` copies what ``keep`` keeps into another
one's tensors, ``empty`` allocates one.

Every layer has its own K and V tensors. Under ``torch.compile`` a write through a view of one tensor holding
all layers is functionalized into a copy of that whole tensor per write (``index_put`` + ``select_scatter`` +
``copy_``); a write into a tensor of its own stays an in-place ``index_put_`` (``tests/models/test_inductor.py``).

Nothing here syncs with the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqgen_cli.models.attention import Block
from seqgen_cli.models.lane_table import LaneTable


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, positions: int) -> int:
    """Bytes of the keys and values of ``positions`` positions (summed over rows) in ``layers`` layers of
    ``kv_heads`` K/V heads (grouped-query attention: the K/V heads, not the query heads)."""
    return 2 * layers * kv_heads * head_dim * dtype.itemsize * positions


def keep_positions(cache: Tensor, inputs: Tensor, dim: int, used: int, zero: bool) -> Tensor:
    """``cache`` [B, ...] for inputs ``inputs`` ([B'] int64) only: a new tensor [B', ...] holding the ``used``
    positions written so far (along ``dim``); the unwritten ones are zeros if ``zero`` (static step), else unset."""
    new = cache.new_empty((inputs.shape[0], *cache.shape[1:]))
    copy_positions(new, cache, inputs, dim, used, zero)
    return new


def copy_positions(dst: Tensor, src: Tensor, inputs: Tensor, dim: int, used: int, zero: bool = True) -> None:
    """``dst`` [B', ...] (a kept buffer, written in place) := inputs ``inputs`` ([B'] int64) of ``src`` [B, ...]:
    the ``used`` positions written so far (along ``dim``); the rest zeros if ``zero``, else left as they are."""
    dst.narrow(dim, 0, used).copy_(src.narrow(dim, 0, used).index_select(0, inputs))
    if zero:
        dst.narrow(dim, used, src.shape[dim] - used).zero_()


def select_into(dst: Tensor, src: Tensor, index: Tensor) -> None:
    """``dst := src.index_select(0, index)``, in ``dst``'s own storage (a kept buffer keeps its address)."""
    if dst.is_contiguous():
        torch.index_select(src, 0, index, out=dst)
    else:
        dst.copy_(src.index_select(0, index))


def widened(keys: list[Tensor], values: list[Tensor], bias: Tensor, grow: int) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """A block of columns (a source's, a prompt region's) ``grow`` columns wider, masked, on the right: keys
    [L, Hkv, d, W] and values [L, Hkv, W, d] per layer (zeros), the additive bias [L, 1, 1, W] (-inf)."""
    pad = torch.nn.functional.pad
    keys = [pad(k, (0, grow)) for k in keys]  # [L, Hkv, d, W + grow]
    values = [pad(v, (0, 0, 0, grow)) for v in values]  # [L, Hkv, W + grow, d]
    return keys, values, pad(bias, (0, grow), value=float("-inf"))  # [L, 1, 1, W + grow]


class EncoderDecoderKVCache(LaneTable):
    """What an encoder-decoder's decoder attends: each layer's cross-attention keys and values, once per input (never
    per beam: an input's ``R`` rows query them together), and its self-attention keys and values, per row; a batch's
    (``B`` inputs) or ``L`` lanes, each at its own step (:meth:`lanes`, the refill engine's). Back-pointers and the
    relative position bias as one additive bias per step, one :func:`attention` per layer. Self-attention keys are
    not stored transposed: a [d, T*R] layout puts a head's d rows T*R floats apart, which at Marian's 511 positions
    cost more per step than the GEMM gained."""

    def __init__(
        self,
        cross_k: list[Tensor],
        cross_v: list[Tensor],
        cross_mask: Tensor,
        rows_per_input: int,
        max_len: int,
        window: int | None = None,
        lanes: bool = False,
    ) -> None:
        """Take the source's keys [B, Hkv, d, S] (transposed; float32 where the CPU scores half precision) and
        values [B, Hkv, S, d] per layer and its mask [B, 1, 1, S] (additive float32: 0 = attend, -inf = padding);
        allocate ``max_len`` self-attention positions of ``Hkv`` heads (grouped-query attention: fewer than the
        queries') in the values' dtype. ``window``: the sliding window of the layers that slide (a query sees the
        keys less than ``window`` positions before it); only where ``max_len`` positions reach past it. ``lanes``:
        ``B`` lanes at their own steps (static: zeros, a span bucket attended)."""
        b, h, _, d = cross_v[0].shape
        t, r, dtype, device = max_len, rows_per_input, cross_v[0].dtype, cross_v[0].device
        self.cross_k, self.cross_v, self.cross_mask = cross_k, cross_v, cross_mask
        # Unread positions need no zeros off the static path: empty pages are only touched as positions are written.
        # Allocated first: past any memory they fail at once, before the table's zeros are written.
        self.k = [torch.empty((b, h, t, r, d), dtype=dtype, device=device) for _ in cross_k]
        self.v = [torch.empty((b, h, t, r, d), dtype=dtype, device=device) for _ in cross_k]
        super().__init__(b, r, t, device, own_steps=lanes)
        self.heads, self.head_dim = h, d
        self.bias: Tensor | None = None  # additive float32, [[L',] B|L|1, 1|H, Rq, span*R]; None = all
        self.window = window if window is not None and max_len > window else None
        self.windowed: Tensor | None = None  # the sliding layers' bias (``bias`` and the window)
        self.rows = self.lane_rows(h)  # lanes: [L, H], where a head's position 0 lies (``write``)
        self.where: Tensor | None = None  # lanes: where this step's keys go, [L * H]
        if lanes:
            self.make_static()

    @classmethod
    def lanes(
        cls, layers: int, lanes: int, rows_per_input: int, heads: int, head_dim: int, max_len: int, width: int,
        key_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, window: int | None = None,
    ) -> EncoderDecoderKVCache:  # fmt: skip
        """``lanes`` empty lanes (sources of ``width`` columns until a wider one joins, :meth:`widen`). An empty lane
        attends one zero key: finite, ignored."""
        mask = torch.full((lanes, 1, 1, width), float("-inf"), device=device)  # [L, 1, 1, W]
        mask[..., 0] = 0.0
        keys = [torch.zeros((lanes, heads, head_dim, width), dtype=key_dtype, device=device) for _ in range(layers)]
        values = [torch.zeros((lanes, heads, width, head_dim), dtype=dtype, device=device) for _ in range(layers)]
        return cls(keys, values, mask, rows_per_input, max_len, window, lanes=True)

    @property
    def width(self) -> int:
        """The source columns (a batch's cross width, or the lanes')."""
        return self.cross_mask.shape[-1]

    def source(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """What ``layer``'s cross-attention attends: the source's keys [B, Hkv, d, S] (transposed), values
        [B, Hkv, S, d] and mask [B, 1, 1, S]."""
        return self.cross_k[layer], self.cross_v[layer], self.cross_mask

    def restart(self, keys: list[Tensor], values: list[Tensor], mask: Tensor) -> None:
        """A kept static cache (``models/capture.py``) takes a new batch's source (this cache's shape) as a new cache
        would, copied into its tensors; the self-attention positions restart."""
        for dst, src in zip(self.cross_k + self.cross_v, keys + values, strict=True):
            dst.copy_(src)  # [B, H, d, S], [B, H, S, d]
        self.cross_mask.copy_(mask)  # [B, 1, 1, S]
        self.reset()

    def widen(self, width: int) -> None:
        """Lanes: room for sources of ``width`` columns: every lane's grow, masked, on the right."""
        if width > self.width:
            grown = widened(self.cross_k, self.cross_v, self.cross_mask, width - self.width)
            self.cross_k, self.cross_v, self.cross_mask = grown

    def put_source(self, lanes: Tensor, keys: list[Tensor], values: list[Tensor], mask: Tensor) -> None:
        """Lanes: the sources of joiners taking lanes ``lanes`` ([J] int64), at the lanes' width: keys [J, H, d, W]
        and values [J, H, W, d] per layer, mask [J, 1, 1, W]."""
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.cross_k[i].index_copy_(0, lanes, k)
            self.cross_v[i].index_copy_(0, lanes, v)
        self.cross_mask.index_copy_(0, lanes, mask)

    def buffers(self) -> list[Tensor]:
        return self.k + self.v

    def begin(self, bias: Tensor | None = None) -> None:
        """A step starts (before the layers). ``bias``: the relative position bias [L', H, Q, T] of the rows' query
        positions against every key position (Q = 1: a batch's one step; Q = N: each row's lane's; L' = 1, shared
        by the layers, or one per layer)."""
        h, r, span, lanes = self.heads, self.r, self.span, self.steps.shape[0]
        if bias is not None:  # [L', H, Q, T] -> [L', 1|L, H, 1|Rq, span] -> [L', 1|L, H, 1|Rq, span*R]
            layers, q = bias.shape[0], bias.shape[2]
            bias = bias[..., :span].view(layers, h, lanes, q // lanes, span).transpose(1, 2).float()
            bias = bias[..., None].expand(-1, -1, -1, -1, -1, r).reshape(layers, lanes, h, q // lanes, span * r)
        if self.static or r > 1:
            self.claim()
            visible = self.visible(span).expand(-1, r, span, r).reshape(-1, 1, r, span * r)  # [B|L|1, 1, Rq, span*R]
            bias = torch.where(
                visible, 0.0 if bias is None else bias, float("-inf")
            )  # [B|L|1, 1, Rq, span*R], or with a bias [L', B|L, H, Rq, span*R]
        self.bias = bias  # None: a row sees all of the first t+1 positions (dynamic, R = 1, no relative bias)
        if self.window is not None:  # the sliding layers': keys ``window`` or more positions back masked too
            near = self.near(self.window)[:, :, None].expand(-1, span, r).reshape(-1, 1, 1, span * r)  # [1|L, 1, 1, span*R]
            bias = self.bias if self.bias is not None else torch.zeros(near.shape, device=near.device)
            self.windowed = bias.masked_fill(~near, float("-inf"))
        self.where = self.at_steps(self.rows)

    def layer_bias(self, layer: int, sliding: bool = False) -> Tensor | None:
        """The additive bias ``layer``'s self-attention adds to its scores (:meth:`begin`): [B|L|1, 1|H, Rq, span*R];
        ``sliding``: with its window (a layer that slides)."""
        bias = self.windowed if sliding and self.windowed is not None else self.bias
        if bias is None or bias.dim() == 4:
            return bias
        return bias[layer if bias.shape[0] > 1 else 0]

    def update(self, layer: int, k: Tensor, v: Tensor, sliding: bool = False) -> list[Block]:
        """Store this step's ``k``/``v`` ([N, H, d]) of ``layer``; returns what a query attends: one block, the keys
        (transposed) and values of the first ``span`` positions, [B, H, d, span*R] and [B, H, span*R, d] (views),
        and the bias (:meth:`layer_bias`; ``sliding``: a layer that slides)."""
        kl, vl = self.k[layer], self.v[layer]  # [B, H, T, R, d]
        b, h, r, d, span = kl.shape[0], self.heads, self.r, self.head_dim, self.span
        self.write(kl, 2, k.view(b, r, h, d).transpose(1, 2), self.where)  # [N, H, d] -> [B, H, R, d]
        self.write(vl, 2, v.view(b, r, h, d).transpose(1, 2), self.where)  # [N, H, d] -> [B, H, R, d]
        keys_t = kl[:, :, :span].view(b, h, span * r, d).transpose(-1, -2)  # contiguous per (b, h): no copy
        return [(keys_t, vl[:, :, :span].view(b, h, span * r, d), self.layer_bias(layer, sliding))]

    def keep(self, inputs: Tensor, rows: Tensor, used: int) -> None:
        """Keep only inputs ``inputs`` ([B'] int64), i.e. rows ``rows`` ([B' * R]); copies only the ``used``
        positions written so far."""
        self.cross_k = [k.index_select(0, inputs) for k in self.cross_k]
        self.cross_v = [v.index_select(0, inputs) for v in self.cross_v]
        self.cross_mask = self.cross_mask.index_select(0, inputs)
        for cache in (self.k, self.v):
            for i, x in enumerate(cache):
                cache[i] = keep_positions(x, inputs, 2, used, self.static)
        self.ptr = self.ptr.index_select(0, rows)

    def keep_into(self, into: EncoderDecoderKVCache, inputs: Tensor, rows: Tensor, used: int) -> None:
        """:meth:`keep` into the kept static cache ``into`` (``inputs.shape[0]`` inputs, same positions): the
        ``used`` positions written so far, the rest zeros, the back-pointers and the step, and their sources; ``self``
        is left as it is."""
        for dst, src in zip(into.cross_k + into.cross_v, self.cross_k + self.cross_v, strict=True):
            select_into(dst, src, inputs)
        select_into(into.cross_mask, self.cross_mask, inputs)
        for dst, src in zip(into.k + into.v, self.k + self.v, strict=True):
            copy_positions(dst, src, inputs, 2, used)
        select_into(into.ptr, self.ptr, rows)
        into.steps.copy_(self.steps)

    def empty(self, inputs: int) -> EncoderDecoderKVCache:
        """A static cache like this one for ``inputs`` inputs: zeros (what :meth:`keep_into` fills)."""
        keys = [k.new_zeros((inputs, *k.shape[1:])) for k in self.cross_k]
        values = [v.new_zeros((inputs, *v.shape[1:])) for v in self.cross_v]
        mask = self.cross_mask.new_zeros((inputs, *self.cross_mask.shape[1:]))
        cache = EncoderDecoderKVCache(keys, values, mask, self.r, self.max_len, self.window)
        cache.make_static()
        return cache

    @property
    def cross_nbytes(self) -> int:
        return sum(x.nbytes for x in self.cross_k + self.cross_v)

    @property
    def nbytes(self) -> int:
        """The self-attention positions' bytes and their back-pointers' (:attr:`cross_nbytes`: the sources')."""
        return sum(x.nbytes for x in self.k + self.v) + self.ptr.nbytes


class DecoderOnlyKVCache(LaneTable):
    """Decoder-only self-attention: the prompt's K/V once per input, shared by its beams, then generated K/V; a
    batch's, or ``L`` lanes at their own steps (:meth:`lanes`, the refill engine's).

    ``Hkv`` = K/V heads (never repeated for grouped-query attention). Keys are stored transposed: CPU ``bmm``
    is ~2x faster on a contiguous ``K^T`` than on a transposed view (docs/EXPERIMENTS.md, "Fast decoder-only
    decoders"). Prompt and generated scores share one float32 softmax (exact): a batch's in transformers' order,
    prompt first; lanes' generated first, so the columns of an input's real keys depend on its own width and the
    span only, and a wider prompt region (:meth:`widen`) only adds masked columns at the end.

    Lanes: the prompt region (``pk`` [L, Hkv, d, W], ``pv`` [L, Hkv, W, d], ``prompt_bias`` [L, 1, 1, W]) holds a
    joiner's prefill as it came, left-padded to its own width ``w`` (a function of its length, ``widths``), in
    columns ``[0, w)``; the rest is masked (zeros, or a previous input's stale keys).
    """

    def __init__(
        self,
        pk: list[Tensor],
        pv: list[Tensor],
        mask: Tensor,
        rows_per_input: int,
        max_len: int,
        window: int | None = None,
        lanes: bool = False,
    ) -> None:
        """Take the prefill's K/V ([B, Hkv, P, d] per layer) and mask [B, P]; allocate ``max_len`` positions.
        ``window``: the sliding window of the layers that slide (a query sees the keys less than ``window``
        positions before it; ``update(..., sliding=True)``). ``lanes``: ``B`` lanes at their own steps."""
        b, hkv, _, d = pk[0].shape
        r, max_len = rows_per_input, max(max_len, 1)
        dev, dt = pk[0].device, pk[0].dtype
        self.pk = [k.transpose(-1, -2).contiguous() for k in pk]  # [B, Hkv, d, P]; the prefill's copy is freed
        self.pv = pv  # [B, Hkv, P, d]
        # unread positions need no zeros off the static path; allocated first, as the encoder-decoder cache's
        self.gk = [torch.empty(b, hkv, d, max_len, r, device=dev, dtype=dt) for _ in pk]  # [B, Hkv, d, T, R]
        self.gv = [torch.empty(b, hkv, max_len, r, d, device=dev, dtype=dt) for _ in pk]  # [B, Hkv, T, R, d]
        super().__init__(b, r, max_len, dev, own_steps=lanes)
        bias = torch.zeros(mask.shape, device=dev, dtype=torch.float32)
        self.prompt_bias = bias.masked_fill(mask == 0, float("-inf"))[:, None, None, :]  # [B, 1, 1, P]
        self.gen_bias: Tensor | None = None  # [B|L|1, 1, Rq, 1, span*R] float32, 0 or -inf; None = all
        self.window = window
        self.windowed: tuple[Tensor, Tensor] | None = None  # the sliding layers' (prompt, generated) biases
        self.widths: Tensor | None = None  # lanes: [L], each joiner's own prompt width
        self.key_rows, self.value_rows = self.lane_rows(hkv * d), self.lane_rows(hkv)  # lanes: ``write``'s
        self.where_k = self.where_v = None  # lanes: where this step's keys and values go
        if lanes:
            self.make_static()
            self.widths = torch.zeros(b, dtype=torch.long, device=dev)

    @classmethod
    def lanes(
        cls, layers: int, lanes: int, rows_per_input: int, kv_heads: int, head_dim: int, max_len: int, width: int,
        dtype: torch.dtype, device: torch.device, window: int | None = None,
    ) -> DecoderOnlyKVCache:  # fmt: skip
        """``lanes`` empty lanes (prompt regions of ``width`` columns, all masked until a join)."""
        kv = [torch.zeros(lanes, kv_heads, width, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        mask = torch.zeros(lanes, width, dtype=torch.long, device=device)
        return cls(kv, [x.clone() for x in kv], mask, rows_per_input, max_len, window, lanes=True)

    def buffers(self) -> list[Tensor]:
        return self.gk + self.gv

    @property
    def width(self) -> int:
        return self.prompt_bias.shape[-1]

    def make_static(self) -> None:
        """As :meth:`LaneTable.make_static`; the prompt's values get storage of their own too (the prefill's are views
        of its projection's output, which they would keep alive: a kept cache lives on)."""
        super().make_static()
        self.pv = [v.contiguous() for v in self.pv]

    def restart(self, pk: list[Tensor], pv: list[Tensor], mask: Tensor) -> None:
        """A kept static cache (``models/capture.py``) takes a new batch's prefill (K/V [B, Hkv, P, d] per layer, mask
        [B, P]: this cache's shape) as a new cache would, copied into its tensors; the generated positions restart."""
        for i, (k, v) in enumerate(zip(pk, pv, strict=True)):
            self.pk[i].copy_(k.transpose(-1, -2))  # [B, Hkv, d, P]
            self.pv[i].copy_(v)  # [B, Hkv, P, d]
        bias = torch.zeros(mask.shape, device=mask.device, dtype=torch.float32)
        self.prompt_bias.copy_(bias.masked_fill(mask == 0, float("-inf"))[:, None, None, :])  # [B, 1, 1, P]
        self.reset()

    def widen(self, width: int) -> None:
        """Lanes: room for prompts of ``width`` positions: every lane's region grows, masked, on the right."""
        if width > self.width:
            self.pk, self.pv, self.prompt_bias = widened(self.pk, self.pv, self.prompt_bias, width - self.width)

    def put_prompt(self, lanes: Tensor, pk: list[Tensor], pv: list[Tensor], mask: Tensor) -> None:
        """Lanes: the prefill of joiners taking lanes ``lanes`` ([J] int64): K/V [J, Hkv, w, d] per layer and mask
        [J, w] (``w <= W``) go into columns ``[0, w)``; the rest of their region is masked."""
        assert self.widths is not None
        w = mask.shape[1]
        for i, (k, v) in enumerate(zip(pk, pv, strict=True)):
            self.pk[i].narrow(3, 0, w).index_copy_(0, lanes, k.transpose(-1, -2))  # [J, Hkv, d, w]
            self.pv[i].narrow(2, 0, w).index_copy_(0, lanes, v)  # [J, Hkv, w, d]
        bias = torch.full((mask.shape[0], self.width), float("-inf"), device=mask.device)  # [J, W]
        bias[:, :w].masked_fill_(mask != 0, 0.0)
        self.prompt_bias.index_copy_(0, lanes, bias[:, None, None, :])
        self.widths.index_fill_(0, lanes, w)

    def begin(self) -> None:
        """A step starts: the generated positions' bias once for all layers (and the sliding layers' biases), and
        where lanes write."""
        r, span = self.r, self.span
        self.gen_bias = None  # dynamic, R = 1: a row sees all of the first t+1 positions
        if self.static or r > 1:
            self.claim()
            visible = self.visible(span).expand(-1, r, span, r).reshape(-1, 1, r, 1, span * r)  # [B|L|1, 1, Rq, 1, span*R]
            zeros = torch.zeros(visible.shape, device=visible.device, dtype=torch.float32)
            self.gen_bias = zeros.masked_fill_(~visible, float("-inf"))
        if self.window is not None:
            self._window(self.width if self.widths is None else self.widths)
        self.where_k, self.where_v = self.at_steps(self.key_rows), self.at_steps(self.value_rows)

    def _window(self, width: Tensor | int) -> None:
        """The sliding layers' biases for queries at each lane's step over prompts of ``width`` columns ([L] per lane,
        or one int): a key ``window`` or more positions back is masked. Positions are the caches' columns (a prompt
        left-padded, generated keys after it), as transformers' masks count them; the distance between two real
        tokens is the same at any padding. Sets ``windowed``: (prompt [B|L, 1, 1, 1, P], generated
        [B|L|1, 1, Rq|1, 1, span*R])."""
        w, r, span = self.window, self.r, self.span
        step = self.steps[:, None]  # [1|L, 1]
        cols = torch.arange(self.width, device=step.device)  # [P]
        width = width[:, None] if isinstance(width, Tensor) else width
        near = cols > width + step - w  # [1|L, P]: prompt column j is less than `window` back
        prompt = self.prompt_bias.masked_fill(~near[:, None, None, :], float("-inf"))[:, :, :, None]
        near = self.near(w)[:, :, None].expand(-1, span, r).reshape(-1, 1, 1, 1, span * r)  # [1|L, 1, 1, 1, span*R]
        gen = torch.zeros(near.shape, device=near.device).masked_fill_(~near, float("-inf"))
        self.windowed = (prompt, gen if self.gen_bias is None else gen + self.gen_bias)

    def update(self, layer: int, k: Tensor, v: Tensor, sliding: bool = False) -> list[Block]:
        """Store this step's ``k``/``v`` ([N, Hkv, d], after any RoPE) of ``layer``; returns what a query attends, in
        score order (the class's docstring): the prompt's keys [B, Hkv, d, P], values [B, Hkv, P, d] and bias, and
        the first ``span`` generated positions' [B, Hkv, d, span*R], [B, Hkv, span*R, d] (views) and bias
        (``gen_bias``); ``sliding``: the biases of the sliding window (``windowed``)."""
        b, r, hkv, d, span = self.prompt_bias.shape[0], self.r, k.shape[1], k.shape[2], self.span
        gk, gv = self.gk[layer], self.gv[layer]  # [B, Hkv, d, T, R], [B, Hkv, T, R, d]
        self.write(gk, 3, k.view(b, r, hkv, d).permute(0, 2, 3, 1), self.where_k)  # keys [B, Hkv, d, R]
        self.write(gv, 2, v.view(b, r, hkv, d).transpose(1, 2), self.where_v)  # values [B, Hkv, R, d]
        keys_t = gk[:, :, :, :span].view(b, hkv, d, span * r)  # position-major: index s*R + beam
        vals = gv[:, :, :span].view(b, hkv, span * r, d)
        prompt_bias, gen_bias = (self.prompt_bias[:, :, :, None], self.gen_bias)
        if sliding and self.windowed is not None:
            prompt_bias, gen_bias = self.windowed
        prompt, generated = (self.pk[layer], self.pv[layer], prompt_bias), (keys_t, vals, gen_bias)
        return [prompt, generated] if self.ages is None else [generated, prompt]

    def keep(self, inputs: Tensor, rows: Tensor, used: int) -> None:
        """Keep inputs ``inputs`` ([B']), i.e. rows ``rows`` ([B' * R]); copies only the ``used`` positions."""
        for i in range(len(self.pk)):
            self.pk[i] = self.pk[i].index_select(0, inputs)
            self.pv[i] = self.pv[i].index_select(0, inputs)
            self.gk[i] = keep_positions(self.gk[i], inputs, 3, used, self.static)
            self.gv[i] = keep_positions(self.gv[i], inputs, 2, used, self.static)
        self.prompt_bias = self.prompt_bias.index_select(0, inputs)
        self.ptr = self.ptr.index_select(0, rows)

    def keep_into(self, into: DecoderOnlyKVCache, inputs: Tensor, rows: Tensor, used: int) -> None:
        """:meth:`keep` into the kept static cache ``into`` (``inputs.shape[0]`` inputs, same width and positions):
        the prompts, the ``used`` generated positions (the rest zeros), the back-pointers and the step; ``self`` is
        left as it is."""
        for i in range(len(self.pk)):
            select_into(into.pk[i], self.pk[i], inputs)
            select_into(into.pv[i], self.pv[i], inputs)
            copy_positions(into.gk[i], self.gk[i], inputs, 3, used)
            copy_positions(into.gv[i], self.gv[i], inputs, 2, used)
        select_into(into.prompt_bias, self.prompt_bias, inputs)
        select_into(into.ptr, self.ptr, rows)
        into.steps.copy_(self.steps)

    def empty(self, inputs: int) -> DecoderOnlyKVCache:
        """A static cache like this one for ``inputs`` inputs: zeros, prompts all masked (what :meth:`keep_into`
        fills)."""
        _, hkv, d, width = self.pk[0].shape
        kv = [self.pv[0].new_zeros(inputs, hkv, width, d) for _ in self.pk]
        mask = torch.zeros(inputs, width, dtype=torch.long, device=self.pv[0].device)
        cache = DecoderOnlyKVCache(kv, [x.clone() for x in kv], mask, self.r, self.max_len, self.window)
        cache.make_static()
        return cache

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.pk + self.pv + self.gk + self.gv) + self.ptr.nbytes
