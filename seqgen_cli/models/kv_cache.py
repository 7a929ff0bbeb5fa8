"""Self-attention caches of the fast backends: preallocated, written in place, never moved by beam reordering.

Both hold ``T = max_new_tokens`` slots per row; step ``t`` writes slot ``t`` of every row. The keys and values
of an input's ``R`` beams lie side by side (``[..., T, R, d]``), so all slots of an input are a free view of
``T * R`` keys. Reordering moves only back-pointers (:class:`BackPointers`); each query beam scores against all
its input's keys and a mask built from the back-pointers keeps its own history. That costs ``R`` times the
score FLOPs on tiny matrices instead of copying or gathering the cache every step (measured against both in
docs/BENCHMARKS.md, "Self-attention cache: reorder strategies").

Static shapes (graph capture). A step reads the slot it writes from a device tensor (``slot``,
[1] int64), writes with ``index_copy_``, and the visibility mask is built from tensors (slots ``<= slot``, and
the back-pointers). With ``static`` (set by ``make_static()``, which ``models/capture.py`` calls) it attends
over a span bucket of slots (``shapes.span_bucket``: a power of two from 64, at most ``T``): no host integer that
changes per step reaches the step's tensor work, so it can be compiled or captured once per bucket and replayed,
and a step reads at most twice the slots written. Otherwise (every eager step, CPU or CUDA) it attends over the
``t + 1`` slots written so far (``span``, set by the host-side :meth:`check`), cheaper than all ``T`` slots
(docs/BENCHMARKS.md, "Static vs dynamic step on the CPU"). Reordering is in place; only ``keep`` (inputs
leaving) reallocates, copying only the slots written so far. The capture path keeps its static caches for later
batches (``models/capture.py``): ``reset`` restarts one in place, ``keep_into`` copies what ``keep`` keeps into
another one's tensors, ``empty`` allocates one. On the static path unwritten slots are zeros (masked keys must
still be finite: ``nan - inf`` is ``nan``); off it they are never read, so they are allocated empty.

Every layer has its own K and V tensors. Under ``torch.compile`` a write through a view of one tensor holding
all layers is functionalized into a copy of that whole tensor per write (``index_put`` + ``select_scatter`` +
``copy_``); a write into a tensor of its own stays an in-place ``index_put_`` (``tests/test_inductor.py``).

Nothing here syncs with the device. Rows are input-major (``row = b * R + k``, see
``seqgen_cli/search/protocol.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.models.attention import attention, scores32
from seqgen_cli.shapes import span_bucket


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, slots: int) -> int:
    """Bytes of the keys and values of ``slots`` token positions (summed over rows) in ``layers`` layers of
    ``kv_heads`` K/V heads (grouped-query attention: the K/V heads, not the query heads)."""
    return 2 * layers * kv_heads * head_dim * dtype.itemsize * slots


def pointer_bytes(rows: int, max_len: int) -> int:
    """Bytes of :class:`BackPointers` for ``rows`` rows and ``max_len`` slots (int64)."""
    return rows * max_len * 8


def check_slot(t: int, max_len: int) -> None:
    """Host-side bounds check before step ``t``: ``ValueError`` past the ``max_len`` slots of ``start()``."""
    if t >= max_len:
        raise ValueError(f"step {t} beyond the {max_len} positions allocated by start()")


Decode = Callable[[Any, Tensor], Tensor]  # (backend state, tokens [N]) -> logits [N, V]


def run_step(decode: Decode, state: Any, tokens: Tensor) -> Tensor:
    """One decode step of a fast backend, a batch's or every lane's: ``decode`` (the tensor work, eager or
    compiled: ``models/capture.py``) between the host bookkeeping.

    ``state`` has ``t`` (host step counter) and ``cache`` (``check(t)``: bounds and the span this step attends;
    ``advance()``); tokens [N] -> logits [N, V]."""
    state.cache.check(state.t)
    logits = decode(state, tokens)
    state.t += 1
    state.cache.advance()
    return logits


class BackPointers:
    """``ptr[n, s]``: the beam (``0..R-1``, same input) whose slot ``s`` is in row ``n``'s history."""

    def __init__(self, inputs: int, rows_per_input: int, max_len: int, device: torch.device) -> None:
        self.r = rows_per_input
        self.ptr = torch.zeros(inputs * rows_per_input, max_len, dtype=torch.long, device=device)  # [N, T]
        self.beams = torch.arange(rows_per_input, device=device)  # [R]
        self.slots = torch.arange(max_len, device=device)  # [T]

    def visible(self, slot: Tensor, span: int) -> Tensor:
        """This step writes slot ``slot`` ([1] int64) of every row. Returns which of the first ``span`` slots
        each query row sees: bool [B, Rq, span, R] (slot ``s`` of beam ``r``); [1, 1, span, 1] if R = 1."""
        n = self.ptr.shape[0]
        r, b = self.r, n // self.r
        upto = (self.slots[:span] <= slot)[:, None]  # [span, 1]
        if r == 1:
            return upto.view(1, 1, span, 1)
        self.ptr.index_copy_(1, slot, self.beams.repeat(b)[:, None])  # [N, 1]: each row's own beam
        return (self.ptr[:, :span].view(b, r, span, 1) == self.beams) & upto  # [B, Rq, span, R]

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input); in place."""
        self.ptr.copy_(self.ptr.index_select(0, rows))

    def keep(self, rows: Tensor) -> None:
        """Keep rows ``rows`` ([B' * R], whole inputs): beam indices stay valid within an input."""
        self.ptr = self.ptr.index_select(0, rows)


def keep_slots(cache: Tensor, inputs: Tensor, dim: int, used: int, zero: bool) -> Tensor:
    """``cache`` [B, ...] for inputs ``inputs`` ([B'] int64) only: a new tensor [B', ...] holding the ``used``
    slots written so far (along ``dim``); the unwritten ones are zeros if ``zero`` (static step), else unset."""
    new = cache.new_empty((inputs.shape[0], *cache.shape[1:]))
    copy_slots(new, cache, inputs, dim, used, zero)
    return new


def copy_slots(dst: Tensor, src: Tensor, inputs: Tensor, dim: int, used: int, zero: bool = True) -> None:
    """``dst`` [B', ...] (a kept buffer, written in place) := inputs ``inputs`` ([B'] int64) of ``src`` [B, ...]:
    the ``used`` slots written so far (along ``dim``); the rest zeros if ``zero``, else left as they are."""
    dst.narrow(dim, 0, used).copy_(src.narrow(dim, 0, used).index_select(0, inputs))
    if zero:
        dst.narrow(dim, used, src.shape[dim] - used).zero_()


def select_into(dst: Tensor, src: Tensor, index: Tensor) -> None:
    """``dst := src.index_select(0, index)``, in ``dst``'s own storage (a kept buffer keeps its address)."""
    if dst.is_contiguous():
        torch.index_select(src, 0, index, out=dst)
    else:
        dst.copy_(src.index_select(0, index))


def write_slot(cache: Tensor, dim: int, new: Tensor, slot: Tensor, at: int | None) -> None:
    """Store ``new`` (``cache`` without ``dim``) at slot ``slot`` ([1] int64, on the device) along ``dim``;
    ``at``: the same slot as a host int off the static path, where the write is a plain view copy."""
    if at is None:
        cache.index_copy_(dim, slot, new.unsqueeze(dim))
    else:
        cache.select(dim, at).copy_(new)


class GeneratedSlots:
    """What both generated-token caches share: ``max_len`` slots, of which a step attends ``span``."""

    static: bool  # attend the t+1 slots written so far; a span bucket of T after make_static() (capture)
    max_len: int
    span: int  # slots this step attends (host int; a span bucket if static)
    ptrs: BackPointers
    slot: Tensor  # [1] int64: the slot this step writes

    def buffers(self) -> list[Tensor]:
        """The per-layer generated K/V tensors."""
        raise NotImplementedError

    def make_static(self) -> None:
        """Attend a span bucket of slots from now on (``shapes.span_bucket``: graph capture, before the first step):
        zero the unwritten."""
        if not self.static:
            for x in self.buffers():
                x.zero_()
            self.static = True

    def reset(self) -> None:
        """A kept static cache (``models/capture.py``) takes a new batch, as a new cache would start: every slot
        unwritten (zeros), back-pointers cleared, the next step writes slot 0. In place: no tensor is allocated."""
        for x in self.buffers():
            x.zero_()
        self.ptrs.ptr.zero_()
        self.slot.zero_()
        self.span = self.max_len

    def now(self, t: int) -> int:
        """The step that sizes step ``t``'s span: ``t`` itself (every row of a batch is at one step)."""
        return t

    def check(self, t: int) -> None:
        """Host: step ``t`` is about to run (``ValueError`` past the allocated slots); sets ``span``."""
        check_slot(t, self.max_len)
        self.span = span_bucket(t, self.max_len) if self.static else t + 1


class EncoderDecoderKVCache(GeneratedSlots):
    """Self-attention of the encoder-decoder backends' decoders: back-pointers as an additive mask, one
    :func:`attention` per layer. Keys are not stored transposed: a [d, T*R] layout puts a head's d rows T*R
    floats apart, which at Marian's 511 slots cost more per step than the GEMM gained."""

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
        self.static = (
            False  # attend the t+1 slots written so far; a span bucket after make_static() (capture)
        )
        b, h, t, r, d = inputs, heads, max_len, rows_per_input, head_dim
        # Unread slots need no zeros off the static path: empty pages are only touched as slots are written.
        self.k = [torch.empty((b, h, t, r, d), dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty((b, h, t, r, d), dtype=dtype, device=device) for _ in range(layers)]
        self.heads, self.max_len, self.r, self.head_dim = h, t, r, d
        self.ptrs = BackPointers(inputs, rows_per_input, max_len, device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # [1]: the slot this step writes
        self.span = max_len  # slots this step attends (host int; a span bucket if static)
        self.bias: Tensor | None = None  # additive float32, [B or 1, 1 or H, Rq, span*R]; None = all

    def buffers(self) -> list[Tensor]:
        return self.k + self.v

    def begin(self, bias: Tensor | None = None) -> None:
        """A step starts (before the layers); ``bias`` [1, H, 1, T]: additive attention bias over slots (T5)."""
        h, r, span = self.heads, self.r, self.span
        if bias is not None:
            bias = bias[..., :span, None].float().expand(1, h, 1, span, r).reshape(1, h, 1, span * r)
        if self.static or r > 1:
            visible = self.ptrs.visible(self.slot, span)  # [B, Rq, span, R] or [1, 1, span, 1]
            visible = visible.expand(-1, r, span, r).reshape(-1, 1, r, span * r)  # [B|1, 1, Rq, span*R]
            bias = torch.where(
                visible, 0.0 if bias is None else bias, float("-inf")
            )  # [B|1, 1|H, Rq, span*R]
        self.bias = bias  # None: a row sees all of the first t+1 slots (dynamic, R = 1, no T5 bias)

    def advance(self) -> None:
        """A step is done: the next one writes the next slot (queued on the device, no sync)."""
        self.slot.add_(1)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store this step's ``k``/``v`` ([N, H, d]); attend ``q`` [N, H, d] over each history -> [N, H*d]."""
        kl, vl = self.k[layer], self.v[layer]  # [B, H, T, R, d]
        b, h, r, d, span = kl.shape[0], self.heads, self.r, self.head_dim, self.span
        at = None if self.static else span - 1
        write_slot(kl, 2, k.view(b, r, h, d).transpose(1, 2), self.slot, at)  # [N, H, d] -> [B, H, R, d]
        write_slot(vl, 2, v.view(b, r, h, d).transpose(1, 2), self.slot, at)  # [N, H, d] -> [B, H, R, d]
        keys_t = kl[:, :, :span].view(b, h, span * r, d).transpose(-1, -2)  # contiguous per (b, h): no copy
        values = vl[:, :, :span].view(b, h, span * r, d)  # contiguous per (b, h): no copy
        qb = q.view(b, r, h, d).transpose(1, 2)  # [N, H, d] -> [B, H, Rq, d]
        out = attention(qb, keys_t, values, self.bias, scale)  # [B, H, Rq, d]
        return out.transpose(1, 2).reshape(b * r, h * d)  # [B, Rq, H, d] -> [N, H*d]

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move."""
        self.ptrs.reorder(rows)

    def keep(self, inputs: Tensor, rows: Tensor, used: int) -> None:
        """Keep only inputs ``inputs`` ([B'] int64), i.e. rows ``rows`` ([B' * R]); copies only the ``used``
        slots written so far."""
        for cache in (self.k, self.v):
            for i, x in enumerate(cache):
                cache[i] = keep_slots(x, inputs, 2, used, self.static)
        self.ptrs.keep(rows)

    def keep_into(self, into: EncoderDecoderKVCache, inputs: Tensor, rows: Tensor, used: int) -> None:
        """:meth:`keep` into the kept static cache ``into`` (``inputs.shape[0]`` inputs, same slots): the ``used``
        slots written so far, the rest zeros, the back-pointers and the slot counter; ``self`` is left as it is."""
        for dst, src in zip(into.k + into.v, self.k + self.v, strict=True):
            copy_slots(dst, src, inputs, 2, used)
        select_into(into.ptrs.ptr, self.ptrs.ptr, rows)
        into.slot.copy_(self.slot)

    def empty(self, inputs: int) -> EncoderDecoderKVCache:
        """A static cache like this one for ``inputs`` inputs: zeros (what :meth:`keep_into` fills)."""
        k = self.k[0]
        cache = EncoderDecoderKVCache(
            len(self.k), inputs, self.r, self.heads, self.max_len, self.head_dim, k.dtype, k.device
        )
        cache.make_static()
        return cache

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.k + self.v) + self.ptrs.ptr.nbytes


class LaneSteps:
    """What both refill caches (``search/refill.py``) share: a step counter per input slot (``steps`` [S], on the
    device), so inputs at different steps share one decode step.

    A step writes every slot's keys/values at that slot's own step and attends over the first ``span`` slots
    under a mask (slot ``<=`` the slot's step, and the back-pointers). ``span`` (host int, set per step by
    :meth:`check` from the furthest live lane's step, ``ages``) is a bucket, not the oldest input's step: :func:`~seqgen_cli.shapes.span_bucket`, at least ``MIN_SPAN`` slots,
    so its shape changes a few times per run, and an input's sums run over the same span beside any neighbours
    wherever its own steps fit in ``MIN_SPAN`` (a sum over more masked slots can round differently).
    ``slot`` ([N]: each row's step) is what a backend reads for positions. Unwritten and stale slots hold finite
    values (zeros at start), always masked; an idle slot (no input) keeps stepping, its counter stops at
    ``T - 1`` and it always sees slot 0, so its rows stay finite and its writes stay in its own rows.
    """

    r: int
    max_len: int
    span: int
    ptrs: BackPointers
    steps: Tensor  # [S] int64: the step each slot writes
    slot: Tensor  # [N] int64: the step each row writes
    ages: list[int | None]  # host: each lane's step (``None``: idle), what ``steps`` holds for the live lanes

    def _init_steps(self, slots: int, device: torch.device) -> None:
        self.steps = torch.zeros(slots, dtype=torch.long, device=device)
        self.slot = torch.zeros(slots * self.r, dtype=torch.long, device=device)
        self._slots = torch.arange(slots, device=device)
        self.ages = [None] * slots

    def now(self, t: int) -> int:
        """The step that sizes this step's span: the furthest live lane's (``t``, the steps run, is not it)."""
        return max((a for a in self.ages if a is not None), default=0)

    def check(self, t: int) -> None:
        """Host: the span this step attends, a bucket of the furthest live lane's step (lane steps stay below ``T``:
        the engine stops an input at its last step)."""
        self.span = span_bucket(self.now(t), self.max_len)

    def join(self, lanes: list[int]) -> None:
        """Inputs join lanes ``lanes``: their counters restart at step 0 (stale keys are masked)."""
        self.steps.index_fill_(0, torch.tensor(lanes, dtype=torch.long, device=self.steps.device), 0)
        self._row_steps()
        for lane in lanes:
            self.ages[lane] = 0

    def leave(self, lanes: list[int]) -> None:
        """The inputs of ``lanes`` are done: they idle (their steps no longer size the span)."""
        for lane in lanes:
            self.ages[lane] = None

    def _row_steps(self) -> None:
        s, r = self.steps.shape[0], self.r
        self.slot.view(s, r).copy_(self.steps[:, None])  # [S] -> [S, R]

    def advance(self) -> None:
        """A step is done: every slot moves on (queued; an idle slot stops at the last one)."""
        self.steps.add_(1).clamp_(max=self.max_len - 1)
        self._row_steps()
        self.ages = [None if a is None else min(a + 1, self.max_len - 1) for a in self.ages]

    def visible(self, span: int) -> Tensor:
        """Which of the first ``span`` slots each query row sees (its own step and before, its back-pointers;
        slot 0 always): bool [S, Rq, span, R], or [S, 1, span, 1] if R = 1."""
        s, r = self.steps.shape[0], self.r
        slots = self.ptrs.slots[:span]
        upto = ((slots[None, :] <= self.steps[:, None]) | (slots == 0)).view(s, 1, span, 1)  # [S, 1, span, 1]
        if r == 1:
            return upto
        self.ptrs.ptr.scatter_(1, self.slot[:, None], self.ptrs.beams.repeat(s)[:, None])  # own beam
        return (self.ptrs.ptr[:, :span].view(s, r, span, 1) == self.ptrs.beams) & upto  # [S, Rq, span, R]


class LaneKVCache(LaneSteps, EncoderDecoderKVCache):
    """:class:`EncoderDecoderKVCache` for the refill engine, each input slot at its own step (:class:`LaneSteps`)."""

    def __init__(
        self,
        layers: int,
        slots: int,
        rows_per_input: int,
        heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(layers, slots, rows_per_input, heads, max_len, head_dim, dtype, device)
        self.make_static()  # zeros; a span bucket of slots attended
        self._init_steps(slots, device)
        # [S * H] int64: where this step's keys go in a layer's cache viewed as [S * H * T, R, d]
        self.where = torch.zeros(slots * heads, dtype=torch.long, device=device)
        self._heads = torch.arange(heads, device=device)

    def begin(self, bias: Tensor | None = None) -> None:
        """A step starts. ``bias``: T5's relative position bias [1, H, N, T] (row ``n``'s query step against every
        key slot)."""
        s, h, r, t, span = self.steps.shape[0], self.heads, self.r, self.max_len, self.span
        self.where = ((self._slots[:, None] * h + self._heads) * t + self.steps[:, None]).view(-1)  # [S * H]
        visible = self.visible(span).expand(s, r, span, r).reshape(s, 1, r, span * r)  # [S, 1, Rq, span*R]
        if bias is not None:  # [1, H, N, T] -> [S, H, Rq, span] -> [S, H, Rq, span*R]
            bias = bias[0, :, :, :span].view(h, s, r, span).transpose(0, 1).float()
            bias = bias[..., None].expand(s, h, r, span, r).reshape(s, h, r, span * r)
        self.bias = torch.where(visible, 0.0 if bias is None else bias, float("-inf"))  # [S, 1|H, Rq, span*R]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store this step's ``k``/``v`` ([N, H, d]) at each slot's step; attend ``q`` [N, H, d] -> [N, H*d]."""
        kl, vl = self.k[layer], self.v[layer]  # [S, H, T, R, d]
        s, h, r, d, t = kl.shape[0], self.heads, self.r, self.head_dim, self.max_len
        for cache, new in ((kl, k), (vl, v)):  # [N, H, d] -> [S, H, R, d] -> [S * H, R, d]
            rows = new.view(s, r, h, d).transpose(1, 2).reshape(s * h, r, d)
            cache.view(s * h * t, r, d).index_copy_(0, self.where, rows)
        span = self.span
        keys_t = kl[:, :, :span].view(s, h, span * r, d).transpose(-1, -2)  # contiguous per (s, h): no copy
        values = vl[:, :, :span].view(s, h, span * r, d)
        qb = q.view(s, r, h, d).transpose(1, 2)  # [N, H, d] -> [S, H, Rq, d]
        out = attention(qb, keys_t, values, self.bias, scale)  # [S, H, Rq, d]
        return out.transpose(1, 2).reshape(s * r, h * d)  # [S, Rq, H, d] -> [N, H*d]


class DecoderOnlyKVCache(GeneratedSlots):
    """Decoder-only self-attention: the prompt's K/V once per input, shared by its beams, then generated K/V.

    ``Hkv`` = K/V heads (never repeated for grouped-query attention). Keys are stored transposed: CPU ``bmm``
    is ~2x faster on a contiguous ``K^T`` than on a transposed view (docs/BENCHMARKS.md, "Fast decoder-only
    decoders"). Prompt and generated scores share one float32 softmax (exact).
    """

    def __init__(
        self, pk: list[Tensor], pv: list[Tensor], mask: Tensor, rows_per_input: int, max_len: int
    ) -> None:
        """Take the prefill's K/V ([B, Hkv, P, d] per layer) and mask [B, P]; allocate ``max_len`` slots."""
        b, hkv, _, d = pk[0].shape
        r, max_len = rows_per_input, max(max_len, 1)
        dev, dt = pk[0].device, pk[0].dtype
        self.pk = [
            k.transpose(-1, -2).contiguous() for k in pk
        ]  # [B, Hkv, d, P]; the prefill's copy is freed
        self.pv = pv  # [B, Hkv, P, d]
        self.static = (
            False  # attend the t+1 slots written so far; a span bucket after make_static() (capture)
        )
        # unread slots need no zeros off the static path
        self.gk = [torch.empty(b, hkv, d, max_len, r, device=dev, dtype=dt) for _ in pk]  # [B, Hkv, d, T, R]
        self.gv = [torch.empty(b, hkv, max_len, r, d, device=dev, dtype=dt) for _ in pk]  # [B, Hkv, T, R, d]
        bias = torch.zeros(mask.shape, device=dev, dtype=torch.float32)
        self.prompt_bias = bias.masked_fill(mask == 0, float("-inf"))[:, None, None, :]  # [B, 1, 1, P]
        self.ptrs = BackPointers(b, r, max_len, dev)
        self.r, self.max_len = r, max_len
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # [1]: the slot this step writes
        self.span = max_len  # slots this step attends (host int; a span bucket if static)
        self.gen_bias: Tensor | None = None  # [B|1, 1, Rq, 1, span*R] float32, 0 or -inf; None = all

    def buffers(self) -> list[Tensor]:
        return self.gk + self.gv

    def make_static(self) -> None:
        """As :meth:`GeneratedSlots.make_static`; the prompt's values get storage of their own too (the prefill's
        are views of its projection's output, which they would keep alive: a kept cache lives on)."""
        super().make_static()
        self.pv = [v.contiguous() for v in self.pv]

    def restart(self, pk: list[Tensor], pv: list[Tensor], mask: Tensor) -> None:
        """A kept static cache (``models/capture.py``) takes a new batch's prefill (K/V [B, Hkv, P, d] per layer, mask
        [B, P]: this cache's shape) as a new cache would, copied into its tensors; the generated slots restart."""
        for i, (k, v) in enumerate(zip(pk, pv, strict=True)):
            self.pk[i].copy_(k.transpose(-1, -2))  # [B, Hkv, d, P]
            self.pv[i].copy_(v)  # [B, Hkv, P, d]
        bias = torch.zeros(mask.shape, device=mask.device, dtype=torch.float32)
        self.prompt_bias.copy_(bias.masked_fill(mask == 0, float("-inf"))[:, None, None, :])  # [B, 1, 1, P]
        self.reset()

    def begin(self) -> None:
        """A step starts: build the generated-slot bias once for all layers."""
        r, span = self.r, self.span
        if not self.static and r == 1:  # a row sees all of the first t+1 slots
            self.gen_bias = None
            return
        visible = self.ptrs.visible(self.slot, span)  # [B, Rq, span, R] or [1, 1, span, 1]
        visible = visible.expand(-1, r, span, r).reshape(-1, 1, r, 1, span * r)  # [B|1, 1, Rq, 1, span*R]
        zeros = torch.zeros(visible.shape, device=visible.device, dtype=torch.float32)
        self.gen_bias = zeros.masked_fill_(~visible, float("-inf"))

    def advance(self) -> None:
        """A step is done: the next one writes the next slot (queued on the device, no sync)."""
        self.slot.add_(1)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store this step's ``k``/``v`` ([N, Hkv, d], after any RoPE); attend ``q`` [N, H, d] -> [N, H*d]."""
        n, h, d = q.shape
        b, r = self.prompt_bias.shape[0], self.r
        hkv = k.shape[1]
        g = h // hkv
        gk, gv = self.gk[layer], self.gv[layer]
        span = self.span
        at = None if self.static else span - 1
        write_slot(gk, 3, k.view(b, r, hkv, d).permute(0, 2, 3, 1), self.slot, at)  # keys [B, Hkv, d, R]
        write_slot(gv, 2, v.view(b, r, hkv, d).transpose(1, 2), self.slot, at)  # values [B, Hkv, R, d]
        # queries of one input's beams and one K/V head's group: [B, Hkv, R*G, d]
        qg = q.view(b, r, hkv, g, d).transpose(1, 2).reshape(b, hkv, r * g, d)
        keys_t = gk[:, :, :, :span].view(b, hkv, d, span * r)  # slot-major: index s*R + beam
        vals = gv[:, :, :span].view(b, hkv, span * r, d)
        sp = scores32(qg, self.pk[layer]).mul_(scale)  # [B, Hkv, R*G, P] float32
        sg = scores32(qg, keys_t).mul_(scale)  # [B, Hkv, R*G, span*R] float32
        p = sp.shape[-1]
        scores = torch.cat([sp + self.prompt_bias, sg], dim=-1)  # [B, Hkv, R*G, P+span*R]
        if self.gen_bias is not None:
            scores.view(b, hkv, r, g, -1)[..., p:] += self.gen_bias
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs[..., :p], self.pv[layer])
        out += torch.matmul(probs[..., p:], vals)  # [B, Hkv, R*G, d]
        return out.view(b, hkv, r, g, d).transpose(1, 2).reshape(n, h * d)  # [B, R, Hkv, G, d] -> [N, H*d]

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move."""
        self.ptrs.reorder(rows)

    def keep(self, inputs: Tensor, rows: Tensor, used: int) -> None:
        """Keep inputs ``inputs`` ([B']), i.e. rows ``rows`` ([B' * R]); copies only the ``used`` slots."""
        for i in range(len(self.pk)):
            self.pk[i] = self.pk[i].index_select(0, inputs)
            self.pv[i] = self.pv[i].index_select(0, inputs)
            self.gk[i] = keep_slots(self.gk[i], inputs, 3, used, self.static)
            self.gv[i] = keep_slots(self.gv[i], inputs, 2, used, self.static)
        self.prompt_bias = self.prompt_bias.index_select(0, inputs)
        self.ptrs.keep(rows)

    def keep_into(self, into: DecoderOnlyKVCache, inputs: Tensor, rows: Tensor, used: int) -> None:
        """:meth:`keep` into the kept static cache ``into`` (``inputs.shape[0]`` inputs, same width and slots): the
        prompts, the ``used`` generated slots (the rest zeros), the back-pointers and the slot counter; ``self`` is
        left as it is."""
        for i in range(len(self.pk)):
            select_into(into.pk[i], self.pk[i], inputs)
            select_into(into.pv[i], self.pv[i], inputs)
            copy_slots(into.gk[i], self.gk[i], inputs, 3, used)
            copy_slots(into.gv[i], self.gv[i], inputs, 2, used)
        select_into(into.prompt_bias, self.prompt_bias, inputs)
        select_into(into.ptrs.ptr, self.ptrs.ptr, rows)
        into.slot.copy_(self.slot)

    def empty(self, inputs: int) -> DecoderOnlyKVCache:
        """A static cache like this one for ``inputs`` inputs: zeros, prompts all masked (what :meth:`keep_into`
        fills)."""
        _, hkv, d, width = self.pk[0].shape
        kv = [self.pv[0].new_zeros(inputs, hkv, width, d) for _ in self.pk]
        mask = torch.zeros(inputs, width, dtype=torch.long, device=self.pv[0].device)
        cache = DecoderOnlyKVCache(kv, [x.clone() for x in kv], mask, self.r, self.max_len)
        cache.make_static()
        return cache

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.pk + self.pv + self.gk + self.gv) + self.ptrs.ptr.nbytes


class DecoderOnlyLaneKVCache(LaneSteps, DecoderOnlyKVCache):
    """:class:`DecoderOnlyKVCache` for the refill engine: per input slot a prompt region and generated slots at
    the slot's own step (:class:`LaneSteps`).

    The prompt region (``pk`` [S, Hkv, d, W], ``pv`` [S, Hkv, W, d], ``prompt_bias`` [S, 1, 1, W]) holds a joiner's
    prefill as it came, left-padded to its own width ``w`` (a function of its length), in columns ``[0, w)``; the
    rest is masked (zeros, or a previous input's stale keys). ``widen`` grows every slot's region (masked, on the
    right) when a wider joiner comes. A row's scores are ``[generated span*R | prompt W]`` under one float32
    softmax: generated first, so the columns of an input's real keys depend on its own width and the span only,
    and a wider region only adds masked columns at the end.
    """

    def __init__(
        self,
        layers: int,
        slots: int,
        rows_per_input: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        kv = [
            torch.zeros(slots, kv_heads, width, head_dim, dtype=dtype, device=device) for _ in range(layers)
        ]
        mask = torch.zeros(slots, width, dtype=torch.long, device=device)  # all masked until a join
        super().__init__(kv, [x.clone() for x in kv], mask, rows_per_input, max_len)
        self.make_static()  # zeros; a span bucket of slots attended
        self._init_steps(slots, device)
        t = self.max_len
        # where this step's keys ([S * Hkv * d] rows of [S * Hkv * d * T, R]) and values ([S * Hkv] rows of
        # [S * Hkv * T, R, d]) go: row ``i``'s slot 0, plus the slot's step
        self._key_base = (torch.arange(slots * kv_heads * head_dim, device=device) * t).view(slots, -1)
        self._value_base = (torch.arange(slots * kv_heads, device=device) * t).view(slots, -1)
        self.where_k = self._key_base.reshape(-1)
        self.where_v = self._value_base.reshape(-1)

    @property
    def width(self) -> int:
        return self.prompt_bias.shape[-1]

    def widen(self, width: int) -> None:
        """Room for prompts of ``width`` positions: every slot's region grows, masked, on the right."""
        grow = width - self.width
        if grow > 0:
            pad = torch.nn.functional.pad
            self.pk = [pad(k, (0, grow)) for k in self.pk]  # [S, Hkv, d, W]
            self.pv = [pad(v, (0, 0, 0, grow)) for v in self.pv]  # [S, Hkv, W, d]
            self.prompt_bias = pad(self.prompt_bias, (0, grow), value=float("-inf"))  # [S, 1, 1, W]

    def put_prompt(self, slots: Tensor, pk: list[Tensor], pv: list[Tensor], mask: Tensor) -> None:
        """The prefill of joiners taking slots ``slots`` ([J] int64): K/V [J, Hkv, w, d] per layer and mask [J, w]
        (``w <= W``) go into columns ``[0, w)``; the rest of their region is masked."""
        w = mask.shape[1]
        for i, (k, v) in enumerate(zip(pk, pv, strict=True)):
            self.pk[i].narrow(3, 0, w).index_copy_(0, slots, k.transpose(-1, -2))  # [J, Hkv, d, w]
            self.pv[i].narrow(2, 0, w).index_copy_(0, slots, v)  # [J, Hkv, w, d]
        bias = torch.full((mask.shape[0], self.width), float("-inf"), device=mask.device)  # [J, W]
        bias[:, :w].masked_fill_(mask != 0, 0.0)
        self.prompt_bias.index_copy_(0, slots, bias[:, None, None, :])

    def begin(self) -> None:
        """A step starts: where each slot writes, and the generated-slot bias of every row."""
        s, r, span = self.steps.shape[0], self.r, self.span
        self.where_k = (self._key_base + self.steps[:, None]).view(-1)  # [S * Hkv * d]
        self.where_v = (self._value_base + self.steps[:, None]).view(-1)  # [S * Hkv]
        visible = self.visible(span).expand(s, r, span, r)  # [S, Rq, span, R]
        visible = visible.reshape(s, 1, r, 1, span * r)  # [S, 1, Rq, 1, span*R]
        zeros = torch.zeros(visible.shape, device=visible.device, dtype=torch.float32)
        self.gen_bias = zeros.masked_fill_(~visible, float("-inf"))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store this step's ``k``/``v`` ([N, Hkv, d], after any RoPE) at each slot's step; attend ``q``
        [N, H, d] -> [N, H*d]."""
        n, h, d = q.shape
        s, r, hkv, t, span = self.steps.shape[0], self.r, k.shape[1], self.max_len, self.span
        g = h // hkv
        gk, gv = self.gk[layer], self.gv[layer]  # [S, Hkv, d, T, R], [S, Hkv, T, R, d]
        keys = k.view(s, r, hkv, d).permute(0, 2, 3, 1).reshape(s * hkv * d, r)  # [N, Hkv, d] -> [S*Hkv*d, R]
        gk.view(s * hkv * d * t, r).index_copy_(0, self.where_k, keys)
        values = v.view(s, r, hkv, d).transpose(1, 2).reshape(s * hkv, r, d)  # [N, Hkv, d] -> [S*Hkv, R, d]
        gv.view(s * hkv * t, r, d).index_copy_(0, self.where_v, values)
        # queries of one input's beams and one K/V head's group: [S, Hkv, R*G, d]
        qg = q.view(s, r, hkv, g, d).transpose(1, 2).reshape(s, hkv, r * g, d)
        keys_t = gk[:, :, :, :span].view(s, hkv, d, span * r)  # slot-major: index s*R + beam
        vals = gv[:, :, :span].view(s, hkv, span * r, d)
        sg = scores32(qg, keys_t).mul_(scale)  # [S, Hkv, R*G, span*R] float32
        sg = (sg.view(s, hkv, r, g, span * r) + self.gen_bias).view(s, hkv, r * g, span * r)
        sp = scores32(qg, self.pk[layer]).mul_(scale)  # [S, Hkv, R*G, W] float32
        scores = torch.cat([sg, sp + self.prompt_bias], dim=-1)  # [S, Hkv, R*G, span*R + W]
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        m = span * r
        out = torch.matmul(probs[..., :m], vals)
        out += torch.matmul(probs[..., m:], self.pv[layer])  # [S, Hkv, R*G, d]
        return out.view(s, hkv, r, g, d).transpose(1, 2).reshape(n, h * d)  # [S, R, Hkv, G, d] -> [N, H*d]
