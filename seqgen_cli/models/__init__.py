"""Model backends: ``get_backend(model)`` picks the fastest :class:`ModelBackend` for a transformers model.

``FAST_BACKENDS`` maps ``config.model_type`` to a fast per-family backend class over the checkpoint's own
weights. A class raises ``ValueError`` for a variant it does not reproduce exactly (e.g. sliding-window
attention); such models, and every unlisted family, get the :class:`GenericBackend` reference backend.

``int8=True`` (``--dtype int8``, CPU): the BART family gets :class:`BartBackend`'s int8 variant; every other
model is quantized in place (its ``nn.Linear`` layers, :func:`~seqgen_cli.models.linear_maps.quantize_linears`)
and runs the generic backend.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from seqgen_cli.models.bart import BartBackend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.models.gpt2 import GPT2Backend
from seqgen_cli.models.linear_maps import quantize_linears
from seqgen_cli.models.llama import LlamaBackend
from seqgen_cli.models.t5 import T5Backend
from seqgen_cli.search.protocol import ModelBackend

FAST_BACKENDS: dict[str, type] = {
    "bart": BartBackend,  # also DistilBART
    "mbart": BartBackend,
    "marian": BartBackend,
    "pegasus": BartBackend,
    "t5": T5Backend,  # v1.0, v1.1 and Flan-T5
    "mt5": T5Backend,
    "gpt2": GPT2Backend,
    "llama": LlamaBackend,
    "mistral": LlamaBackend,  # full-attention configs only (sliding_window null)
    "qwen2": LlamaBackend,  # use_sliding_window false only
}
INT8_BACKENDS: dict[str, type] = {name: cls for name, cls in FAST_BACKENDS.items() if cls is BartBackend}


def fast_backend(model: PreTrainedModel, int8: bool = False) -> ModelBackend | None:
    """The fast backend for ``model``, or ``None`` (unlisted family or unsupported variant)."""
    cls = (INT8_BACKENDS if int8 else FAST_BACKENDS).get(model.config.model_type)
    if cls is None:
        return None
    try:
        return cls(model, int8=True) if int8 else cls(model)
    except ValueError:
        return None


def get_backend(model: PreTrainedModel, *, generic: bool = False, int8: bool = False) -> ModelBackend:
    """The fast backend for ``model`` if its family has one, else (or if ``generic``) the generic one.

    ``int8``: linear layers in int8 (CPU); the model is modified in place."""
    backend = None if generic else fast_backend(model, int8)
    if backend is not None:
        return backend
    if int8:
        quantize_linears(model)
    return GenericBackend(model)


__all__ = ["FAST_BACKENDS", "INT8_BACKENDS", "GenericBackend", "fast_backend", "get_backend"]
