"""Fast decoder-only decoders by ``config.model_type`` (wired into ``get_decoder`` by the integrator).

Each factory takes the loaded HF model and returns a ``Decoder``; it raises ``ValueError`` for a config
variant it does not reproduce exactly (the caller then falls back to the generic backend).
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
}
