"""The one decoder-only decoder: every decoder-only family's decode step, written once over its description
(``families/``: GPT-2, Llama, Mistral, Qwen2/3, Phi-3, Gemma2/3), and the protocol glue.

The prompt is prefilled once per *input* through the model's own base forward (``prefill.py``: left-padded,
positions as ``generate()`` builds them); its keys and values go into a
:class:`~seqgen_cli.models.kv_cache.DecoderOnlyKVCache` shared by the input's ``R`` rows. ``decode`` (the step's
tensor work, see ``capture.py``): ``state.cache.begin()``, the layers (attention through the cache) at positions
``state.start_pos + state.cache.position``. Only the ``num_key_value_heads`` K/V heads are cached; query groups
broadcast against them (``attention.attend_blocks``). RoPE's cos/sin come from the model's own rotary module, so
its rope type and scaling are honoured exactly. What the decoder is beside its layers (embeddings, positions, the
final norm, heads) its family file reads (:class:`~seqgen_cli.models.layers.CausalFacts`).

``int8=True`` (``--dtype int8``, CPU): every layer's maps and the LM head as int8 copies; the prompt's prefill stays
the model's own forward in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqgen_cli.models.attention import kv_dtype, rotary_tables, soft_cap
from seqgen_cli.models.kv_cache import DecoderOnlyKVCache, kv_bytes
from seqgen_cli.models.kv_store import select_into
from seqgen_cli.models.lane_table import pointer_bytes, run_step
from seqgen_cli.models.layers import Causal, Place, Step, sliding_layers
from seqgen_cli.models.linear_maps import linear
from seqgen_cli.models.prefill import Prefill, check_batch
from seqgen_cli.search.protocol import Batch
from seqgen_cli.shapes import MIN_WIDTH, graph_width, input_width


@dataclass
class DecoderOnlyState:
    """Per-call state. ``N = B * R`` rows, input-major."""

    cache: DecoderOnlyKVCache
    start_pos: Tensor  # [N] int64: position id of each row's first generated token (its prompt's length)
    t: int = 0  # tokens fed by step() so far (host int: no device sync)


def left_width(batch: Batch, rows: Tensor, width: int) -> Batch:
    """Rows ``rows`` ([J] int64) of left-padded prompts [B, W], as ``width`` columns: the last ``width``, or padded
    on the left (masked) to ``width`` -> [J, width]."""
    chosen = batch.select(rows)
    ids, mask = chosen.input_ids, chosen.attention_mask
    if width <= ids.shape[1]:
        return Batch(ids[:, ids.shape[1] - width :], mask[:, mask.shape[1] - width :], breaks=chosen.breaks)
    return chosen.padded(ids.shape[0], width, left=True)


class DecoderOnlyBackend:
    """:class:`~seqgen_cli.models.fast.FastBackend` for every decoder-only family of ``families/``: prefill
    through the model's own base forward (:class:`~seqgen_cli.models.prefill.Prefill`), then cached steps."""

    is_encoder_decoder = False

    def __init__(self, model: torch.nn.Module, description: Causal, int8: bool = False) -> None:
        facts = description.facts(model)  # what the family file reads: embeddings, positions, norm, heads
        self.model, self.description, self.int8 = model, description, int8
        self.layers = [description.reader(layer, int8) for layer in facts.layers]
        self.n_layers = len(self.layers)
        self.heads, self.kv_heads, self.head_dim = facts.heads, facts.kv_heads, facts.head_dim
        self.max_position_embeddings = facts.max_positions
        self.embed, self.ln_final = facts.embed, facts.final_norm
        self.learned, self.rotary = facts.learned, facts.rotary  # the positions: a learned table, or RoPE
        self.per_type = description.position_kind == "rotary per layer type"  # one per layer type (Gemma3)
        sliding, self.window = sliding_layers(model.config, self.n_layers)  # which layers slide, and how far
        self.rotary_table = [lay.layer_type if self.per_type else "full_attention" for lay in self.layers]
        for i, lay in enumerate(self.layers):
            lay.at = Place(i, self.heads, self.kv_heads, self.head_dim, sliding[i], self.rotary_table[i])
        lm_head = model.get_output_embeddings()
        self.vocab_size = int(lm_head.weight.shape[0])
        self.lm = linear(lm_head.weight, lm_head.bias, int8)
        self.final_softcap = facts.final_softcap
        self.prefill = Prefill(model, self.final_softcap)  # the prompts' K/V and first logits

    def decode(self, state: DecoderOnlyState, tokens: Tensor) -> Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V] (float32)."""
        state.cache.begin()
        x = self.embed(tokens)  # [N, D]
        at = state.start_pos + state.cache.position  # [N] position ids
        if self.learned is not None:
            step = Step(state.cache)
            x = x + self.learned(at)  # [N, D]
        else:
            step = Step(state.cache, rotary_tables(self.rotary, x, at, self.rotary_table, self.per_type))
        for layer in self.layers:
            x = layer(x, step)  # [N, D]
        return soft_cap(self.lm(self.ln_final(x)).float(), self.final_softcap)  # [N, V]

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[DecoderOnlyState, Tensor]:
        """Prefill once per input: [B, W] -> state, last-position logits [B, V]."""
        check_batch(batch)
        pk, pv, logits = self.prefill(batch)
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
        the state's) takes ``batch`` ([B, W] left-padded) as :meth:`start` would, in place: the prefill's K/V and
        mask are copied into its tensors, the generated positions restart (zeros, position 0). Returns the
        last-position logits [B, V]."""
        check_batch(batch)
        b, p = batch.input_ids.shape
        held = (state.cache.lane_count, state.cache.width)
        if (b, p) != held:
            raise ValueError(f"a batch of {b} x {p} cannot restart a state of {held[0]} x {held[1]} prompts")
        pk, pv, logits = self.prefill(batch)
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
        weight = self.model.get_output_embeddings().weight
        cache = DecoderOnlyKVCache.lanes(
            self.n_layers,
            lanes,
            rows_per_input,
            self.kv_heads,
            self.head_dim,
            max(1, max_new_tokens - 1),
            MIN_WIDTH,
            weight.dtype,
            weight.device,
            self.window,
        )
        start_pos = torch.zeros(lanes * rows_per_input, dtype=torch.long, device=weight.device)  # [L * R] ids
        return DecoderOnlyState(cache, start_pos)

    def lane_width(self, state: DecoderOnlyState) -> int:
        """The lanes' prompt-region width (one compiled shape each, ``models/capture.py``)."""
        return state.cache.width

    @torch.inference_mode()
    def join(self, state: DecoderOnlyState, lanes: list[int], batch: Batch) -> Tensor:
        """Prompts ``batch`` ([J, W] left-padded) take lanes ``lanes``: the prefill runs for them only,
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
            pk, pv, logits = self.prefill(prompts)
            cache.put_fixed(lane_ids.index_select(0, idx), pk, pv, prompts.attention_mask)
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
        """Bytes of the prompt K/V (per input) and its mask, the generated-token K/V (all layers) and the
        back-pointers (``KVCache.nbytes_by_part``)."""
        return state.cache.nbytes_by_part()

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int:
        """Bytes :meth:`start` allocates for ``inputs`` prompts of ``width`` tokens, ``rows_per_input`` rows each,
        ``new_tokens`` positions (what :meth:`cache_nbytes` then counts): prompt K/V once per input, generated K/V
        and back-pointers per row; K/V heads only."""
        t, rows = max(1, new_tokens), inputs * rows_per_input
        weight = self.model.get_output_embeddings().weight
        dtype = kv_dtype(weight.dtype, weight.device)  # float32 where the CPU attends half precision
        kv = kv_bytes(self.n_layers, self.kv_heads, self.head_dim, dtype, inputs * width + rows * t)
        return kv + pointer_bytes(rows, t) + inputs * width * 4  # + the prompt mask (float32)
