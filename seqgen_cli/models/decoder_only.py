"""What the fast decoder-only backends (GPT-2, Llama) share: the prefill, positions, and the protocol glue.

The prompt is prefilled once per *input* through the model's own base forward (left-padded, positions as
``generate()`` builds them); its keys and values go into a
:class:`~seqgen_cli.models.kv_cache.DecoderOnlyKVCache` shared by the input's ``R`` rows. Subclasses
implement ``decode`` (the step's tensor work, see ``capture.py``): ``state.cache.begin()``, the layers (attention
through ``state.cache.attend``) at positions ``state.start_pos + state.cache.slot``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from seqgen_cli.models.kv_cache import DecoderOnlyKVCache, kv_bytes, pointer_bytes, static_step
from seqgen_cli.models.linear_maps import dense
from seqgen_cli.search.protocol import Batch


@dataclass
class DecoderOnlyState:
    """Per-call state. ``N = B * R`` rows, input-major."""

    cache: DecoderOnlyKVCache
    start_pos: Tensor  # [N] int64: position id of each row's first generated token (its prompt's length)
    t: int = 0  # tokens fed by step() so far (host int: no device sync)


def prompt_positions(mask: Tensor) -> Tensor:
    """Position ids of a left-padded prompt exactly as ``generate()`` builds them: [B, P] -> [B, P]."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def check_batch(batch: Batch) -> None:
    """Decoder-only prompts must be left-padded: every row's last position is a real token."""
    if batch.attention_mask.shape[1] and not bool(batch.attention_mask[:, -1].all()):
        raise ValueError("decoder-only prompts must be left-padded")


class DecoderOnlyBackend:
    """Protocol glue shared by the families: prefill through the model's own base forward, then cached steps.

    Subclasses set ``self.model``, ``self.base`` (the transformer without LM head) and implement ``decode``.
    """

    is_encoder_decoder = False
    vocab_size: int
    max_position_embeddings: int
    model: torch.nn.Module
    base: torch.nn.Module
    n_layers: int
    n_kv: int  # K/V heads (grouped-query attention: fewer than the query heads)
    head_dim: int
    decode: Callable[
        [DecoderOnlyState, Tensor], Tensor
    ]  # the step's tensor work: tokens [N] -> logits [N, V]

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[DecoderOnlyState, Tensor]:
        """Prefill once per input: [B, P] -> state, last-position logits [B, V]."""
        check_batch(batch)
        ids, mask = batch.input_ids, batch.attention_mask
        hf_mask = mask if not bool(mask.all()) else None  # as generate(): no mask without padding
        out = self.base(
            input_ids=ids, attention_mask=hf_mask, position_ids=prompt_positions(mask), use_cache=True
        )
        layers = out.past_key_values.layers
        pk = [layer.keys for layer in layers]  # [B, Hkv, P, d]
        pv = [layer.values for layer in layers]
        cache = DecoderOnlyKVCache(pk, pv, mask, rows_per_input, max_new_tokens)
        b, r = mask.shape[0], rows_per_input
        pos = mask.long().sum(-1)[:, None].expand(b, r).reshape(b * r)  # [B] -> [B, R] -> [N]
        head = self.model.get_output_embeddings()  # oneDNN on the CPU: an input's row whatever the batch
        logits = dense(out.last_hidden_state[:, -1], head.weight, head.bias).float()  # [B, V]
        return DecoderOnlyState(cache, pos), logits

    @torch.inference_mode()
    def step(self, state: DecoderOnlyState, tokens: Tensor) -> Tensor:
        """tokens [N] -> logits [N, V] (float32)."""
        return static_step(self.decode, state, tokens)

    @torch.inference_mode()
    def reorder(self, state: DecoderOnlyState, rows: Tensor) -> None:
        state.cache.reorder(rows)  # start_pos is the same for all rows of an input

    @torch.inference_mode()
    def drop(self, state: DecoderOnlyState, keep: Tensor, rows: Tensor) -> None:
        state.cache.keep(keep, rows, used=state.t)
        state.start_pos = state.start_pos.index_select(0, rows)

    def cache_nbytes(self, state: DecoderOnlyState) -> dict[str, int]:
        """Bytes of the prompt K/V (per input) with its mask, the generated-token K/V (all layers) and the
        back-pointers."""
        c = state.cache
        prompt = sum(x.nbytes for x in c.pk + c.pv) + c.prompt_bias.nbytes
        return {
            "prompt": prompt,
            "generated": sum(x.nbytes for x in c.gk + c.gv),
            "pointers": c.ptrs.ptr.nbytes,
        }

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int:
        """Bytes :meth:`start` allocates for ``inputs`` prompts of ``width`` tokens, ``rows_per_input`` rows each,
        ``new_tokens`` slots (what :meth:`cache_nbytes` then counts): prompt K/V once per input, generated K/V
        and back-pointers per row; K/V heads only."""
        t, rows = max(1, new_tokens), inputs * rows_per_input
        dtype = self.model.get_output_embeddings().weight.dtype
        kv = kv_bytes(self.n_layers, self.n_kv, self.head_dim, dtype, inputs * width + rows * t)
        return kv + pointer_bytes(rows, t) + inputs * width * 4  # + the prompt mask (float32)
