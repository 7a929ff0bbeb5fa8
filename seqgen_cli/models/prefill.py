"""The decoder-only decoder's prefill: the prompts through the model's own base forward, once per *input*.

Left-padded prompts, position ids as ``generate()`` builds them; every layer's keys and values come back for the
backend's cache (``kv_cache.DecoderOnlyKVCache``) and the last position's logits for the search's first step. Where
the run's prompts begin with a shared head (a system prompt, few-shot examples: ``prompts.Prompter.head``), its keys
and values are computed once and each prompt's own tokens prefilled over them (:meth:`Prefill.over_head`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from torch import Tensor

from seqgen_cli.models.attention import soft_cap
from seqgen_cli.models.linear_maps import dense
from seqgen_cli.search.protocol import Batch

MIN_SHARED = 8  # tokens of a shared prompt head worth a forward of its own (:meth:`Prefill.share`)

Prefilled = tuple[list[Tensor], list[Tensor], Tensor]  # per layer K and V [B, Hkv, W, d], last logits [B, V]


def prompt_position_ids(mask: Tensor) -> Tensor:
    """Position ids of a left-padded prompt exactly as ``generate()`` builds them: mask [B, W] -> [B, W]."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def check_batch(batch: Batch) -> None:
    """Decoder-only prompts must be left-padded: every row's last position is a real token."""
    if batch.attention_mask.shape[1] and not bool(batch.attention_mask[:, -1].all()):
        raise ValueError("decoder-only prompts must be left-padded")


class Prefill:
    """``prefill(batch)``: left-padded prompts [B, W] -> per layer K/V [B, Hkv, W, d] and the last position's
    logits [B, V] (float32, soft-capped at ``final_softcap``): the model's own base forward over each prompt
    (:meth:`forward`), or over its own tokens past the shared head (:meth:`over_head`) where it begins with it.
    ``shared``: the head's counts for ``--stats`` (``device.shared_prompt``)."""

    def __init__(self, model: torch.nn.Module, final_softcap: float | None) -> None:
        self.model, self.base, self.final_softcap = model, model.base_model, final_softcap
        # the cache argument of the base forward: ``cache`` (transformers >= 5.24), before ``past_key_values``
        params = inspect.signature(self.base.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.share(())  # no shared prompt head until the Generator gives one

    def share(self, head: Sequence[int]) -> None:
        """Prompts that begin with ``head`` (tokens every prompt of the run's settings begins with: a system prompt,
        few-shot examples, a template's text before the input; ``prompts.Prompter.head``) have its keys and values
        computed once, at its first use, and only their own tokens prefilled over them. A head under
        ``MIN_SHARED`` tokens is not worth a forward of its own."""
        device = self.model.get_output_embeddings().weight.device
        self.head = torch.tensor(list(head), device=device) if len(head) >= MIN_SHARED else None  # [P]
        self.head_kv: tuple[list[Tensor], list[Tensor]] | None = None
        tokens = 0 if self.head is None else len(self.head)
        self.shared = {"tokens": tokens, "prefills": 0, "inputs": 0}  # --stats: device.shared_prompt

    def __call__(self, batch: Batch) -> Prefilled:
        """Each group of prompts (over the head, or whole) apart, then merged in the batch's order."""
        over = self.begins_with_head(batch)
        if over is None or not bool(over.any()):
            return self.forward(batch)
        if bool(over.all()):
            return self.over_head(batch)
        ids, mask, merged = batch.input_ids, batch.attention_mask, None
        for rows, prefill in ((over, self.over_head), (~over, self.forward)):
            k, v, lg = prefill(Batch(ids[rows], mask[rows]))
            if merged is None:  # [B, ...] each: every layer's K and V, the logits
                merged = [x.new_empty((ids.shape[0], *x.shape[1:])) for x in (*k, *v, lg)]
            at = rows.nonzero()[:, 0]  # [B_g]
            for dst, src in zip(merged, (*k, *v, lg), strict=True):
                dst.index_copy_(0, at, src)
        n = len(k)
        return merged[:n], merged[n : 2 * n], merged[-1]

    def forward(self, batch: Batch) -> Prefilled:
        """The model's own base forward over left-padded prompts [B, W] (position ids as ``generate()`` builds them):
        per layer K/V [B, Hkv, W, d], and the last position's logits [B, V]."""
        ids, mask = batch.input_ids, batch.attention_mask
        hf_mask = mask if not bool(mask.all()) else None  # as generate(): no mask without padding
        hidden, keys, values = self.base_forward(ids, hf_mask, prompt_position_ids(mask))
        return keys, values, self.logits(hidden[:, -1])

    def base_forward(
        self, ids: Tensor, mask: Tensor | None, position_ids: Tensor, cache: Any = None
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The model's own base forward over ``ids`` [B, S] (over ``cache``'s keys and values where given): the last
        hidden states [B, S, D] and every layer's K/V [B, Hkv, past + S, d]. A cache without the config's layer
        kinds: every layer keeps every position, windowed or not."""
        cache = transformers.DynamicCache() if cache is None else cache
        kwargs = {self.cache_kwarg: cache}
        out = self.base(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **kwargs
        )
        layers = getattr(out, self.cache_kwarg).layers  # the output names it as the forward's argument
        return out.last_hidden_state, [layer.keys for layer in layers], [layer.values for layer in layers]

    def logits(self, hidden: Tensor) -> Tensor:
        """The LM head over the last positions' hidden states [B, D] -> [B, V] float32 (oneDNN on the CPU: an
        input's row whatever the batch)."""
        lm_head = self.model.get_output_embeddings()
        return soft_cap(dense(hidden, lm_head.weight, lm_head.bias).float(), self.final_softcap)

    def begins_with_head(self, batch: Batch) -> Tensor | None:
        """Which prompts of ``batch`` ([B, W] left-padded) begin with the shared head and go on past it: bool [B];
        ``None`` without a head."""
        if self.head is None:
            return None
        ids, mask = batch.input_ids, batch.attention_mask
        p, w = len(self.head), ids.shape[1]
        if p >= w:
            return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        lengths = mask.sum(dim=1)  # [B]
        # [B, P]: each prompt's first P columns
        cols = (w - lengths)[:, None] + torch.arange(p, device=ids.device)
        return (ids.gather(1, cols.clamp(max=w - 1)) == self.head).all(dim=1) & (lengths > p)  # [B]

    def head_keys(self) -> tuple[list[Tensor], list[Tensor]]:
        """The shared head's keys and values per layer, [1, Hkv, P, d] each: one forward, at its first use."""
        if self.head_kv is None:
            ids = self.head[None]  # [1, P]
            position_ids = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, P]
            _, keys, values = self.base_forward(ids, None, position_ids)
            self.head_kv = keys, values
            self.shared["prefills"] += 1
        return self.head_kv

    def over_head(self, batch: Batch) -> Prefilled:
        """Prompts [B, W] (left-padded) that begin with the shared head (``P`` tokens): each prompt's own ``s_i``
        tokens, left-aligned in ``W'`` columns (``W - P`` up to a multiple of 8; padding after them, where a causal
        model's real tokens never look), go through the model's own base forward over the head's keys and values,
        at position ids ``P..``: head and own tokens contiguous, as in the whole prompt, so sliding windows count as
        ``generate()``'s do. Returns what :meth:`forward` returns, the K/V laid out as the whole left-padded
        prompt's. ``W'`` follows from the prompt's own width: an input's prefill does not depend on its
        neighbours."""
        ids, mask = batch.input_ids, batch.attention_mask
        hk, hv = self.head_keys()
        b, w, p = ids.shape[0], ids.shape[1], hk[0].shape[2]
        own = mask.sum(dim=1) - p  # [B] tokens past the head, >= 1
        # [W']: W - P up to a multiple of 8 (row-invariant products)
        j = torch.arange(-(-(w - p) // 8) * 8, device=ids.device)
        new_ids = ids.gather(1, (w - own[:, None] + j).clamp(max=w - 1))  # [B, W']: own tokens, then repeats
        new_mask = (j < own[:, None]).long()  # [B, W']
        cache = transformers.DynamicCache()
        for i, (k, v) in enumerate(zip(hk, hv, strict=True)):  # [1, Hkv, P, d] -> [B, Hkv, P, d] (copied)
            cache.update(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1), i)
        attend = torch.cat([torch.ones_like(ids[:, :p]), new_mask], dim=1)  # [B, P + W']
        position_ids = p + torch.minimum(j, own[:, None] - 1)  # the padding repeats an input's last position
        hidden, keys, values = self.base_forward(new_ids, attend, position_ids, cache)  # [B, Hkv, P + W', d]
        # the whole left-padded prompt's layout: row i's P + s_i real columns end at W (shifted right by W - P - s_i)
        at = (torch.arange(w, device=ids.device) - (w - p - own)[:, None]).clamp(min=0)  # [B, W]
        hkv, d = hk[0].shape[1], hk[0].shape[3]
        at = at[:, None, :, None].expand(b, hkv, w, d)  # [B, Hkv, W, d]
        last = hidden.gather(1, (own - 1)[:, None, None].expand(b, 1, hidden.shape[2]))  # [B, 1, D]
        self.shared["inputs"] += b
        logits = self.logits(last[:, 0])  # [B, V]
        return [k.gather(2, at) for k in keys], [v.gather(2, at) for v in values], logits
