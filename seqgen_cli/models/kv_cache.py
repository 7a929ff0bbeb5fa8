"""Self-attention caches of the fast backends: preallocated, written in place, never moved by beam reordering.

Both hold ``T = max_new_tokens`` slots per row; step ``t`` writes slot ``t`` of every row. The keys and values
of an input's ``R`` beams lie side by side (``[..., T, R, d]``), so the used part is a free view of
``(t+1) * R`` keys per input. Reordering moves only back-pointers (:class:`BackPointers`); each query beam
scores against all its input's keys and a mask built from the back-pointers keeps its own history. That
costs ``R`` times the score FLOPs on tiny matrices instead of copying or gathering the cache every step
(measured against both in docs/BENCHMARKS.md, "Self-attention cache: reorder strategies").

Step counters are host integers, so nothing here syncs with the device. Rows are input-major
(``row = b * R + k``, see ``seqgen_cli/search/protocol.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class BackPointers:
    """``ptr[n, s]``: the beam (``0..R-1``, same input) whose slot ``s`` is in row ``n``'s history."""

    def __init__(self, inputs: int, rows_per_input: int, max_len: int, device: torch.device) -> None:
        self.r = rows_per_input
        self.ptr = torch.zeros(inputs * rows_per_input, max_len, dtype=torch.long, device=device)  # [N, T]
        self.beams = torch.arange(rows_per_input, device=device)  # [R]
        self.reordered = False  # host flag: before any reorder, every row's history is all its own

    def begin(self, t: int) -> Tensor | None:
        """Step ``t`` writes slot ``t`` of every row. Returns which slots each query row sees: bool
        [B, Rq, t+1, R] (slot ``s`` of beam ``r``), or None if R = 1 (a row sees all its slots).

        Raises ``ValueError`` past the ``T`` slots allocated by the backend's ``start()``.
        """
        n, max_len = self.ptr.shape
        if t >= max_len:
            raise ValueError(f"step {t} beyond the {max_len} positions allocated by start()")
        r, b = self.r, n // self.r
        self.ptr[:, t] = self.beams.repeat(b)
        if r == 1:
            return None
        if not self.reordered:  # own beam only
            return (self.beams[:, None] == self.beams).view(1, r, 1, r).expand(b, r, t + 1, r)
        return self.ptr.view(b, r, -1)[:, :, : t + 1, None] == self.beams  # [B, Rq, t+1, R]

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input)."""
        self.ptr = self.ptr.index_select(0, rows)
        self.reordered = True

    def keep(self, rows: Tensor) -> None:
        """Keep rows ``rows`` ([B' * R], whole inputs): beam indices stay valid within an input."""
        self.ptr = self.ptr.index_select(0, rows)


class EncoderDecoderKVCache:
    """Self-attention of the encoder-decoder backends' decoders: one SDPA per layer, back-pointers as mask."""

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
        self.ptrs = BackPointers(inputs, rows_per_input, max_len, device)
        self.t = 0  # this step's slot
        self.mask: Tensor | None = None  # bool or additive, [B or 1, 1 or H, Rq, (t+1)*R]; None = all

    def begin(self, t: int, bias: Tensor | None = None) -> None:
        """Step ``t`` starts; ``bias`` [1, H, 1, t+1]: additive attention bias over positions (T5)."""
        self.t = t
        _, b, h, _, r, _ = self.k.shape
        visible = self.ptrs.begin(t)  # [B, Rq, t+1, R] or None
        if visible is not None:
            visible = visible.reshape(b, 1, r, (t + 1) * r)  # [B, 1, Rq, (t+1)*R], key index p*R + r
        if bias is not None:
            bias = bias[..., None].expand(1, h, 1, t + 1, r).reshape(1, h, 1, (t + 1) * r)
            if visible is not None:
                bias = bias.masked_fill(~visible, float("-inf"))  # [B, H, Rq, (t+1)*R]
            self.mask = bias
        else:
            self.mask = visible

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store this step's ``k``/``v`` ([N, H, d]); attend ``q`` [N, H, d] over each history -> [N, H*d]."""
        t = self.t
        _, b, h, _, r, d = self.k.shape
        kl, vl = self.k[layer], self.v[layer]  # [B, H, T, R, d]
        kl[:, :, t] = k.view(b, r, h, d).transpose(1, 2)  # [N, H, d] -> [B, H, R, d]
        vl[:, :, t] = v.view(b, r, h, d).transpose(1, 2)
        keys = kl[:, :, : t + 1].view(b, h, (t + 1) * r, d)  # contiguous per (b, h): no copy
        values = vl[:, :, : t + 1].view(b, h, (t + 1) * r, d)
        qb = q.view(b, r, h, d).transpose(1, 2)  # [B, H, Rq, d]
        out = F.scaled_dot_product_attention(
            qb, keys, values, attn_mask=self.mask, scale=scale
        )  # [B, H, Rq, d]
        return out.transpose(1, 2).reshape(b * r, h * d)  # [B, Rq, H, d] -> [N, H*d]

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move."""
        self.ptrs.reorder(rows)

    def keep(self, inputs: Tensor, rows: Tensor) -> None:
        """Keep only inputs ``inputs`` ([B'] int64), i.e. rows ``rows`` ([B' * R])."""
        self.k = self.k.index_select(1, inputs)
        self.v = self.v.index_select(1, inputs)
        self.ptrs.keep(rows)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.ptrs.ptr.nbytes


class DecoderOnlyKVCache:
    """Decoder-only self-attention: the prompt's K/V once per input, shared by its beams, then generated K/V.

    ``Hkv`` = K/V heads (never repeated for grouped-query attention). Keys are stored transposed: CPU ``bmm``
    is ~2x faster on a contiguous ``K^T`` than on a transposed view (docs/BENCHMARKS.md, "Beam-reorder
    strategy"). Prompt and generated scores share one float32 softmax (exact).
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
        self.gk = [torch.empty(b, hkv, d, max_len, r, device=dev, dtype=dt) for _ in pk]  # [B, Hkv, d, T, R]
        self.gv = [torch.empty(b, hkv, max_len, r, d, device=dev, dtype=dt) for _ in pk]  # [B, Hkv, T, R, d]
        bias = torch.zeros(mask.shape, device=dev, dtype=torch.float32)
        self.prompt_bias = bias.masked_fill(mask == 0, float("-inf"))[:, None, None, :]  # [B, 1, 1, P]
        self.ptrs = BackPointers(b, r, max_len, dev)
        self.r = r
        self.t = 0  # this step's slot
        self.used = 0  # slots written so far
        self.gen_bias: Tensor | None = None  # [B, 1, Rq, 1, (t+1)*R] float32; None if R == 1

    def begin(self, t: int) -> None:
        """Step ``t`` starts: build the generated-slot bias once for all layers."""
        own = self.ptrs.begin(t)  # [B, Rq, t+1, R] or None
        self.t, self.used = t, t + 1
        if own is None:
            self.gen_bias = None
            return
        b, r = own.shape[0], self.r
        bias = torch.zeros(own.shape, device=own.device, dtype=torch.float32).masked_fill_(
            ~own, float("-inf")
        )
        self.gen_bias = bias.view(b, 1, r, 1, (t + 1) * r)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store this step's ``k``/``v`` ([N, Hkv, d], after any RoPE); attend ``q`` [N, H, d] -> [N, H*d]."""
        n, h, d = q.shape
        b, r, t = self.prompt_bias.shape[0], self.r, self.t
        hkv = k.shape[1]
        g = h // hkv
        gk, gv = self.gk[layer], self.gv[layer]
        gk[:, :, :, t] = k.view(b, r, hkv, d).permute(0, 2, 3, 1)  # [B, Hkv, d, R]
        gv[:, :, t] = v.view(b, r, hkv, d).transpose(1, 2)  # [B, Hkv, R, d]
        # queries of one input's beams and one K/V head's group: [B, Hkv, R*G, d]
        qg = q.view(b, r, hkv, g, d).transpose(1, 2).reshape(b, hkv, r * g, d)
        keys_t = gk[:, :, :, : t + 1].view(b, hkv, d, (t + 1) * r)  # slot-major: index s*R + beam
        vals = gv[:, :, : t + 1].view(b, hkv, (t + 1) * r, d)
        sp = torch.matmul(qg, self.pk[layer]).mul_(scale)  # [B, Hkv, R*G, P]
        sg = torch.matmul(qg, keys_t).mul_(scale)  # [B, Hkv, R*G, (t+1)*R]
        p = sp.shape[-1]
        scores = torch.cat([sp.float() + self.prompt_bias, sg.float()], dim=-1)  # [B, Hkv, R*G, P+(t+1)*R]
        if self.gen_bias is not None:
            scores.view(b, hkv, r, g, -1)[..., p:] += self.gen_bias
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs[..., :p], self.pv[layer])
        out += torch.matmul(probs[..., p:], vals)  # [B, Hkv, R*G, d]
        return out.view(b, hkv, r, g, d).transpose(1, 2).reshape(n, h * d)  # [B, R, Hkv, G, d] -> [N, H*d]

    def reorder(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N] int64, same input): only back-pointers move."""
        self.ptrs.reorder(rows)

    def keep(self, inputs: Tensor, rows: Tensor) -> None:
        """Keep inputs ``inputs`` ([B']), i.e. rows ``rows`` ([B' * R]); copies only the used slots."""
        used = self.used
        for i in range(len(self.pk)):
            self.pk[i] = self.pk[i].index_select(0, inputs)
            self.pv[i] = self.pv[i].index_select(0, inputs)
            for cache, slot_dim in ((self.gk, 3), (self.gv, 2)):
                old = cache[i]
                new = old.new_empty((inputs.shape[0], *old.shape[1:]))
                new.narrow(slot_dim, 0, used).copy_(old.narrow(slot_dim, 0, used).index_select(0, inputs))
                cache[i] = new
        self.prompt_bias = self.prompt_bias.index_select(0, inputs)
        self.ptrs.keep(rows)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.pk + self.pv + self.gk + self.gv) + self.ptrs.ptr.nbytes
