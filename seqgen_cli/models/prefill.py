"""The decoder-only decoder's prefill: the prompts through the model's own base forward, once per *input*.

Left-padded prompts, position ids as ``generate()`` builds them; every layer's keys and values come back for the
backend's cache (``kv_cache.DecoderOnlyKVCache``) and the last position's logits for the search's first step. A
prompt with breaks (``Batch.breaks``: after a conversation's messages, before the input's text) is prefilled
segment by segment through the run's prompt tree (``prompt_tree.py``), so any segment that prompts share (a system
turn, few-shot examples, a task's instruction) is computed once per run.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers
from torch import Tensor

from seqgen_cli.models.attention import soft_cap
from seqgen_cli.models.linear_maps import dense
from seqgen_cli.models.prompt_tree import Key, PromptTree, segment_ends, segment_key, span
from seqgen_cli.search.protocol import Batch
from seqgen_cli.shapes import input_width

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
    (:meth:`forward`), or segment by segment through the run's prompt tree (:meth:`through_tree`) where it has
    breaks. (A RoPE that depends on the call's length, whose segments would get other frequencies than the whole
    prompt, has no fast backend: ``families.refusal``.)"""

    def __init__(self, model: torch.nn.Module, final_softcap: float | None) -> None:
        self.model, self.base, self.final_softcap = model, model.base_model, final_softcap
        # the cache argument of the base forward: ``cache`` (transformers >= 5.24), before ``past_key_values``
        params = inspect.signature(self.base.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.tree = PromptTree()

    def __call__(self, batch: Batch) -> Prefilled:
        """The prompts with more than one segment through the tree, the others whole, merged in the batch's order."""
        split = self.splits(batch)
        if split is None or not any(split):
            return self.forward(batch)
        if all(split):
            return self.through_tree(batch)
        b, merged = len(split), None
        tree = torch.tensor(split, device=batch.input_ids.device)  # [B] bool
        for rows, prefill in ((tree, self.through_tree), (~tree, self.forward)):
            k, v, lg = prefill(batch.select(rows))
            if merged is None:  # [B, ...] each: every layer's K and V, the logits
                merged = [x.new_empty((b, *x.shape[1:])) for x in (*k, *v, lg)]
            at = rows.nonzero()[:, 0]  # [B_g]
            for dst, src in zip(merged, (*k, *v, lg), strict=True):
                dst.index_copy_(0, at, src)
        n = len(k)
        return merged[:n], merged[n : 2 * n], merged[-1]

    def splits(self, batch: Batch) -> list[bool] | None:
        """Which prompts of ``batch`` split into more than one segment (``prompt_tree.segment_ends``); ``None``
        without breaks."""
        if batch.breaks is None:
            return None
        lengths = batch.attention_mask.sum(dim=1).tolist()
        return [len(segment_ends(n, b)) > 1 for n, b in zip(lengths, batch.breaks.tolist(), strict=True)]

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

    def through_tree(self, batch: Batch) -> Prefilled:
        """Prompts [B, W] (left-padded, with ``breaks``) segment by segment: each prompt's kept segments from the
        tree, then round by round every prompt's next segment (once for the prompts that share it, grouped by
        their widths: :meth:`over`), kept for later prompts. Returns what :meth:`forward` returns, the K/V laid out
        as the whole left-padded prompts'."""
        assert batch.breaks is not None
        w = batch.input_ids.shape[1]
        lengths = batch.attention_mask.sum(dim=1).tolist()
        prompts = [row[w - n :] for row, n in zip(batch.input_ids.tolist(), lengths, strict=True)]
        ends = [segment_ends(n, b) for n, b in zip(lengths, batch.breaks.tolist(), strict=True)]
        chains = [self.tree.chain(p, e) for p, e in zip(prompts, ends, strict=True)]  # each: [L, 2, Hkv, s, d]
        last: list[Tensor | None] = [None] * len(prompts)  # each prompt's last hidden state [D]
        while todo := [i for i, chain in enumerate(chains) if len(chain) < len(ends[i])]:
            takers: dict[Key, list[int]] = {}  # a segment -> the prompts that take it next
            for i in todo:
                takers.setdefault(segment_key(prompts[i], ends[i], len(chains[i])), []).append(i)
            groups: dict[tuple[int, int], list[Key]] = {}  # segments by (prefix width, segment width)
            for key in takers:
                start, end = span(key)
                groups.setdefault((input_width(start) if start else 0, input_width(end - start)), []).append(key)
            for (prefix_width, width), keys in groups.items():
                pasts = [chains[takers[key][0]] for key in keys]
                kv, hidden = self.over(pasts, [list(key[1]) for key in keys], prefix_width, width)
                for g, key in enumerate(keys):
                    start, end = span(key)
                    seg = kv[:, :, g, :, : end - start].clone()  # [L, 2, Hkv, s, d]
                    rows = takers[key]
                    self.tree.computed(key, seg, keep=any(len(prompts[i]) > end for i in rows))
                    for n, i in enumerate(rows):
                        if n:  # the prompts after the first take it as computed
                            self.tree.took(key, seg)
                        chains[i].append(seg)
                        if len(prompts[i]) == end:  # its last segment
                            last[i] = hidden[g]
        keys, values = self.laid_out(chains, w)
        return keys, values, self.logits(torch.stack(last))  # type: ignore[arg-type]

    def over(
        self, pasts: list[list[Tensor]], segments: list[list[int]], prefix_width: int, width: int
    ) -> tuple[Tensor, Tensor]:
        """Segments (``s_g`` tokens each, left-aligned in ``width`` columns: padding after them, never read by a
        causal model's real tokens) through the model's own base forward over their prefixes' K/V (``pasts``: each
        one's segments, ``a_g`` positions right-aligned in ``prefix_width`` columns, masked zeros before), at
        position ids ``a_g..``: prefix and segment contiguous as in the whole prompt, so sliding windows count as
        ``generate()``'s do. Both widths follow from the segment's own lengths (``input_width``), so its bits do not
        depend on the segments beside it. -> K/V [L, 2, G, Hkv, width, d], the last real positions' hidden states
        [G, D]."""
        device = self.model.get_output_embeddings().weight.device
        starts = [sum(int(kv.shape[3]) for kv in chain) for chain in pasts]
        own = [len(seg) - a for seg, a in zip(segments, starts, strict=True)]
        tokens = [seg[a:] + seg[-1:] * (width - s) for seg, a, s in zip(segments, starts, own, strict=True)]
        ids = torch.tensor(tokens, device=device)  # [G, W']: the segment's tokens, then its last repeated
        a, s = torch.tensor(starts, device=device)[:, None], torch.tensor(own, device=device)[:, None]  # [G, 1]
        j = torch.arange(width, device=device)  # [W']
        before = torch.arange(prefix_width, device=device) >= prefix_width - a  # [G, A]: the prefix's columns
        attend = torch.cat([before, j < s], dim=1).long()  # [G, A + W']
        position_ids = a + torch.minimum(j, s - 1)  # [G, W']: the padding repeats the segment's last position
        cache = None
        if prefix_width:
            past = self.stacked(pasts, prefix_width)  # [L, 2, G, Hkv, A, d]
            cache = transformers.DynamicCache()
            for i in range(past.shape[0]):
                cache.update(past[i, 0], past[i, 1], i)
        hidden, keys, values = self.base_forward(ids, attend, position_ids, cache)  # K/V [G, Hkv, A + W', d]
        kv = torch.stack([torch.stack([x[:, :, prefix_width:] for x in part]) for part in (keys, values)], dim=1)
        return kv, hidden[torch.arange(len(segments), device=device), s[:, 0] - 1]  # [L, 2, G, Hkv, W', d], [G, D]

    @staticmethod
    def stacked(pasts: list[list[Tensor]], width: int) -> Tensor:
        """Each group row's segments ([L, 2, Hkv, s, d] each), right-aligned in ``width`` columns after zeros ->
        [L, 2, G, Hkv, width, d]."""
        first = pasts[0][0]
        out = first.new_zeros((first.shape[0], 2, len(pasts), first.shape[2], width, first.shape[4]))
        for g, chain in enumerate(pasts):
            end = width
            for kv in reversed(chain):
                out[:, :, g, :, end - kv.shape[3] : end] = kv
                end -= kv.shape[3]
        return out

    @staticmethod
    def laid_out(chains: list[list[Tensor]], width: int) -> tuple[list[Tensor], list[Tensor]]:
        """Each prompt's segments as the whole left-padded prompts' K/V: per layer keys and values [B, Hkv, W, d]."""
        out = Prefill.stacked(chains, width)  # [L, 2, B, Hkv, W, d]
        return list(out[:, 0].unbind(0)), list(out[:, 1].unbind(0))
