"""Fast per-family backends, keyed by ``config.model_type``: ``FAST_DECODERS[model_type](model) -> Decoder``."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedModel

from seqgen_cli.models.bart import BartDecoder
from seqgen_cli.models.t5 import T5Decoder
from seqgen_cli.search.protocol import Decoder

FAST_DECODERS: dict[str, Callable[[PreTrainedModel], Decoder]] = {
    "bart": BartDecoder,
    "mbart": BartDecoder,
    "marian": BartDecoder,
    "pegasus": BartDecoder,
    "t5": T5Decoder,
    "mt5": T5Decoder,
}


def fast_decoder(model: PreTrainedModel) -> Decoder:
    """The fast backend for ``model``'s family (``python -m tests.equivalence --backend ...:fast_decoder``)."""
    return FAST_DECODERS[model.config.model_type](model)
