"""Model backends: ``get_decoder(model)`` picks the fastest :class:`Decoder` for a transformers model.

``FAST_DECODERS`` maps ``config.model_type`` to a fast per-family decoder class over the checkpoint's own
weights. A class raises ``ValueError`` for a variant it does not reproduce exactly (e.g. sliding-window
attention); such models, and every unlisted family, get the :class:`GenericDecoder` reference backend.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from seqgen_cli.models.bart import BartDecoder
from seqgen_cli.models.generic import GenericDecoder
from seqgen_cli.models.gpt2 import GPT2Decoder
from seqgen_cli.models.llama import LlamaDecoder
from seqgen_cli.models.t5 import T5Decoder
from seqgen_cli.search.protocol import Decoder

FAST_DECODERS: dict[str, type] = {
    "bart": BartDecoder,  # also DistilBART
    "mbart": BartDecoder,
    "marian": BartDecoder,
    "pegasus": BartDecoder,
    "t5": T5Decoder,  # v1.0, v1.1 and Flan-T5
    "mt5": T5Decoder,
    "gpt2": GPT2Decoder,
    "llama": LlamaDecoder,
    "mistral": LlamaDecoder,  # full-attention configs only (sliding_window null)
    "qwen2": LlamaDecoder,  # use_sliding_window false only
}


def fast_decoder(model: PreTrainedModel) -> Decoder | None:
    """The fast decoder for ``model``, or ``None`` (unlisted family or unsupported variant)."""
    cls = FAST_DECODERS.get(model.config.model_type)
    if cls is None:
        return None
    try:
        return cls(model)
    except ValueError:
        return None


def get_decoder(model: PreTrainedModel, *, generic: bool = False) -> Decoder:
    """The fast backend for ``model``'s family where there is one, else (or with ``generic=True``) the generic."""
    decoder = None if generic else fast_decoder(model)
    return decoder if decoder is not None else GenericDecoder(model)


__all__ = ["FAST_DECODERS", "GenericDecoder", "fast_decoder", "get_decoder"]
