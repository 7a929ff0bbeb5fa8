"""Model backends: ``get_decoder(model)`` picks the fastest :class:`Decoder` for a transformers model.

Fast per-family backends register a factory for their ``model.config.model_type`` with :func:`register`;
anything unregistered gets the :class:`GenericDecoder` reference backend.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedModel

from seqgen_cli.models.generic import GenericDecoder
from seqgen_cli.search.protocol import Decoder

DecoderFactory = Callable[[PreTrainedModel], Decoder]

_REGISTRY: dict[str, DecoderFactory] = {}


def register(model_type: str, factory: DecoderFactory) -> None:
    """Use ``factory(model)`` for models whose ``config.model_type`` is ``model_type``."""
    _REGISTRY[model_type] = factory


def get_decoder(model: PreTrainedModel, *, generic: bool = False) -> Decoder:
    """The registered backend for ``model``'s family, else (or with ``generic=True``) the generic one."""
    factory = None if generic else _REGISTRY.get(model.config.model_type)
    return factory(model) if factory is not None else GenericDecoder(model)


__all__ = ["DecoderFactory", "GenericDecoder", "get_decoder", "register"]
