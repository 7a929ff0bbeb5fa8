"""Shared machinery of the fast decoder-only decoders (GPT-2, Llama): caches, prefill, attention.

Cache layout (per layer, ``Hkv`` = K/V heads, never repeated for GQA):

- prompt K (transposed) / V: ``[B, Hkv, d, P]`` / ``[B, Hkv, P, d]`` -- once per *input*, shared by its
  ``R`` rows (beams), from the prefill (left-padded; ``prompt_bias`` masks the padding).
- generated K (transposed) / V: ``[B, Hkv, d, T, R]`` / ``[B, Hkv, T, R, d]`` -- preallocated for
  ``T = max_new_tokens`` steps; step ``t`` writes slot ``t`` of every row in place. The layouts make the used
  part free views ``[B, Hkv, d, t*R]`` / ``[B, Hkv, t*R, d]``. Keys are stored transposed because CPU
  ``bmm`` is ~2x faster on a contiguous ``K^T`` than on a transposed view (scripts/micro_reorder_deconly.py).

Beam reordering copies no K/V: ``ptr[n, s]`` (back-pointers, ``[N, T]``) says which beam of row ``n``'s
input wrote the slot-``s`` entry of row ``n``'s history. Each query row scores against all ``R`` beams' slots
of its input and a ``-inf`` bias keeps only its own history (an ``R``-fold larger but tiny score matmul
instead of a gather or copy of the cache). Prompt and generated scores share one softmax (exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..search.protocol import Batch


@dataclass
class KVState:
    """Per-call cache state. ``N = B * R`` rows, input-major."""

    pk: list[Tensor]  # per layer [B, Hkv, d, P] (K transposed)
    pv: list[Tensor]  # per layer [B, Hkv, P, d]
    gk: list[Tensor]  # per layer [B, Hkv, d, T, R] (K transposed)
    gv: list[Tensor]  # per layer [B, Hkv, T, R, d]
    prompt_bias: Tensor  # [B, 1, 1, P] float32: 0 for real prompt tokens, -inf for padding
    pos: Tensor  # [N] int64: position id of the next token fed to each row
    ptr: Tensor  # [N, T] int64: beam (0..R-1, same input) that holds slot s of row n's history
    R: int
    t: int = 0  # tokens fed by step() so far (host int: no device sync)

    @property
    def B(self) -> int:
        return self.prompt_bias.shape[0]

    def cache_bytes(self) -> dict[str, int]:
        """Bytes held by the prompt and the generated-token caches (all layers, K and V)."""
        prompt = sum(x.numel() * x.element_size() for x in self.pk + self.pv)
        gen = sum(x.numel() * x.element_size() for x in self.gk + self.gv)
        return {"prompt": prompt, "generated": gen}


def prompt_positions(mask: Tensor) -> Tensor:
    """Position ids of a left-padded prompt exactly as ``generate()`` builds them: [B, P] -> [B, P]."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def new_state(
    pk: list[Tensor],
    pv: list[Tensor],
    mask: Tensor,
    R: int,
    T: int,
) -> KVState:
    """Take the prefill's prompt K/V ([B, Hkv, P, d] per layer; K is stored transposed) and preallocate the rest."""
    B, Hkv, _, d = pk[0].shape
    T = max(T, 1)
    dev, dt = pk[0].device, pk[0].dtype
    pk = [k.transpose(-1, -2).contiguous() for k in pk]  # [B, Hkv, d, P]; the prefill's copy is released
    gk = [torch.empty(B, Hkv, d, T, R, device=dev, dtype=dt) for _ in pk]
    gv = [torch.empty(B, Hkv, T, R, d, device=dev, dtype=dt) for _ in pk]
    bias = torch.zeros(mask.shape, device=dev, dtype=torch.float32)
    bias = bias.masked_fill(mask == 0, float("-inf"))[:, None, None, :]
    pos = mask.long().sum(-1)[:, None].expand(B, R).reshape(B * R)
    ptr = torch.zeros(B * R, T, device=dev, dtype=torch.long)
    return KVState(pk, pv, gk, gv, bias, pos, ptr, R)


def begin_step(state: KVState) -> Tensor | None:
    """Mark slot ``t`` as each row's own; return the generated-token bias [B, 1, R, 1, (t+1)*R] (None if R == 1)."""
    t, R = state.t, state.R
    if t >= state.ptr.shape[1]:
        raise RuntimeError(f"step() called more than max_new_tokens={state.ptr.shape[1]} times")
    state.ptr[:, t] = torch.arange(R, device=state.ptr.device).repeat(state.B)
    if R == 1:
        return None
    own = state.ptr[:, : t + 1, None] == torch.arange(R, device=state.ptr.device)  # [N, t+1, R]
    bias = torch.zeros(own.shape, device=own.device, dtype=torch.float32).masked_fill_(~own, float("-inf"))
    return bias.view(state.B, 1, R, 1, (t + 1) * R)


def end_step(state: KVState) -> None:
    state.t += 1
    state.pos += 1


def attend(
    q: Tensor, k: Tensor, v: Tensor, layer: int, state: KVState, gen_bias: Tensor | None, scale: float
) -> Tensor:
    """One decoding step of self-attention for all rows; writes this step's K/V into the cache.

    q: [N, H, d]; k, v: [N, Hkv, d] (after RoPE if any). Returns [N, H*d].
    """
    N, H, d = q.shape
    B, R, t = state.B, state.R, state.t
    Hkv = k.shape[1]
    G = H // Hkv
    gk, gv = state.gk[layer], state.gv[layer]
    gk[:, :, :, t] = k.view(B, R, Hkv, d).permute(0, 2, 3, 1)  # [B, Hkv, d, R]
    gv[:, :, t] = v.view(B, R, Hkv, d).transpose(1, 2)  # [B, Hkv, R, d]
    # queries of one input's beams and one K/V head's group: [B, Hkv, R*G, d]
    qg = q.view(B, R, Hkv, G, d).transpose(1, 2).reshape(B, Hkv, R * G, d)
    keys_t = gk[:, :, :, : t + 1].view(B, Hkv, d, (t + 1) * R)  # slot-major: index s*R + beam
    vals = gv[:, :, : t + 1].view(B, Hkv, (t + 1) * R, d)
    sp = torch.matmul(qg, state.pk[layer]).mul_(scale)  # [B, Hkv, R*G, P]
    sg = torch.matmul(qg, keys_t).mul_(scale)  # [B, Hkv, R*G, (t+1)*R]
    P = sp.shape[-1]
    scores = torch.cat([sp.float() + state.prompt_bias, sg.float()], dim=-1)  # [B, Hkv, R*G, P+(t+1)*R]
    if gen_bias is not None:
        scores.view(B, Hkv, R, G, -1)[..., P:] += gen_bias
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs[..., :P], state.pv[layer])
    out += torch.matmul(probs[..., P:], vals)  # [B, Hkv, R*G, d]
    return out.view(B, Hkv, R, G, d).transpose(1, 2).reshape(N, H * d)


def reorder(state: KVState, rows: Tensor) -> None:
    """New row i continues old row rows[i]: only the back-pointers move."""
    state.ptr = state.ptr.index_select(0, rows)
    state.pos = state.pos.index_select(0, rows)


def drop(state: KVState, keep: Tensor) -> None:
    """Keep inputs ``keep`` ([B'] ascending): compacts prompt caches and the used part of generated ones."""
    R, t = state.R, state.t
    rows = (keep[:, None] * R + torch.arange(R, device=keep.device)).reshape(-1)
    for i in range(len(state.pk)):
        state.pk[i] = state.pk[i].index_select(0, keep)
        state.pv[i] = state.pv[i].index_select(0, keep)
        for cache, slot_dim in ((state.gk, 3), (state.gv, 2)):
            old = cache[i]
            new = old.new_empty((keep.shape[0], *old.shape[1:]))
            new.narrow(slot_dim, 0, t).copy_(old.narrow(slot_dim, 0, t).index_select(0, keep))
            cache[i] = new
    state.prompt_bias = state.prompt_bias.index_select(0, keep)
    state.pos = state.pos.index_select(0, rows)
    state.ptr = state.ptr.index_select(0, rows)


def check_batch(batch: Batch) -> None:
    """Decoder-only prompts must be left-padded: every row's last position is a real token."""
    if batch.attention_mask.shape[1] and not bool(batch.attention_mask[:, -1].all()):
        raise ValueError("decoder-only prompts must be left-padded")


class DecoderOnlyBackend:
    """Protocol glue shared by the families: prefill through the model's own base forward, then cached steps.

    Subclasses set ``self.model``, ``self.base`` (the transformer without LM head) and implement ``step``.
    """

    is_encoder_decoder = False
    vocab_size: int
    max_position_embeddings: int
    model: torch.nn.Module
    base: torch.nn.Module

    @torch.inference_mode()
    def start(self, batch: Batch, rows_per_input: int, max_new_tokens: int) -> tuple[KVState, Tensor]:
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
        state = new_state(pk, pv, mask, rows_per_input, max_new_tokens)
        logits = self.model.get_output_embeddings()(out.last_hidden_state[:, -1]).float()  # [B, V]
        return state, logits

    def reorder(self, state: KVState, rows: Tensor) -> None:
        reorder(state, rows)

    def drop(self, state: KVState, keep: Tensor) -> None:
        drop(state, keep)
