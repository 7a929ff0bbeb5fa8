"""The one decoder-only decoder: every decoder-only family's decode step, written once over its description
(``families/``: GPT-2, Llama, Mistral, Qwen2/3, Phi-3, Gemma2/3), the prefill, and the protocol glue.

The prompt is prefilled once per *input* through the model's own base forward (left-padded, positions as
``generate()`` builds them); its keys and values go into a
:class:`~seqgen_cli.models.kv_cache.DecoderOnlyKVCache` shared by the input's ``R`` rows. ``decode`` (the step's
tensor work, see ``capture.py``): ``state.cache.begin()``, the layers (attention through the cache) at positions
``state.start_pos + state.cache.position``. Only the ``num_key_value_heads`` K/V heads are cached; query groups
broadcast against them (``attention.attend_blocks``). RoPE's cos/sin come from the model's own rotary module, so
its rope type and scaling are honoured exactly.

``int8=True`` (``--dtype int8``, CPU): every layer's maps and the LM head as int8 copies; the prompt's prefill stays
the model's own forward in float32.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import Tensor

from seqgen_cli.models.attention import rotary_tables, soft_cap
from seqgen_cli.models.kv_cache import DecoderOnlyKVCache, kv_bytes, select_into
from seqgen_cli.models.lane_table import pointer_bytes, run_step
from seqgen_cli.models.layers import Causal, Place, Step, sliding_layers
from seqgen_cli.models.linear_maps import dense, linear
from seqgen_cli.search.protocol import Batch
from seqgen_cli.shapes import MIN_WIDTH, graph_width, input_width


@dataclass
class DecoderOnlyState:
    """Per-call state. ``N = B * R`` rows, input-major."""

    cache: DecoderOnlyKVCache
    start_pos: Tensor  # [N] int64: position id of each row's first generated token (its prompt's length)
    t: int = 0  # tokens fed by step() so far (host int: no device sync)


MIN_SHARED = 8  # tokens of a shared prompt head worth a forward of its own (``DecoderOnlyBackend.share``)


def prompt_positions(mask: Tensor) -> Tensor:
    """Position ids of a left-padded prompt exactly as ``generate()`` builds them: [B, P] -> [B, P]."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def left_width(batch: Batch, rows: Tensor, width: int) -> Batch:
    """Rows ``rows`` ([J] int64) of left-padded prompts [B, P], as ``width`` columns: the last ``width``, or padded
    on the left (masked) to ``width`` -> [J, width]."""
    ids = batch.input_ids.index_select(0, rows)
    mask = batch.attention_mask.index_select(0, rows)
    if width <= ids.shape[1]:
        return Batch(ids[:, ids.shape[1] - width :], mask[:, mask.shape[1] - width :])
    return Batch(ids, mask).padded(ids.shape[0], width, left=True)


def check_batch(batch: Batch) -> None:
    """Decoder-only prompts must be left-padded: every row's last position is a real token."""
    if batch.attention_mask.shape[1] and not bool(batch.attention_mask[:, -1].all()):
        raise ValueError("decoder-only prompts must be left-padded")


class DecoderOnlyBackend:
    """:class:`~seqgen_cli.search.protocol.ModelBackend` for every decoder-only family of ``families.py``: prefill
    through the model's own base forward, then cached steps."""

    is_encoder_decoder = False

    def __init__(self, model: torch.nn.Module, family: Causal, int8: bool = False) -> None:
        cfg = model.config
        self.model, self.family = model, family
        self.base = model.base_model  # the transformer without its LM head
        self.layers = [family.reader(layer, int8) for layer in getattr(self.base, family.layers)]
        self.n_layers = len(self.layers)
        self.n_head = int(getattr(cfg, "num_attention_heads", None) or cfg.n_head)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_head)
        attn = getattr(self.base, family.layers)[0]
        attn = getattr(attn, "self_attn", None) or attn.attn
        self.head_dim = int(getattr(attn, "head_dim", None) or cfg.hidden_size // self.n_head)
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", None) or cfg.n_positions)
        self.embed = getattr(self.base, family.embed)  # the module (it scales where the family does: Gemma)
        self.ln_final = getattr(self.base, family.final_norm)
        self.per_type = family.positions == "rotary per layer type"  # a rotary table per layer type (Gemma3)
        sliding, self.window = sliding_layers(cfg, self.n_layers)  # which layers slide, and how far
        self.rotary_table = [lay.layer_type if self.per_type else "full_attention" for lay in self.layers]
        for i, lay in enumerate(self.layers):
            lay.at = Place(i, self.n_head, self.n_kv, self.head_dim, sliding[i], self.rotary_table[i])
        head = model.get_output_embeddings()
        self.vocab_size = int(head.weight.shape[0])
        self.lm = linear(head.weight, head.bias, int8)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.int8 = int8
        self.share(())  # no shared prompt head until the Generator gives one
        # the cache argument of the base forward: ``cache`` (transformers >= 5.24), before ``past_key_values``
        self.cache_kwarg = "cache" if "cache" in inspect.signature(self.base.forward).parameters else "past_key_values"

    def decode(self, state: DecoderOnlyState, tokens: Tensor) -> Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V] (float32)."""
        state.cache.begin()
        x = self.embed(tokens)  # [N, D]
        at = state.start_pos + state.cache.position  # [N] position ids
        if self.family.positions == "learned":
            step = Step(state.cache)
            x = x + self.base.wpe(at)
        else:
            step = Step(state.cache, rotary_tables(self.base.rotary_emb, x, at, self.rotary_table, self.per_type))
        for layer in self.layers:
            x = layer(x, step)  # [N, D]
        return soft_cap(self.lm(self.ln_final(x)).float(), self.final_softcap)  # [N, V]

    def share(self, head: Sequence[int]) -> None:
        """Prompts that begin with ``head`` (tokens every prompt of the run's settings begins with: a system prompt,
        few-shot examples, a template's text before the input; ``prompts.Prompter.head``) have its keys and values
        computed once, at its first use, and only their own tokens prefilled over them (:meth:`_prefill`). A head
        under ``MIN_SHARED`` tokens is not worth a forward of its own."""
        device = self.model.get_output_embeddings().weight.device
        self.head = torch.tensor(list(head), device=device) if len(head) >= MIN_SHARED else None  # [P]
        self.head_kv = None
        self.shared = {"tokens": 0 if self.head is None else len(self.head), "prefills": 0, "inputs": 0}  # --stats: device.shared_prompt

    def _prefill(self, batch: Batch) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Left-padded prompts [B, W] -> per layer K/V [B, Hkv, W, d] and the last position's logits [B, V]: the
        model's own base forward over each prompt (:meth:`_forward`), or over its own tokens past the shared head
        (:meth:`_over_head`) where it begins with it."""
        over = self._begins_with_head(batch)
        if over is None or not bool(over.any()):
            return self._forward(batch)
        if bool(over.all()):
            return self._over_head(batch)
        ids, mask, merged = batch.input_ids, batch.attention_mask, None
        for rows, prefill in ((over, self._over_head), (~over, self._forward)):  # each group apart, then merged
            k, v, lg = prefill(Batch(ids[rows], mask[rows]))
            if merged is None:  # [B, ...] each: every layer's K and V, the logits
                merged = [x.new_empty((ids.shape[0], *x.shape[1:])) for x in (*k, *v, lg)]
            at = rows.nonzero()[:, 0]  # [B_g]
            for dst, src in zip(merged, (*k, *v, lg), strict=True):
                dst.index_copy_(0, at, src)
        n = len(self.layers)
        return merged[:n], merged[n : 2 * n], merged[-1]

    def _forward(self, batch: Batch) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """The model's own base forward over left-padded prompts [B, W] (positions as ``generate()`` builds them):
        per layer K/V [B, Hkv, W, d], and the last position's logits [B, V]."""
        ids, mask = batch.input_ids, batch.attention_mask
        hf_mask = mask if not bool(mask.all()) else None  # as generate(): no mask without padding
        hidden, keys, values = self._base(ids, hf_mask, prompt_positions(mask))
        return keys, values, self._logits(hidden[:, -1])

    def _base(
        self, ids: Tensor, mask: Tensor | None, positions: Tensor, cache: Any = None
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The model's own base forward over ``ids`` [B, S] (over ``cache``'s keys and values where given): the last
        hidden states [B, S, D] and every layer's K/V [B, Hkv, past + S, d]. A cache without the config's layer
        kinds: every layer keeps every position, windowed or not."""
        cache = transformers.DynamicCache() if cache is None else cache
        out = self.base(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self.cache_kwarg: cache}
        )
        layers = getattr(out, self.cache_kwarg).layers  # the output names it as the forward's argument
        return out.last_hidden_state, [layer.keys for layer in layers], [layer.values for layer in layers]

    def _logits(self, hidden: Tensor) -> Tensor:
        """The LM head over the last positions' hidden states [B, D] -> [B, V] float32 (oneDNN on the CPU: an input's
        row whatever the batch)."""
        head = self.model.get_output_embeddings()
        return soft_cap(dense(hidden, head.weight, head.bias).float(), self.final_softcap)

    def _begins_with_head(self, batch: Batch) -> Tensor | None:
        """Which prompts of ``batch`` ([B, W] left-padded) begin with the shared head and go on past it: bool [B];
        ``None`` without a head."""
        if self.head is None:
            return None
        ids, mask = batch.input_ids, batch.attention_mask
        p, w = len(self.head), ids.shape[1]
        if p >= w:
            return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        lengths = mask.sum(dim=1)  # [B]
        cols = (w - lengths)[:, None] + torch.arange(p, device=ids.device)  # [B, P]: each prompt's first P columns
        return (ids.gather(1, cols.clamp(max=w - 1)) == self.head).all(dim=1) & (lengths > p)  # [B]

    def _head_kv(self) -> tuple[list[Tensor], list[Tensor]]:
        """The shared head's keys and values per layer, [1, Hkv, P, d] each: one forward, at its first use."""
        if self.head_kv is None:
            ids = self.head[None]  # [1, P]
            _, keys, values = self._base(ids, None, torch.arange(ids.shape[1], device=ids.device)[None])
            self.head_kv = keys, values
            self.shared["prefills"] += 1
        return self.head_kv

    def _over_head(self, batch: Batch) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Prompts [B, W] (left-padded) that begin with the shared head (``P`` tokens): each prompt's own ``s_i``
        tokens, left-aligned in ``C`` columns (``W - P`` up to a multiple of 8; padding after them, where a causal
        model's real tokens never look), go through the model's own base forward over the head's keys and values,
        at positions ``P..``: head and own tokens contiguous, as in the whole prompt, so sliding windows count as
        ``generate()``'s do. Returns what :meth:`_forward` returns, the K/V laid out as the whole left-padded
        prompt's. ``C`` follows from the prompt's own width: an input's prefill does not depend on its
        neighbours."""
        ids, mask = batch.input_ids, batch.attention_mask
        hk, hv = self._head_kv()
        b, w, p = ids.shape[0], ids.shape[1], hk[0].shape[2]
        own = mask.sum(dim=1) - p  # [B] tokens past the head, >= 1
        j = torch.arange(-(-(w - p) // 8) * 8, device=ids.device)  # [C]: W - P up to a multiple of 8 (row-invariant products)
        new_ids = ids.gather(1, (w - own[:, None] + j).clamp(max=w - 1))  # [B, C]: own tokens, then repeats
        new_mask = (j < own[:, None]).long()  # [B, C]
        cache = transformers.DynamicCache()
        for i, (k, v) in enumerate(zip(hk, hv, strict=True)):  # [1, Hkv, P, d] -> [B, Hkv, P, d] (the forward copies)
            cache.update(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1), i)
        attend = torch.cat([torch.ones_like(ids[:, :p]), new_mask], dim=1)  # [B, P + C]
        positions = p + torch.minimum(j, own[:, None] - 1)  # the padding repeats an input's last position
        hidden, keys, values = self._base(new_ids, attend, positions, cache)  # K/V [B, Hkv, P + C, d]
        # the whole left-padded prompt's layout: row i's P + s_i real columns end at W (shifted right by W - P - s_i)
        at = (torch.arange(w, device=ids.device) - (w - p - own)[:, None]).clamp(min=0)  # [B, W]
        hkv, d = hk[0].shape[1], hk[0].shape[3]
        at = at[:, None, :, None].expand(b, hkv, w, d)  # [B, Hkv, W, d]
        last = hidden.gather(1, (own - 1)[:, None, None].expand(b, 1, hidden.shape[2]))  # [B, 1, D]
        self.shared["inputs"] += b
        return [k.gather(2, at) for k in keys], [v.gather(2, at) for v in values], self._logits(last[:, 0])  # [B, V]

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[DecoderOnlyState, Tensor]:
        """Prefill once per input: [B, P] -> state, last-position logits [B, V]."""
        check_batch(batch)
        pk, pv, logits = self._prefill(batch)
        mask = batch.attention_mask
        cache = DecoderOnlyKVCache(pk, pv, mask, rows_per_input, max_new_tokens, self.window)
        pos = mask.long().sum(-1).repeat_interleave(rows_per_input)  # [B] -> [N], own storage (refilled)
        return DecoderOnlyState(cache, pos), logits

    @torch.inference_mode()
    def step(self, state: DecoderOnlyState, tokens: Tensor) -> Tensor:
        """tokens [N] -> logits [N, V] (float32)."""
        return run_step(self.decode, state, tokens)

    @torch.inference_mode()
    def reorder(self, state: DecoderOnlyState, rows: Tensor) -> None:
        state.cache.reorder(rows)  # start_pos is the same for all rows of an input

    @torch.inference_mode()
    def keep(self, state: DecoderOnlyState, keep: Tensor, rows: Tensor) -> None:
        state.cache.keep(keep, rows, used=state.t)
        state.start_pos = state.start_pos.index_select(0, rows)

    # -- kept states (models/capture.py: one per captured batch shape, for the backend's life) --------------------
    @torch.inference_mode()
    def restart(self, state: DecoderOnlyState, batch: Batch) -> Tensor:
        """The static ``state`` of an earlier batch of this shape (inputs, width; rows per input and positions are
        the state's) takes ``batch`` ([B, P] left-padded) as :meth:`start` would, in place: the prefill's K/V and
        mask are copied into its tensors, the generated positions restart (zeros, position 0). Returns the
        last-position logits [B, V]."""
        check_batch(batch)
        b, p = batch.input_ids.shape
        held = (state.cache.prompt_bias.shape[0], state.cache.prompt_bias.shape[-1])
        if (b, p) != held:
            raise ValueError(f"a batch of {b} x {p} cannot restart a state of {held[0]} x {held[1]} prompts")
        pk, pv, logits = self._prefill(batch)
        mask = batch.attention_mask
        state.cache.restart(pk, pv, mask)
        r = state.start_pos.shape[0] // b
        state.start_pos.copy_(mask.long().sum(-1).repeat_interleave(r))  # [B] -> [N]
        state.t = 0
        return logits

    @torch.inference_mode()
    def keep_into(
        self, state: DecoderOnlyState, keep: Tensor, rows: Tensor, into: DecoderOnlyState | None = None
    ) -> DecoderOnlyState:
        """Inputs ``keep`` ([B'] int64), i.e. rows ``rows`` ([B' * R]), of the static ``state`` in ``into`` (a kept
        state of B' inputs, same width and positions; a new one if ``None``): the prompts' K/V and mask, the generated
        positions written so far, back-pointers, positions, the step. ``state`` is left as it is."""
        if into is None:
            positions = state.start_pos.new_zeros(rows.shape[0])
            into = DecoderOnlyState(state.cache.empty(keep.shape[0]), positions)
        state.cache.keep_into(into.cache, keep, rows, used=state.t)
        select_into(into.start_pos, state.start_pos, rows)
        into.t = state.t
        return into

    # -- the refill engine's lanes (search/refill.py) ----------------------------------------------------------
    @torch.inference_mode()
    def open_lanes(self, lanes: int, rows_per_input: int, max_new_tokens: int) -> DecoderOnlyState:
        """``lanes`` empty lanes of ``rows_per_input`` rows each (prompt regions of ``MIN_WIDTH`` positions
        until a wider prompt joins). The last new token is never fed: ``max_new_tokens - 1`` generated positions."""
        head = self.model.get_output_embeddings().weight
        cache = DecoderOnlyKVCache.lanes(
            self.n_layers, lanes, rows_per_input, self.n_kv, self.head_dim, max(1, max_new_tokens - 1),
            MIN_WIDTH, head.dtype, head.device, self.window,
        )  # fmt: skip
        return DecoderOnlyState(
            cache, torch.zeros(lanes * rows_per_input, dtype=torch.long, device=head.device)
        )

    def lane_width(self, state: DecoderOnlyState) -> int:
        """The lanes' prompt-region width (one compiled shape each, ``models/capture.py``)."""
        return state.cache.width

    @torch.inference_mode()
    def join(self, state: DecoderOnlyState, lanes: list[int], batch: Batch) -> Tensor:
        """Prompts ``batch`` ([J, P] left-padded) take lanes ``lanes``: the prefill runs for them only,
        each at :func:`~seqgen_cli.shapes.input_width` of its length (one forward per width, and apart whether padded, so that an
        input's prefill never depends on who joins with it); their K/V go into the lanes' prompt regions (widened
        first if needed), their positions start at their lengths and their generated positions restart at step 0.
        Returns their first logits [J, V] (the search's first step: no decode step feeds a token for it)."""
        check_batch(batch)
        lane_ids = torch.tensor(lanes, dtype=torch.long, device=state.start_pos.device)  # [J]
        cache = state.cache
        lengths = batch.attention_mask.sum(dim=1).tolist()
        widths = [input_width(n, self.max_position_embeddings) for n in lengths]
        cache.widen(graph_width(max(widths), self.max_position_embeddings))
        first = torch.empty(len(lengths), self.vocab_size, device=lane_ids.device)  # [J, V]
        groups: dict[tuple[int, bool], list[int]] = {}
        for j, (n, w) in enumerate(zip(lengths, widths, strict=True)):
            groups.setdefault((w, n < w), []).append(j)
        for (w, _), members in groups.items():
            idx = torch.tensor(members, dtype=torch.long, device=lane_ids.device)  # [J_g]
            prompts = left_width(batch, idx, w)  # [J_g, w]
            pk, pv, logits = self._prefill(prompts)
            cache.put_prompt(lane_ids.index_select(0, idx), pk, pv, prompts.attention_mask)
            first.index_copy_(0, idx, logits)
        r = cache.r
        rows = (lane_ids[:, None] * r + torch.arange(r, device=lane_ids.device)).reshape(-1)  # [J * R]
        pos = torch.tensor(lengths, dtype=torch.long, device=lane_ids.device).repeat_interleave(r)  # [J * R]
        state.start_pos.index_copy_(0, rows, pos)
        cache.join(lanes)
        return first

    def leave(self, state: DecoderOnlyState, lanes: list[int]) -> None:
        """The inputs of ``lanes`` are done: those lanes idle until the next join."""
        state.cache.leave(lanes)

    def cache_nbytes(self, state: DecoderOnlyState) -> dict[str, int]:
        """Bytes of the prompt K/V (per input) with its mask, the generated-token K/V (all layers) and the
        back-pointers."""
        c = state.cache
        prompt = sum(x.nbytes for x in c.pk + c.pv) + c.prompt_bias.nbytes
        return {
            "prompt": prompt,
            "generated": sum(x.nbytes for x in c.gk + c.gv),
            "pointers": c.ptr.nbytes,
        }

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int:
        """Bytes :meth:`start` allocates for ``inputs`` prompts of ``width`` tokens, ``rows_per_input`` rows each,
        ``new_tokens`` positions (what :meth:`cache_nbytes` then counts): prompt K/V once per input, generated K/V
        and back-pointers per row; K/V heads only."""
        t, rows = max(1, new_tokens), inputs * rows_per_input
        dtype = self.model.get_output_embeddings().weight.dtype
        kv = kv_bytes(self.n_layers, self.n_kv, self.head_dim, dtype, inputs * width + rows * t)
        return kv + pointer_bytes(rows, t) + inputs * width * 4  # + the prompt mask (float32)
