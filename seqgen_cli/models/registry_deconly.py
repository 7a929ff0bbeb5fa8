"""Fast decoder-only decoders by ``config.model_type`` (wired into ``get_decoder`` by the integrator).

``FAST_DECODERS[model_type](model)`` always returns a working ``Decoder``: the fast one, or the generic
backend for a config variant the fast one does not reproduce exactly (sliding-window attention,
length-dependent RoPE, GPT-2 cross-attention...). :func:`fast_decoder` returns the fast one or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..search.protocol import Decoder
from .deconly import DecoderOnly
from .generic import GenericDecoder
from .gpt2 import GPT2Decoder
from .llama import LlamaDecoder

# model_type -> fast decoder class (its constructor raises ValueError for unsupported variants)
FAST_CLASSES: dict[str, type[DecoderOnly]] = {
    "gpt2": GPT2Decoder,
    "llama": LlamaDecoder,
    "mistral": LlamaDecoder,  # full-attention configs only (sliding_window null, e.g. Mistral-7B v0.2+)
    "qwen2": LlamaDecoder,  # use_sliding_window false only
}


def fast_decoder(model: torch.nn.Module) -> DecoderOnly | None:
    """The fast decoder for ``model``, or ``None`` (unregistered family or unsupported variant)."""
    cls = FAST_CLASSES.get(model.config.model_type)
    if cls is None:
        return None
    try:
        return cls(model)
    except ValueError:
        return None


def _fast_or_generic(model: torch.nn.Module) -> Decoder:
    decoder = fast_decoder(model)
    return decoder if decoder is not None else GenericDecoder(model)


FAST_DECODERS: dict[str, Callable[[torch.nn.Module], Decoder]] = dict.fromkeys(FAST_CLASSES, _fast_or_generic)
