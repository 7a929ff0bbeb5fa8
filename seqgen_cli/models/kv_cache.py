"""Self-attention caches of the fast backends: preallocated, written in place, never moved by beam reordering.

Both hold ``T = max_new_tokens`` positions per row; step ``t`` writes position ``t`` of every row. The keys and values
of an input's ``R`` beams lie side by side (``[..., T, R, d]``), so all positions of an input are a free view of
``T * R`` keys. Reordering moves only back-pointers (:class:`BackPointers`); each query beam scores against all
its input's keys and a mask built from the back-pointers keeps its own history. That costs ``R`` times the
score FLOPs on tiny matrices instead of copying or gathering the cache every step (measured against both in
docs/EXPERIMENTS.md, "Self-attention cache: reorder strategies").

Static shapes (graph capture). A step reads the position it writes from a device tensor (``position``,
[1] int64), writes with ``index_copy_``, and the visibility mask is built from tensors (positions ``<= position``, and
the back-pointers). With ``static`` (set by ``make_static()``, which ``models/capture.py`` calls) it attends
over a span bucket of positions (``shapes.span_bucket``: a power of two from 64, at most ``T``): no host integer that
changes per step reaches the step's tensor work, so it can be compiled or captured once per bucket and replayed,
and a step reads at most twice the positions written. Otherwise (every eager step, CPU or CUDA) it attends over the
``t + 1`` positions written so far (``span``, set by the host-side :meth:`check`), cheaper than all ``T`` positions
(docs/EXPERIMENTS.md, "Static vs dynamic step on the CPU"). Reordering is in place; only ``keep`` (inputs
leaving) reallocates, copying only the positions written so far. The capture path keeps its static caches for later
batches (``models/capture.py``): ``reset`` restarts one in place, ``keep_into`` copies what ``keep`` keeps into
another one's tensors, ``empty`` allocates one. On the static path unwritten positions are zeros (masked keys must
still be finite: ``nan - inf`` is ``nan``); off it they are never read, so they are allocated empty.

Every layer has its own K and V tensors. Under ``torch.compile`` a write through a view of one tensor holding
all layers is functionalized into a copy of that whole tensor per write (``index_put`` + ``select_scatter`` +
``copy_``); a write into a tensor of its own stays an in-place ``index_put_`` (``tests/models/test_inductor.py``).

Nothing here syncs with the device. Rows are input-major (``row = b * R + k``, see
``seqgen_cli/search/protocol.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.models.attention import Block
from seqgen_cli.shapes import span_bucket


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, positions: int) -> int:
    """Bytes of the keys and values of ``positions`` positions (summed over rows) in ``layers`` layers of
    ``kv_heads`` K/V heads (grouped-query attention: the K/V heads, not the query heads)."""
    return 2 * layers * kv_heads * head_dim * dtype.itemsize * positions


def pointer_bytes(rows: int, max_len: int) -> int:
    """Bytes of :class:`BackPointers` for ``rows`` rows and ``max_len`` positions (int64)."""
    return rows * max_len * 8


def check_position(t: int, max_len: int) -> None:
    """Host-side bounds check before step ``t``: ``ValueError`` past the ``max_len`` positions of ``start()``."""
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
    """``ptr[n, s]``: the beam (``0..R-1``, same input) whose position ``s`` is in row ``n``'s history."""

    def __init__(self, inputs: int, rows_per_input: int, max_len: int, device: torch.device) -> None:
        self.r = rows_per_input
        self.ptr = torch.zeros(inputs * rows_per_input, max_len, dtype=torch.long, device=device)  # [N, T]
        self.beams = torch.arange(rows_per_input, device=device)  # [R]
        self.positions = torch.arange(max_len, device=device)  # [T]

    def visible(self, position: Tensor, span: int) -> Tensor:
        """This step writes position ``position`` ([1] int64) of every row. Returns which of the first ``span``
        positions each query row sees: bool [B, Rq, span, R] (position ``s`` of beam ``r``); [1, 1, span, 1] if
        R = 1."""
        n = self.ptr.shape[0]
        r, b = self.r, n // self.r
        upto = (self.positions[:span] <= position)[:, None]  # [span, 1]
        if r == 1:
            return upto.view(1, 1, span, 1)
        self.ptr.index_copy_(1, position, self.beams.repeat(b)[:, None])  # [N, 1]: each row's own beam
        return (self.ptr[:, :span].view(b, r, span, 1) == self.beams) & upto  # [B, Rq, span, R]

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input); in place."""
        self.ptr.copy_(self.ptr.index_select(0, rows))

    def keep(self, rows: Tensor) -> None:
        """Keep rows ``rows`` ([B' * R], whole inputs): beam indices stay valid within an input."""
        self.ptr = self.ptr.index_select(0, rows)


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


def write_position(cache: Tensor, dim: int, new: Tensor, position: Tensor, at: int | None) -> None:
    """Store ``new`` (``cache`` without ``dim``) at position ``position`` ([1] int64, on the device) along ``dim``;
    ``at``: the same position as a host int off the static path, where the write is a plain view copy."""
    if at is None:
        cache.index_copy_(dim, position, new.unsqueeze(dim))
    else:
        cache.select(dim, at).copy_(new)


class GeneratedPositions:
    """What both generated-token caches share: ``max_len`` positions, of which a step attends ``span``."""

    static: bool  # attend the t+1 positions written so far; a span bucket of T after make_static() (capture)
    max_len: int
    span: int  # positions this step attends (host int; a span bucket if static)
    ptrs: BackPointers
    position: Tensor  # [1] int64: the position this step writes

    def buffers(self) -> list[Tensor]:
        """The per-layer generated K/V tensors."""
        raise NotImplementedError

    def make_static(self) -> None:
        """Attend a span bucket of positions from now on (``shapes.span_bucket``: graph capture, before the first step):
        zero the unwritten."""
        if not self.static:
            for x in self.buffers():
                x.zero_()
            self.static = True

    def reset(self) -> None:
        """A kept static cache (``models/capture.py``) takes a new batch, as a new cache would start: every position
        unwritten (zeros), back-pointers cleared, the next step writes position 0. In place: no tensor is allocated."""
        for x in self.buffers():
            x.zero_()
        self.ptrs.ptr.zero_()
        self.position.zero_()
        self.span = self.max_len

    def now(self, t: int) -> int:
        """The step that sizes step ``t``'s span: ``t`` itself (every row of a batch is at one step)."""
        return t

    def check(self, t: int) -> None:
        """Host: step ``t`` is about to run (``ValueError`` past the allocated positions); sets ``span``."""
        check_position(t, self.max_len)
        self.span = span_bucket(t, self.max_len) if self.static else t + 1


class EncoderDecoderKVCache(GeneratedPositions):
    """Self-attention of the encoder-decoder backends' decoders: back-pointers as an additive mask, one
    :func:`attention` per layer. Keys are not stored transposed: a [d, T*R] layout puts a head's d rows T*R
    floats apart, which at Marian's 511 positions cost more per step than the GEMM gained."""

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
        window: int | None = None,
    ) -> None:
        """``heads``: the K/V heads (grouped-query attention: fewer than the queries'). ``window``: the sliding
        window of the layers that slide (a query sees the keys less than ``window`` positions before it;
        ``layer_bias(..., sliding=True)``); only where ``max_len`` positions reach past it."""
        self.static = (
            False  # attend the t+1 positions written so far; a span bucket after make_static() (capture)
        )
        b, h, t, r, d = inputs, heads, max_len, rows_per_input, head_dim
        # Unread positions need no zeros off the static path: empty pages are only touched as positions are written.
        self.k = [torch.empty((b, h, t, r, d), dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty((b, h, t, r, d), dtype=dtype, device=device) for _ in range(layers)]
        self.heads, self.max_len, self.r, self.head_dim = h, t, r, d
        self.ptrs = BackPointers(inputs, rows_per_input, max_len, device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # [1]: the position this step writes
        self.span = max_len  # positions this step attends (host int; a span bucket if static)
        self.bias: Tensor | None = None  # additive float32 (layer_bias), [[L',] B|1, 1|H, Rq, span*R]; None = all
        self.window = window if window is not None and max_len > window else None
        self.windowed: Tensor | None = None  # the sliding layers' bias (``bias`` and the window)

    def buffers(self) -> list[Tensor]:
        return self.k + self.v

    def begin(self, bias: Tensor | None = None) -> None:
        """A step starts (before the layers); ``bias`` [L', H, 1, T]: additive attention bias over positions (the
        relative bias: L' = 1, shared by the layers, or one per layer)."""
        h, r, span = self.heads, self.r, self.span
        if bias is not None:  # [L', H, 1, T] -> [L', 1, H, 1, span*R]
            bias = bias[..., :span, None].float().expand(-1, h, 1, span, r).reshape(-1, 1, h, 1, span * r)
        if self.static or r > 1:
            visible = self.ptrs.visible(self.position, span)  # [B, Rq, span, R] or [1, 1, span, 1]
            visible = visible.expand(-1, r, span, r).reshape(-1, 1, r, span * r)  # [B|1, 1, Rq, span*R]
            bias = torch.where(
                visible, 0.0 if bias is None else bias, float("-inf")
            )  # [B|1, 1, Rq, span*R], or with a bias [L', B|1, H, Rq, span*R]
        self.bias = bias  # None: a row sees all of the first t+1 positions (dynamic, R = 1, no relative bias)
        if self.window is not None:
            self.windowed = self._slide(self.position)

    def _slide(self, step: Tensor) -> Tensor:
        """The sliding layers' bias: :attr:`bias` with the keys ``window`` or more positions before ``step`` ([1],
        or [L]: each lane's) masked too, [[L',] B|L|1, 1|H, Rq|1, span*R]."""
        r, span = self.r, self.span
        near = self.ptrs.positions[:span] > step[:, None] - self.window  # [1|L, span]
        near = near[:, :, None].expand(-1, span, r).reshape(-1, 1, 1, span * r)  # [1|L, 1, 1, span*R]
        bias = self.bias if self.bias is not None else torch.zeros(near.shape, device=near.device)
        return bias.masked_fill(~near, float("-inf"))

    def layer_bias(self, layer: int, sliding: bool = False) -> Tensor | None:
        """The additive bias ``layer``'s self-attention adds to its scores (:meth:`begin`): [B|1, 1|H, Rq, span*R];
        ``sliding``: with its window (a layer that slides)."""
        bias = self.windowed if sliding and self.windowed is not None else self.bias
        if bias is None or bias.dim() == 4:
            return bias
        return bias[layer if bias.shape[0] > 1 else 0]

    def advance(self) -> None:
        """A step is done: the next one writes the next position (queued on the device, no sync)."""
        self.position.add_(1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this step's ``k``/``v`` ([N, H, d]) of ``layer``; returns what a query attends: the keys
        (transposed) and values of the first ``span`` positions, [B, H, d, span*R] and [B, H, span*R, d] (views)."""
        kl, vl = self.k[layer], self.v[layer]  # [B, H, T, R, d]
        b, h, r, d, span = kl.shape[0], self.heads, self.r, self.head_dim, self.span
        at, pos = (None if self.static else span - 1), self.position
        write_position(kl, 2, k.view(b, r, h, d).transpose(1, 2), pos, at)  # [N, H, d] -> [B, H, R, d]
        write_position(vl, 2, v.view(b, r, h, d).transpose(1, 2), pos, at)  # [N, H, d] -> [B, H, R, d]
        keys_t = kl[:, :, :span].view(b, h, span * r, d).transpose(-1, -2)  # contiguous per (b, h): no copy
        return keys_t, vl[:, :, :span].view(b, h, span * r, d)  # contiguous per (b, h): no copy

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move."""
        self.ptrs.reorder(rows)

    def keep(self, inputs: Tensor, rows: Tensor, used: int) -> None:
        """Keep only inputs ``inputs`` ([B'] int64), i.e. rows ``rows`` ([B' * R]); copies only the ``used``
        positions written so far."""
        for cache in (self.k, self.v):
            for i, x in enumerate(cache):
                cache[i] = keep_positions(x, inputs, 2, used, self.static)
        self.ptrs.keep(rows)

    def keep_into(self, into: EncoderDecoderKVCache, inputs: Tensor, rows: Tensor, used: int) -> None:
        """:meth:`keep` into the kept static cache ``into`` (``inputs.shape[0]`` inputs, same positions): the
        ``used`` positions written so far, the rest zeros, the back-pointers and the position counter; ``self`` is
        left as it is."""
        for dst, src in zip(into.k + into.v, self.k + self.v, strict=True):
            copy_positions(dst, src, inputs, 2, used)
        select_into(into.ptrs.ptr, self.ptrs.ptr, rows)
        into.position.copy_(self.position)

    def empty(self, inputs: int) -> EncoderDecoderKVCache:
        """A static cache like this one for ``inputs`` inputs: zeros (what :meth:`keep_into` fills)."""
        k = self.k[0]
        cache = EncoderDecoderKVCache(
            len(self.k), inputs, self.r, self.heads, self.max_len, self.head_dim, k.dtype, k.device, self.window
        )
        cache.make_static()
        return cache

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.k + self.v) + self.ptrs.ptr.nbytes


class DecoderOnlyKVCache(GeneratedPositions):
    """Decoder-only self-attention: the prompt's K/V once per input, shared by its beams, then generated K/V.

    ``Hkv`` = K/V heads (never repeated for grouped-query attention). Keys are stored transposed: CPU ``bmm``
    is ~2x faster on a contiguous ``K^T`` than on a transposed view (docs/EXPERIMENTS.md, "Fast decoder-only
    decoders"). Prompt and generated scores share one float32 softmax (exact).
    """

    def __init__(
        self,
        pk: list[Tensor],
        pv: list[Tensor],
        mask: Tensor,
        rows_per_input: int,
        max_len: int,
        window: int | None = None,
    ) -> None:
        """Take the prefill's K/V ([B, Hkv, P, d] per layer) and mask [B, P]; allocate ``max_len`` positions.
        ``window``: the sliding window of the layers that slide (a query sees the keys less than ``window``
        positions before it; ``update(..., sliding=True)``)."""
        b, hkv, _, d = pk[0].shape
        r, max_len = rows_per_input, max(max_len, 1)
        dev, dt = pk[0].device, pk[0].dtype
        self.pk = [
            k.transpose(-1, -2).contiguous() for k in pk
        ]  # [B, Hkv, d, P]; the prefill's copy is freed
        self.pv = pv  # [B, Hkv, P, d]
        self.static = (
            False  # attend the t+1 positions written so far; a span bucket after make_static() (capture)
        )
        # unread positions need no zeros off the static path
        self.gk = [torch.empty(b, hkv, d, max_len, r, device=dev, dtype=dt) for _ in pk]  # [B, Hkv, d, T, R]
        self.gv = [torch.empty(b, hkv, max_len, r, d, device=dev, dtype=dt) for _ in pk]  # [B, Hkv, T, R, d]
        bias = torch.zeros(mask.shape, device=dev, dtype=torch.float32)
        self.prompt_bias = bias.masked_fill(mask == 0, float("-inf"))[:, None, None, :]  # [B, 1, 1, P]
        self.ptrs = BackPointers(b, r, max_len, dev)
        self.r, self.max_len = r, max_len
        self.position = torch.zeros(1, dtype=torch.long, device=dev)  # [1]: the position this step writes
        self.span = max_len  # positions this step attends (host int; a span bucket if static)
        self.gen_bias: Tensor | None = None  # [B|1, 1, Rq, 1, span*R] float32, 0 or -inf; None = all
        self.window = window
        self.windowed: tuple[Tensor, Tensor] | None = None  # the sliding layers' (prompt, generated) biases

    def buffers(self) -> list[Tensor]:
        return self.gk + self.gv

    def make_static(self) -> None:
        """As :meth:`GeneratedPositions.make_static`; the prompt's values get storage of their own too (the prefill's
        are views of its projection's output, which they would keep alive: a kept cache lives on)."""
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

    def begin(self) -> None:
        """A step starts: build the generated-position bias once for all layers."""
        r, span = self.r, self.span
        self.gen_bias = None  # dynamic, R = 1: a row sees all of the first t+1 positions
        if self.static or r > 1:
            visible = self.ptrs.visible(self.position, span)  # [B, Rq, span, R] or [1, 1, span, 1]
            visible = visible.expand(-1, r, span, r).reshape(-1, 1, r, 1, span * r)  # [B|1, 1, Rq, 1, span*R]
            zeros = torch.zeros(visible.shape, device=visible.device, dtype=torch.float32)
            self.gen_bias = zeros.masked_fill_(~visible, float("-inf"))
        if self.window is not None:
            self._window(self.position, self.prompt_bias.shape[-1])

    def _window(self, step: Tensor, width: Tensor | int) -> None:
        """The sliding layers' biases for queries at ``step`` ([1], or [L] per lane) over prompts of ``width``
        columns ([L] per lane, or one int): a key ``window`` or more positions back is masked. Positions are the
        caches' columns (a prompt left-padded, generated keys after it), as transformers' masks count them; the
        distance between two real tokens is the same at any padding. Sets ``windowed``: (prompt [B|L, 1, 1, 1, P],
        generated [B|L, 1, Rq|1, 1, span*R])."""
        w, r, span = self.window, self.r, self.span
        step = step[:, None]  # [1|L, 1]
        cols = torch.arange(self.prompt_bias.shape[-1], device=step.device)  # [P]
        width = width[:, None] if isinstance(width, Tensor) else width
        near = cols > width + step - w  # [1|L, P]: prompt column j is less than `window` back
        prompt = self.prompt_bias.masked_fill(~near[:, None, None, :], float("-inf"))[:, :, :, None]
        near = (self.ptrs.positions[:span] > step - w)[:, :, None].expand(-1, span, r).reshape(-1, 1, 1, 1, span * r)
        gen = torch.zeros(near.shape, device=near.device).masked_fill_(~near, float("-inf"))  # [1|L, 1, 1, 1, span*R]
        self.windowed = (prompt, gen if self.gen_bias is None else gen + self.gen_bias)

    def advance(self) -> None:
        """A step is done: the next one writes the next position (queued on the device, no sync)."""
        self.position.add_(1)

    def update(self, layer: int, k: Tensor, v: Tensor, sliding: bool = False) -> list[Block]:
        """Store this step's ``k``/``v`` ([N, Hkv, d], after any RoPE) of ``layer``; returns what a query attends,
        in score order: the prompt's keys [B, Hkv, d, P], values [B, Hkv, P, d] and bias, then the first ``span``
        generated positions' [B, Hkv, d, span*R], [B, Hkv, span*R, d] (views) and bias (``gen_bias``); ``sliding``:
        the biases of the sliding window (``windowed``)."""
        b, r, d = self.prompt_bias.shape[0], self.r, k.shape[2]
        hkv = k.shape[1]
        gk, gv = self.gk[layer], self.gv[layer]
        span = self.span
        at, pos = (None if self.static else span - 1), self.position
        write_position(gk, 3, k.view(b, r, hkv, d).permute(0, 2, 3, 1), pos, at)  # keys [B, Hkv, d, R]
        write_position(gv, 2, v.view(b, r, hkv, d).transpose(1, 2), pos, at)  # values [B, Hkv, R, d]
        keys_t = gk[:, :, :, :span].view(b, hkv, d, span * r)  # position-major: index s*R + beam
        vals = gv[:, :, :span].view(b, hkv, span * r, d)
        prompt_bias, gen_bias = (self.prompt_bias[:, :, :, None], self.gen_bias)
        if sliding and self.windowed is not None:
            prompt_bias, gen_bias = self.windowed
        return [(self.pk[layer], self.pv[layer], prompt_bias), (keys_t, vals, gen_bias)]

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move."""
        self.ptrs.reorder(rows)

    def keep(self, inputs: Tensor, rows: Tensor, used: int) -> None:
        """Keep inputs ``inputs`` ([B']), i.e. rows ``rows`` ([B' * R]); copies only the ``used`` positions."""
        for i in range(len(self.pk)):
            self.pk[i] = self.pk[i].index_select(0, inputs)
            self.pv[i] = self.pv[i].index_select(0, inputs)
            self.gk[i] = keep_positions(self.gk[i], inputs, 3, used, self.static)
            self.gv[i] = keep_positions(self.gv[i], inputs, 2, used, self.static)
        self.prompt_bias = self.prompt_bias.index_select(0, inputs)
        self.ptrs.keep(rows)

    def keep_into(self, into: DecoderOnlyKVCache, inputs: Tensor, rows: Tensor, used: int) -> None:
        """:meth:`keep` into the kept static cache ``into`` (``inputs.shape[0]`` inputs, same width and positions):
        the prompts, the ``used`` generated positions (the rest zeros), the back-pointers and the position counter;
        ``self`` is left as it is."""
        for i in range(len(self.pk)):
            select_into(into.pk[i], self.pk[i], inputs)
            select_into(into.pv[i], self.pv[i], inputs)
            copy_positions(into.gk[i], self.gk[i], inputs, 3, used)
            copy_positions(into.gv[i], self.gv[i], inputs, 2, used)
        select_into(into.prompt_bias, self.prompt_bias, inputs)
        select_into(into.ptrs.ptr, self.ptrs.ptr, rows)
        into.position.copy_(self.position)

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
        return sum(x.nbytes for x in self.pk + self.pv + self.gk + self.gv) + self.ptrs.ptr.nbytes
