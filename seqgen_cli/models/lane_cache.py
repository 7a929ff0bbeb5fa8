"""The refill engine's caches (``search/refill.py``): a batch's caches (``models/kv_cache.py``) laid out as ``L``
fixed input lanes, each lane at its own step (:class:`LaneSteps`), so inputs at different steps share one decode
step of one shape. They store; ``models/attention.py`` attends. Rows are lane-major (``row = l * R + k``)."""

from __future__ import annotations

import torch
from torch import Tensor

from seqgen_cli.models.attention import Block
from seqgen_cli.models.kv_cache import BackPointers, DecoderOnlyKVCache, EncoderDecoderKVCache
from seqgen_cli.shapes import span_bucket


class LaneSteps:
    """What both refill caches (``search/refill.py``) share: a step counter per lane (``steps`` [L], on the
    device), so inputs at different steps share one decode step.

    A step writes every lane's keys/values at that lane's own step and attends over the first ``span`` positions
    under a mask (position ``<=`` the lane's step, and the back-pointers). ``span`` (host int, set per step by
    :meth:`check` from the furthest live lane's step, ``ages``) is a bucket, not the oldest input's step: :func:`~seqgen_cli.shapes.span_bucket`, at least ``MIN_SPAN`` positions,
    so its shape changes a few times per run, and an input's sums run over the same span beside any neighbours
    wherever its own steps fit in ``MIN_SPAN`` (a sum over more masked positions can round differently).
    ``position`` ([N]: each row's step) is what a backend reads for positions. Unwritten and stale positions hold
    finite values (zeros at start), always masked; an idle lane (no input) keeps stepping, its counter stops at
    ``T - 1`` and it always sees position 0, so its rows stay finite and its writes stay in its own rows.
    """

    r: int
    max_len: int
    span: int
    ptrs: BackPointers
    steps: Tensor  # [L] int64: the step each lane writes
    position: Tensor  # [N] int64: the step (position) each row writes
    ages: list[int | None]  # host: each lane's step (``None``: idle), what ``steps`` holds for the live lanes

    def _init_steps(self, lanes: int, device: torch.device) -> None:
        self.steps = torch.zeros(lanes, dtype=torch.long, device=device)
        self.position = torch.zeros(lanes * self.r, dtype=torch.long, device=device)
        self._lanes = torch.arange(lanes, device=device)
        self.ages = [None] * lanes

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
        self.position.view(s, r).copy_(self.steps[:, None])  # [L] -> [L, R]

    def advance(self) -> None:
        """A step is done: every lane moves on (queued; an idle lane stops at the last one)."""
        self.steps.add_(1).clamp_(max=self.max_len - 1)
        self._row_steps()
        self.ages = [None if a is None else min(a + 1, self.max_len - 1) for a in self.ages]

    def visible(self, span: int) -> Tensor:
        """Which of the first ``span`` positions each query row sees (its own step and before, its back-pointers;
        position 0 always): bool [L, Rq, span, R], or [L, 1, span, 1] if R = 1."""
        s, r = self.steps.shape[0], self.r
        pos = self.ptrs.positions[:span]
        upto = ((pos[None, :] <= self.steps[:, None]) | (pos == 0)).view(s, 1, span, 1)  # [L, 1, span, 1]
        if r == 1:
            return upto
        self.ptrs.ptr.scatter_(1, self.position[:, None], self.ptrs.beams.repeat(s)[:, None])  # own beam
        return (self.ptrs.ptr[:, :span].view(s, r, span, 1) == self.ptrs.beams) & upto  # [L, Rq, span, R]


class LaneKVCache(LaneSteps, EncoderDecoderKVCache):
    """:class:`EncoderDecoderKVCache` for the refill engine, each lane at its own step (:class:`LaneSteps`)."""

    def __init__(
        self,
        layers: int,
        lanes: int,
        rows_per_input: int,
        heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        window: int | None = None,
    ) -> None:
        super().__init__(layers, lanes, rows_per_input, heads, max_len, head_dim, dtype, device, window)
        self.make_static()  # zeros; a span bucket of positions attended
        self._init_steps(lanes, device)
        # [L * H] int64: where this step's keys go in a layer's cache viewed as [L * H * T, R, d]
        self.where = torch.zeros(lanes * heads, dtype=torch.long, device=device)
        self._heads = torch.arange(heads, device=device)

    def begin(self, bias: Tensor | None = None) -> None:
        """A step starts. ``bias``: the relative position bias [L', H, N, T] (row ``n``'s query step against every
        key position; L' = 1, shared by the layers, or one per layer)."""
        s, h, r, t, span = self.steps.shape[0], self.heads, self.r, self.max_len, self.span
        self.where = ((self._lanes[:, None] * h + self._heads) * t + self.steps[:, None]).view(-1)  # [L * H]
        visible = self.visible(span).expand(s, r, span, r).reshape(s, 1, r, span * r)  # [L, 1, Rq, span*R]
        if bias is not None:  # [L', H, N, T] -> [L', L, H, Rq, span] -> [L', L, H, Rq, span*R]
            layers = bias.shape[0]
            bias = bias[..., :span].view(layers, h, s, r, span).transpose(1, 2).float()
            bias = bias[..., None].expand(layers, s, h, r, span, r).reshape(layers, s, h, r, span * r)
        self.bias = torch.where(visible, 0.0 if bias is None else bias, float("-inf"))  # [[L',] L, 1|H, Rq, span*R]
        if self.window is not None:
            self.windowed = self._slide(self.steps)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this step's ``k``/``v`` ([N, H, d]) of ``layer`` at each lane's step; returns the keys (transposed)
        and values of the first ``span`` positions, [L, H, d, span*R] and [L, H, span*R, d] (views)."""
        kl, vl = self.k[layer], self.v[layer]  # [L, H, T, R, d]
        s, h, r, d, t = kl.shape[0], self.heads, self.r, self.head_dim, self.max_len
        for cache, new in ((kl, k), (vl, v)):  # [N, H, d] -> [L, H, R, d] -> [L * H, R, d]
            rows = new.view(s, r, h, d).transpose(1, 2).reshape(s * h, r, d)
            cache.view(s * h * t, r, d).index_copy_(0, self.where, rows)
        span = self.span
        keys_t = kl[:, :, :span].view(s, h, span * r, d).transpose(-1, -2)  # contiguous per (s, h): no copy
        return keys_t, vl[:, :, :span].view(s, h, span * r, d)


class DecoderOnlyLaneKVCache(LaneSteps, DecoderOnlyKVCache):
    """:class:`DecoderOnlyKVCache` for the refill engine: per lane a prompt region and generated positions at
    the lane's own step (:class:`LaneSteps`).

    The prompt region (``pk`` [L, Hkv, d, W], ``pv`` [L, Hkv, W, d], ``prompt_bias`` [L, 1, 1, W]) holds a joiner's
    prefill as it came, left-padded to its own width ``w`` (a function of its length), in columns ``[0, w)``; the
    rest is masked (zeros, or a previous input's stale keys). ``widen`` grows every lane's region (masked, on the
    right) when a wider joiner comes. A row's scores are ``[generated span*R | prompt W]`` under one float32
    softmax: generated first, so the columns of an input's real keys depend on its own width and the span only,
    and a wider region only adds masked columns at the end.
    """

    def __init__(
        self,
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
    ) -> None:
        kv = [
            torch.zeros(lanes, kv_heads, width, head_dim, dtype=dtype, device=device) for _ in range(layers)
        ]
        mask = torch.zeros(lanes, width, dtype=torch.long, device=device)  # all masked until a join
        super().__init__(kv, [x.clone() for x in kv], mask, rows_per_input, max_len, window)
        self.make_static()  # zeros; a span bucket of positions attended
        self.widths = torch.zeros(lanes, dtype=torch.long, device=device)  # [L]: each joiner's own prompt width
        self._init_steps(lanes, device)
        t = self.max_len
        # where this step's keys ([L * Hkv * d] rows of [L * Hkv * d * T, R]) and values ([L * Hkv] rows of
        # [L * Hkv * T, R, d]) go: row ``i``'s position 0, plus the lane's step
        self._key_base = (torch.arange(lanes * kv_heads * head_dim, device=device) * t).view(lanes, -1)
        self._value_base = (torch.arange(lanes * kv_heads, device=device) * t).view(lanes, -1)
        self.where_k = self._key_base.reshape(-1)
        self.where_v = self._value_base.reshape(-1)

    @property
    def width(self) -> int:
        return self.prompt_bias.shape[-1]

    def widen(self, width: int) -> None:
        """Room for prompts of ``width`` positions: every lane's region grows, masked, on the right."""
        grow = width - self.width
        if grow > 0:
            pad = torch.nn.functional.pad
            self.pk = [pad(k, (0, grow)) for k in self.pk]  # [L, Hkv, d, W]
            self.pv = [pad(v, (0, 0, 0, grow)) for v in self.pv]  # [L, Hkv, W, d]
            self.prompt_bias = pad(self.prompt_bias, (0, grow), value=float("-inf"))  # [L, 1, 1, W]

    def put_prompt(self, lanes: Tensor, pk: list[Tensor], pv: list[Tensor], mask: Tensor) -> None:
        """The prefill of joiners taking lanes ``lanes`` ([J] int64): K/V [J, Hkv, w, d] per layer and mask [J, w]
        (``w <= W``) go into columns ``[0, w)``; the rest of their region is masked."""
        w = mask.shape[1]
        for i, (k, v) in enumerate(zip(pk, pv, strict=True)):
            self.pk[i].narrow(3, 0, w).index_copy_(0, lanes, k.transpose(-1, -2))  # [J, Hkv, d, w]
            self.pv[i].narrow(2, 0, w).index_copy_(0, lanes, v)  # [J, Hkv, w, d]
        bias = torch.full((mask.shape[0], self.width), float("-inf"), device=mask.device)  # [J, W]
        bias[:, :w].masked_fill_(mask != 0, 0.0)
        self.prompt_bias.index_copy_(0, lanes, bias[:, None, None, :])
        self.widths.index_fill_(0, lanes, w)

    def begin(self) -> None:
        """A step starts: where each lane writes, and the generated-position bias of every row."""
        s, r, span = self.steps.shape[0], self.r, self.span
        self.where_k = (self._key_base + self.steps[:, None]).view(-1)  # [L * Hkv * d]
        self.where_v = (self._value_base + self.steps[:, None]).view(-1)  # [L * Hkv]
        visible = self.visible(span).expand(s, r, span, r)  # [L, Rq, span, R]
        visible = visible.reshape(s, 1, r, 1, span * r)  # [L, 1, Rq, 1, span*R]
        zeros = torch.zeros(visible.shape, device=visible.device, dtype=torch.float32)
        self.gen_bias = zeros.masked_fill_(~visible, float("-inf"))
        if self.window is not None:
            self._window(self.steps, self.widths)

    def update(self, layer: int, k: Tensor, v: Tensor, sliding: bool = False) -> list[Block]:
        """Store this step's ``k``/``v`` ([N, Hkv, d], after any RoPE) of ``layer`` at each lane's step; returns
        what a query attends, in score order: the first ``span`` generated positions' keys [L, Hkv, d, span*R], values
        [L, Hkv, span*R, d] and bias, then the prompt region's [L, Hkv, d, W], [L, Hkv, W, d] and bias."""
        s, r, hkv, d, t, span = self.steps.shape[0], self.r, k.shape[1], k.shape[2], self.max_len, self.span
        gk, gv = self.gk[layer], self.gv[layer]  # [L, Hkv, d, T, R], [L, Hkv, T, R, d]
        keys = k.view(s, r, hkv, d).permute(0, 2, 3, 1).reshape(s * hkv * d, r)  # [N, Hkv, d] -> [L*Hkv*d, R]
        gk.view(s * hkv * d * t, r).index_copy_(0, self.where_k, keys)
        values = v.view(s, r, hkv, d).transpose(1, 2).reshape(s * hkv, r, d)  # [N, Hkv, d] -> [L*Hkv, R, d]
        gv.view(s * hkv * t, r, d).index_copy_(0, self.where_v, values)
        keys_t = gk[:, :, :, :span].view(s, hkv, d, span * r)  # lane-major: index s*R + beam
        vals = gv[:, :, :span].view(s, hkv, span * r, d)
        prompt_bias, gen_bias = (self.prompt_bias[:, :, :, None], self.gen_bias)
        if sliding and self.windowed is not None:
            prompt_bias, gen_bias = self.windowed
        return [(keys_t, vals, gen_bias), (self.pk[layer], self.pv[layer], prompt_bias)]
