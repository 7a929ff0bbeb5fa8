"""A :class:`~seqgen_cli.search.protocol.ModelBackend` over any transformers causal-LM or seq2seq model.

It feeds the model exactly what ``generate()`` feeds it: inputs built by the model's own
``prepare_inputs_for_generation`` from every row's whole sequence so far (ids, position ids from the cumulative
attention mask, the mask), transformers' cache objects (``DynamicCache`` / ``EncoderDecoderCache``), a mask
dropped when it has no padding, ``logits_to_keep=1`` where supported. So its logits match ``generate()``'s bit for
bit on the same rows, also where a model's own preparation reads the whole sequence: Phi-3's drops the cache and
runs the whole sequence again once its padded length passes ``original_max_position_embeddings`` (``longrope``
switches to its long factors there). Speed comes from the per-family backends; this one is the reference and the
fallback.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import transformers

from seqgen_cli.models.kv_cache import kv_bytes
from seqgen_cli.models.linear_maps import out_features
from seqgen_cli.search.protocol import Batch

if TYPE_CHECKING:  # transformers' model classes and outputs: imported with the model (start-up)
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import BaseModelOutput


def outputs(last_hidden_state: torch.Tensor) -> BaseModelOutput:
    """transformers' encoder output for ``generate()``'s inputs."""
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=last_hidden_state)


@dataclass
class GenericState:
    cache: Any  # DynamicCache | EncoderDecoderCache, rows = N
    input_ids: (
        torch.Tensor
    )  # every row's sequence so far [N, length]: dec-only prompt + generated, enc-dec generated
    encoder_outputs: BaseModelOutput | None = None  # last_hidden_state [N, S, d] (encoder-decoder)
    attention_mask: torch.Tensor | None = None  # enc-dec: encoder mask [N, S]; dec-only: [N, length] or None
    position_ids: torch.Tensor | None = None  # decoder-only: [N, length], each fed token's position


class GenericBackend:
    """Reference backend: one ``model(...)`` call per step through transformers' own input preparation."""

    def __init__(self, model: PreTrainedModel, reason: str | None = None) -> None:
        self.model = model.eval()
        self.reason = reason  # why no fast backend runs this model (get_backend), for --stats
        self.is_encoder_decoder = bool(model.config.is_encoder_decoder)
        self.vocab_size = out_features(model.get_output_embeddings())  # float or int8 (quantized) head
        text_config = model.config.get_text_config(decoder=True)
        self.max_position_embeddings = getattr(model.config, "max_position_embeddings", None)
        self._cache_config = text_config
        params = set(inspect.signature(model.forward).parameters)
        self._logits_to_keep = "logits_to_keep" in params
        self._accepts_position_ids = "position_ids" in params
        # the cache argument: "cache", or "past_key_values" in older transformers
        prepare = inspect.signature(model.prepare_inputs_for_generation).parameters
        self._cache_name = "cache" if "cache" in prepare else "past_key_values"

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int | None:
        """Bytes transformers' caches reach for ``inputs`` sources (prompts) of ``width`` tokens, ``rows_per_input``
        rows each and ``new_tokens`` steps: every row holds its own copy of the source's K/V (and, encoder-decoder,
        of the encoder's states) and its generated K/V. ``None`` when the config does not say its shape."""
        shape = kv_shape(self.model.config)
        if shape is None:
            return None
        rows = inputs * rows_per_input
        dtype = self.model.dtype
        total = kv_bytes(*shape, dtype, rows * (width + max(1, new_tokens)))
        if self.is_encoder_decoder:
            hidden = config_int(self.model.config, "d_model", "hidden_size") or 0
            total += rows * width * hidden * dtype.itemsize  # encoder states, repeated per row
        return total

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _new_cache(self) -> Any:
        cache = transformers.DynamicCache(config=self._cache_config)
        if self.is_encoder_decoder:
            cache = transformers.EncoderDecoderCache(cache, transformers.DynamicCache(config=self._cache_config))
        return cache

    def _forward(self, state: GenericState, first: bool) -> torch.Tensor:
        """One ``model(...)`` call on the inputs the model's own ``prepare_inputs_for_generation`` makes of
        ``state``'s whole sequences (the last token of each, unless it decides otherwise), as ``generate()``'s."""
        kwargs: dict[str, Any] = {self._cache_name: state.cache, "use_cache": True}
        if state.attention_mask is not None:
            kwargs["attention_mask"] = state.attention_mask
        if self.is_encoder_decoder:
            kwargs["encoder_outputs"] = state.encoder_outputs
        else:
            if state.position_ids is not None:
                kwargs["position_ids"] = state.position_ids
            if self._logits_to_keep:
                kwargs["logits_to_keep"] = 1
        inputs = self.model.prepare_inputs_for_generation(
            state.input_ids, next_sequence_length=None if first else 1, is_first_iteration=first, **kwargs
        )
        out = self.model(**inputs, return_dict=True)
        state.cache = out.past_key_values
        return out.logits[:, -1, :]  # [rows, V]

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[GenericState, torch.Tensor | None]:
        r = rows_per_input
        input_ids, mask = batch.input_ids, batch.attention_mask
        if self.is_encoder_decoder:
            encoder = self.model.get_encoder()
            enc = encoder(input_ids=input_ids, attention_mask=mask, return_dict=True)
            hidden = enc.last_hidden_state.repeat_interleave(r, dim=0)  # [N, S, d]
            state = GenericState(
                cache=self._new_cache(),
                input_ids=input_ids.new_empty((hidden.shape[0], 0)),  # the decoder's tokens, none yet
                encoder_outputs=outputs(last_hidden_state=hidden),
                attention_mask=mask.repeat_interleave(r, dim=0),  # [N, S]
            )
            return state, None
        # Decoder-only prefill, once per input ([B] rows); rows are expanded to B * R afterwards.
        position_ids = None
        if self._accepts_position_ids:
            position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # [B, S]
        has_padding = not bool((mask == 1).all())
        state = GenericState(
            cache=self._new_cache(),
            input_ids=input_ids,
            attention_mask=mask if has_padding else None,  # generate() drops an all-ones mask
            position_ids=position_ids,
        )
        logits = self._forward(state, first=True)  # [B, V]
        if r > 1:
            state.cache.batch_repeat_interleave(r)
            state.input_ids = input_ids.repeat_interleave(r, dim=0)
            if state.attention_mask is not None:
                state.attention_mask = state.attention_mask.repeat_interleave(r, dim=0)
            if position_ids is not None:
                state.position_ids = position_ids.repeat_interleave(r, dim=0)
        return state, logits

    @torch.inference_mode()
    def step(self, state: GenericState, tokens: torch.Tensor) -> torch.Tensor:
        state.input_ids = torch.cat([state.input_ids, tokens[:, None].to(state.input_ids.dtype)], dim=-1)
        if not self.is_encoder_decoder:
            if state.attention_mask is not None:
                ones = state.attention_mask.new_ones((state.attention_mask.shape[0], 1))
                state.attention_mask = torch.cat([state.attention_mask, ones], dim=-1)  # [N, L + 1]
            if state.position_ids is not None:
                state.position_ids = torch.cat([state.position_ids, state.position_ids[:, -1:] + 1], dim=-1)
        return self._forward(state, first=False)

    def reorder(self, state: GenericState, rows: torch.Tensor) -> None:
        # Rows only move within an input, so masks, positions and the cross-attention cache are unchanged; the
        # generated tokens move with their rows.
        cache = state.cache
        if isinstance(cache, transformers.EncoderDecoderCache):
            cache = cache.self_attention_cache
        cache.reorder_cache(rows)
        state.input_ids = state.input_ids.index_select(0, rows)

    def keep(self, state: GenericState, keep: torch.Tensor, rows: torch.Tensor) -> None:
        state.cache.batch_select_indices(rows)
        state.input_ids = state.input_ids.index_select(0, rows)
        if state.encoder_outputs is not None:
            hidden = state.encoder_outputs.last_hidden_state.index_select(0, rows)
            state.encoder_outputs = outputs(last_hidden_state=hidden)
        if state.attention_mask is not None:
            state.attention_mask = state.attention_mask.index_select(0, rows)
        if state.position_ids is not None:
            state.position_ids = state.position_ids.index_select(0, rows)


def config_int(config: Any, *names: str) -> int | None:
    """The first of the config's fields ``names`` that holds a non-zero int, or ``None``."""
    return next((int(v) for n in names if isinstance(v := getattr(config, n, None), int) and v), None)


def kv_shape(config: Any) -> tuple[int, int, int] | None:
    """(decoder layers, K/V heads, head dim) from a transformers config, or ``None``."""
    layers = config_int(config, "decoder_layers", "num_decoder_layers", "num_hidden_layers", "n_layer")
    heads = config_int(config, "decoder_attention_heads", "num_heads", "num_attention_heads", "n_head")
    kv_heads = config_int(config, "num_key_value_heads") or heads
    hidden = config_int(config, "d_model", "hidden_size", "n_embd")
    head_dim = config_int(config, "head_dim", "d_kv") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return layers, kv_heads, head_dim
