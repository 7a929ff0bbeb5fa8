"""Fast decoder-only decoders by ``config.model_type`` (wired into ``get_decoder`` by the integrator).

Each factory takes the loaded HF model and returns a ``Decoder``; it raises ``ValueError`` for a config
variant it does not reproduce exactly (sliding-window attention, length-dependent RoPE, cross-attention...).
:func:`fast_decoder` turns that into ``None`` so that the caller can fall back to the generic backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..search.protocol import Decoder
from .gpt2 import GPT2Decoder
from .llama import LlamaDecoder

FAST_DECODERS: dict[str, Callable[[torch.nn.Module], Decoder]] = {
    "gpt2": GPT2Decoder,
    "llama": LlamaDecoder,
    "mistral": LlamaDecoder,  # full-attention configs only (sliding_window null, e.g. Mistral-7B v0.2+)
    "qwen2": LlamaDecoder,  # use_sliding_window false only
}


def fast_decoder(model: torch.nn.Module) -> Decoder | None:
    """The fast decoder for ``model``, or ``None`` (unregistered family or unsupported variant)."""
    factory = FAST_DECODERS.get(model.config.model_type)
    if factory is None:
        return None
    try:
        return factory(model)
    except ValueError:
        return None
