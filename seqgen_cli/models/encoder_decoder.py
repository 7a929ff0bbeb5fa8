"""The one encoder-decoder decoder: every encoder-decoder family's decode step, written once over its description
(``families/``: the BART family, M2M-100 / NLLB, LED, Pegasus-X, T5, LongT5, UMT5, T5Gemma, T5Gemma 2), and the
protocol glue.

The model's own encoder runs once per input (``source.py``: its cross-attention keys/values projected once per
*input*, ``[B, Hkv, S, d]``, never per beam). A step's ``N = B * R`` queries are viewed as ``[B, H, R, d]``, so the
``R`` beams of an input act as query positions against that input's keys (FastSeq's trick). They are never
reordered (beams stay within their input) and only shrink when inputs finish. They and the self-attention positions
are held by :class:`~seqgen_cli.models.kv_cache.EncoderDecoderKVCache` (a batch's, a kept state's, the lanes'). What
the decoder is beside its layers (embeddings, position tables, relative bias, norms, heads) its family file reads
(:class:`~seqgen_cli.models.layers.DecoderFacts`).

``lm`` is the LM head as a linear map (:func:`~seqgen_cli.models.linear_maps.linear`, with ``final_logits_bias``
folded into its bias where the model has one). ``int8=True`` (``--dtype int8``, CPU): the decoder's linear maps and
the LM head as int8 copies of the float32 weights, the model's own encoder quantized in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from seqgen_cli.models.attention import rotary_tables, soft_cap
from seqgen_cli.models.kv_cache import EncoderDecoderKVCache, kv_bytes
from seqgen_cli.models.lane_table import pointer_bytes, run_step
from seqgen_cli.models.layers import Place, Seq2Seq, Step, sliding_layers
from seqgen_cli.models.linear_maps import linear, onednn_copy
from seqgen_cli.models.resident import release
from seqgen_cli.models.source import SourceEncoder
from seqgen_cli.search.protocol import Batch
from seqgen_cli.shapes import MIN_WIDTH, cross_width, graph_width

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class EncoderDecoderState:
    cache: EncoderDecoderKVCache  # the source's cross-attention K/V and mask, the self-attention positions
    t: int = 0  # decoder positions fed so far (host counter)
    # the relative position bias [L', H, T, T] (query, key): L' = 1 or per layer
    self_bias: torch.Tensor | None = None


class EncoderDecoderBackend:
    """:class:`~seqgen_cli.models.fast.FastBackend` for every encoder-decoder family of ``families/``: the source
    through the model's own encoder (:class:`~seqgen_cli.models.source.SourceEncoder`), then cached steps."""

    is_encoder_decoder = True

    def __init__(self, model: PreTrainedModel, description: Seq2Seq, int8: bool = False) -> None:
        self.model, self.description, self.int8 = model.eval(), description, int8
        encoder = model.get_encoder() if int8 else onednn_copy(model.get_encoder())  # CPU: oneDNN
        facts = description.facts(model)  # what the family file reads: embeddings, positions, norms, heads
        self.embed = facts.embed  # [V_in, D]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        scale = facts.embed_scale  # None: unscaled; a tensor in the model's dtype, as the module multiplies
        self.embed_scale = scale.to(self.dtype) if isinstance(scale, torch.Tensor) else scale
        self.eoi, self.eoi_embedding = facts.eoi, facts.eoi_embedding  # T5Gemma 2: a token, its own vector
        self.layers = []
        for layer in facts.layers:
            self.layers.append(description.reader(layer, int8))
            if int8:  # its float32 weights have int8 copies now: their pages go back (resident.py)
                release(p for p in layer.parameters() if p.dim() == 2)
        self.n_layers = len(self.layers)
        self.heads, self.kv_heads, self.head_dim = facts.heads, facts.kv_heads, facts.head_dim  # cached: Hkv
        sliding, self.window = sliding_layers(facts.config, self.n_layers)  # which layers slide, and how far
        self.rotary = facts.rotary
        self.per_type = description.position_kind == "rotary per layer type"  # a table per type (T5Gemma 2)
        self.rotary_table = [lay.layer_type if self.per_type else "full_attention" for lay in self.layers]
        for i, lay in enumerate(self.layers):
            lay.at = Place(
                i,
                self.heads,
                self.kv_heads,
                self.head_dim,
                sliding[i],
                self.rotary_table[i],
                description.pre_norm,
                description.clamp_fp16,
                description.scale_scores,
            )
        self.final_softcap = facts.final_softcap
        self.ln_embed, self.ln_final = facts.ln_embed, facts.ln_final
        self.relative_bias = facts.relative_bias  # T5: the relative position bias
        limit = getattr(model.config, "max_position_embeddings", None)  # the sources' position limit
        self.max_position_embeddings = None if self.relative_bias is not None else limit  # relative: none
        self.pad_position, self.pos_offset = facts.pad_position, facts.pos_offset
        self.position_table = facts.position_table
        self.position_embeddings = self._position_table(MIN_WIDTH)  # [n (+ offset), D]; None: relative, RoPE
        # the LM head: [N, D] -> [N, V], final_logits_bias folded in; T5 v1.0 rescales its tied head's input
        self.lm_head = model.get_output_embeddings()
        self.lm_w = self.lm_head.weight  # [V, D]
        bias, extra = self.lm_head.bias, facts.logits_bias
        if extra is not None:
            bias = extra.view(-1) if bias is None else bias + extra.view(-1)
        self.lm = linear(self.lm_w, bias, int8)
        self.vocab_size = int(self.lm_w.shape[0])
        self.out_scale = facts.out_scale
        self.source = SourceEncoder(  # the source's cross K/V; int8: the encoder quantized now
            encoder, self.layers, self.kv_heads, self.head_dim, self.dtype, self.device, int8
        )

    def _position_table(self, rows: int) -> torch.Tensor | None:
        """The decoder's absolute position embeddings, ``rows`` at least: [rows, D], or ``None`` (relative, rotary)."""
        return None if self.position_table is None else self.position_table(rows)

    def _relative_bias(self, t: int) -> torch.Tensor | None:
        """The relative position bias of ``t`` query against ``t`` key positions: [L', H, T, T] (L' = 1: the first
        block's, shared; UMT5: every block's own), or ``None``."""
        if self.relative_bias is None:
            return None
        return self.relative_bias(t, self.device).to(self.dtype)

    def decode(self, state: EncoderDecoderState, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tensor work (static shapes, see ``capture.py``): tokens [N] -> logits [N, V]."""
        cache = state.cache
        cache.begin(None if state.self_bias is None else state.self_bias.index_select(2, cache.position))
        x = self.embedding(tokens, cache.position)  # [N, D]
        tables = None
        if self.rotary is not None:
            tables = rotary_tables(self.rotary, x, cache.position, self.rotary_table, self.per_type)
        step = Step(cache, tables)
        for layer in self.layers:
            x = layer(x, step)  # [N, D]
        return self.logits(x)  # [N, V]

    def embedding(self, tokens: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The decoder's input at cache position ``at`` ([1]: a batch, [N]: lanes): tokens [N] -> [N, D]."""
        x = F.embedding(tokens, self.embed)  # [N, D]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.eoi_embedding is not None:
            x = torch.where((tokens == self.eoi)[:, None], self.eoi_embedding.to(x.dtype), x)  # [N, D]
        if self.position_embeddings is not None:
            at = at + self.pos_offset  # [1] (a batch) or [N] (lanes)
            if self.pad_position is not None:  # M2M-100: a pad token takes the padding row (zeros)
                at = torch.where(tokens == self.pad_position, self.pad_position, at)  # [N]
            x = x + self.position_embeddings.index_select(0, at)  # [1 | N, D]
        return x if self.ln_embed is None else self.ln_embed(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output [N, D] -> logits [N, V]: the final norm, T5 v1.0's rescale, the LM head."""
        if self.ln_final is not None:
            x = self.ln_final(x)
        if self.out_scale is not None:
            x = x * self.out_scale
        return soft_cap(self.lm(x), self.final_softcap)  # [N, V]

    @torch.inference_mode()
    def step(self, state: EncoderDecoderState, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> logits [N, V] (float32)."""
        return run_step(self.decode, state, tokens)

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[EncoderDecoderState, None]:
        keys, values, mask = self.source.encode(batch, cross_width(batch.input_ids.shape[1]))
        max_len = max(1, max_new_tokens)  # step() is called at most max_new_tokens times
        self.position_embeddings = self._position_table(max_len + self.pos_offset)
        cache = EncoderDecoderKVCache(keys, values, mask, rows_per_input, max_len, self.window)
        return EncoderDecoderState(cache, self_bias=self._relative_bias(max_len)), None

    # -- kept states (models/capture.py: one per captured batch shape, for the backend's life) --------------------
    @torch.inference_mode()
    def restart(self, state: EncoderDecoderState, batch: Batch) -> None:
        """The static ``state`` of an earlier batch of this shape (inputs, width; rows per input and positions are
        the state's) takes ``batch`` as :meth:`start` would, in place: the encoder's cross-attention K/V and the mask
        are copied into its tensors, the self-attention cache restarts (zeros, position 0). T5's position bias depends
        on the positions only and stays. No first logits (``None``), as :meth:`start`."""
        b, s = batch.input_ids.shape
        held = (state.cache.lane_count, state.cache.width)
        if (b, cross_width(s)) != held:
            raise ValueError(f"a batch of {b} x {s} cannot restart a state of {held[0]} x {held[1]} sources")
        state.cache.restart(*self.source.encode(batch, held[1]))
        state.t = 0

    @torch.inference_mode()
    def keep_into(
        self,
        state: EncoderDecoderState,
        keep: torch.Tensor,
        rows: torch.Tensor,
        into: EncoderDecoderState | None = None,
    ) -> EncoderDecoderState:
        """Inputs ``keep`` ([B'] int64), i.e. rows ``rows`` ([B' * R]), of the static ``state`` in ``into`` (a kept
        state of B' inputs, same width and positions; a new one if ``None``): cross-attention K/V and mask, the
        self-attention positions written so far, back-pointers, the step. ``state`` is left as it is."""
        if into is None:  # T5's position bias [L', H, T, T]: the positions' only, shared
            into = EncoderDecoderState(state.cache.empty(keep.shape[0]), self_bias=state.self_bias)
        state.cache.keep_into(into.cache, keep, rows, used=state.t)
        into.t = state.t
        return into

    # -- the refill engine's lanes (search/refill.py) ----------------------------------------------------------
    @torch.inference_mode()
    def open_lanes(self, lanes: int, rows_per_input: int, max_new_tokens: int) -> EncoderDecoderState:
        """``lanes`` empty lanes of ``rows_per_input`` rows each (sources of ``MIN_WIDTH`` tokens until a
        wider one joins)."""
        max_len = max(1, max_new_tokens)
        self.position_embeddings = self._position_table(max_len + self.pos_offset)
        cache = EncoderDecoderKVCache.lanes(
            self.n_layers,
            lanes,
            rows_per_input,
            self.kv_heads,
            self.head_dim,
            max_len,
            MIN_WIDTH,
            self.source.kv_dtype,
            self.device,
            self.window,
        )
        return EncoderDecoderState(cache, self_bias=self._relative_bias(max_len))

    def lane_width(self, state: EncoderDecoderState) -> int:
        """The lanes' source width (one compiled shape each, ``models/capture.py``)."""
        return state.cache.width

    @torch.inference_mode()
    def join(self, state: EncoderDecoderState, lanes: list[int], batch: Batch) -> None:
        """Inputs ``batch`` ([J, W'] right-padded) take lanes ``lanes``: the encoder runs for them only, at the lanes'
        source width (widened first, masked, to ``shapes.graph_width`` of the longest, so a run widens a few times at
        most), their cross-attention keys/values and mask go into the lanes' rows and their self-attention restarts
        at step 0. No first logits (``None``): the search then feeds the decoder start token."""
        cache = state.cache
        cache.widen(graph_width(batch.input_ids.shape[1], self.max_position_embeddings))
        batch = batch.padded(batch.input_ids.shape[0], cache.width, left=False)  # [J, W]
        keys, values, mask = self.source.whole(batch)
        lane_ids = torch.tensor(lanes, dtype=torch.long, device=self.device)  # [J]
        cache.put_fixed(lane_ids, keys, values, mask)  # L x [J, Hkv, d, W], L x [J, Hkv, W, d], [J, 1, 1, W]
        cache.join(lanes)

    def leave(self, state: EncoderDecoderState, lanes: list[int]) -> None:
        """The inputs of ``lanes`` are done: those lanes idle until the next join."""
        state.cache.leave(lanes)

    @torch.inference_mode()
    def reorder(self, state: EncoderDecoderState, rows: torch.Tensor) -> None:
        state.cache.reorder(rows)

    @torch.inference_mode()
    def keep(self, state: EncoderDecoderState, keep: torch.Tensor, rows: torch.Tensor) -> None:
        state.cache.keep(keep, rows, used=state.t)

    def cache_nbytes(self, state: EncoderDecoderState) -> dict[str, int]:
        """Bytes held for the search: cross-attention K/V (per input), the self-attention cache (with its
        back-pointers) and the relative position bias."""
        bias = 0 if state.self_bias is None else state.self_bias.nbytes
        part = state.cache.nbytes_by_part()  # the source's mask is not counted (``cache_bytes``)
        return {"cross": part["fixed"], "self": part["generated"] + part["pointers"], "bias": bias}

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int:
        """Bytes :meth:`start` allocates for ``inputs`` sources of ``width`` tokens, ``rows_per_input`` rows each,
        ``new_tokens`` positions (what :meth:`cache_nbytes` then counts): cross K/V once per input, self K/V and
        back-pointers per row, the relative position bias [L', H, T, T]."""
        t, rows = max(1, new_tokens), inputs * rows_per_input
        dtype = self.source.kv_dtype  # the self-attention cache's too (float32 where the CPU attends half precision)
        kv = kv_bytes(self.n_layers, self.kv_heads, self.head_dim, dtype, rows * t + inputs * cross_width(width))
        bias_layers = 0 if self.relative_bias is None else self.relative_bias.layers
        bias = bias_layers * self.heads * t * t * self.dtype.itemsize
        return kv + pointer_bytes(rows, t) + bias
