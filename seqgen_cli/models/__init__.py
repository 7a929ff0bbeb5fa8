"""Model backends: ``get_backend(model)`` picks the fastest :class:`ModelBackend` for a transformers model.

``FAST_BACKENDS`` maps ``config.model_type`` to a fast per-family backend class over the checkpoint's own
weights. A class raises ``ValueError`` for a variant it does not reproduce exactly (e.g. sliding-window
attention); such models, and every unlisted family, get the :class:`GenericBackend` reference backend.

``int8=True`` (``--dtype int8``, CPU): every fast backend has an int8 variant (its decoder maps and LM head as int8
copies); every other model is quantized in place (its ``nn.Linear`` layers, :func:`~seqgen_cli.models.linear_maps.quantize_linears`)
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


def fast_backend(model: PreTrainedModel, int8: bool = False) -> ModelBackend | None:
    """The fast backend for ``model``, or ``None`` (unlisted family or unsupported variant)."""
    return _fast_or_reason(model, int8)[0]


def _fast_or_reason(model: PreTrainedModel, int8: bool) -> tuple[ModelBackend | None, str | None]:
    """The fast backend for ``model``, or ``None`` and why there is none."""
    model_type = model.config.model_type
    cls = FAST_BACKENDS.get(model_type)
    if cls is None:
        return None, f"model_type {model_type!r} has no fast decoder"
    try:
        return (cls(model, int8=True) if int8 else cls(model)), None
    except ValueError as err:
        return None, f"{cls.__name__} does not run this {model_type} variant: {err}"


def get_backend(model: PreTrainedModel, *, generic: bool = False, int8: bool = False) -> ModelBackend:
    """The fast backend for ``model`` if its family has one, else (or if ``generic``) the generic one, which
    carries the reason (``GenericBackend.reason``; :func:`engine_name`).

    ``int8``: linear layers in int8 (CPU); the model is modified in place."""
    backend, reason = (None, "asked for") if generic else _fast_or_reason(model, int8)
    if backend is not None:
        return backend
    if int8:
        quantize_linears(model)
    return GenericBackend(model, reason=reason)


def engine_name(backend: ModelBackend) -> str:
    """Which engine runs the decode steps, in words (``--stats`` ``engine``, the closing line): the family's
    backend class, or ``generic (<why no fast one>)``."""
    inner = getattr(backend, "backend", backend)  # the capture wrapper's wrapped backend
    if isinstance(inner, GenericBackend):
        return f"generic ({inner.reason})" if inner.reason else "generic"
    return type(inner).__name__


__all__ = ["FAST_BACKENDS", "GenericBackend", "engine_name", "fast_backend", "get_backend"]
