"""Model backends: ``get_backend(model)`` picks the fastest :class:`ModelBackend` for a transformers model.

Every family of :data:`~seqgen_cli.models.families.FAMILIES` (``config.model_type`` -> its description) runs on one
of the two shared decoders, :class:`EncoderDecoderBackend` or :class:`DecoderOnlyBackend`, over the checkpoint's own
weights. A variant a decoder does not reproduce exactly (``families.refusal``, e.g. a reachable sliding window), and
every unlisted family, gets the :class:`GenericBackend` reference backend, which carries the reason.

``int8=True`` (``--dtype int8``, CPU): every fast family runs its decoder with int8 copies of its maps and LM head;
every other model is quantized in place (its ``nn.Linear`` layers,
:func:`~seqgen_cli.models.linear_maps.quantize_linears`) and runs the generic backend.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from seqgen_cli.models import linear_maps
from seqgen_cli.models.decoder_only import DecoderOnlyBackend
from seqgen_cli.models.encoder_decoder import EncoderDecoderBackend
from seqgen_cli.models.families import FAMILIES, length_dependent_rope, refusal
from seqgen_cli.models.fast import FastBackend, inner_backend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.models.layers import Seq2Seq
from seqgen_cli.models.linear_maps import quantize_linears
from seqgen_cli.search.protocol import ModelBackend

if TYPE_CHECKING:  # transformers' model classes: imported by whoever built the model, not here (start-up)
    from transformers import PreTrainedModel


def fast_backend(model: PreTrainedModel, int8: bool = False) -> FastBackend | None:
    """The fast backend for ``model``, or ``None`` (unlisted family or unsupported variant)."""
    return _fast_or_reason(model, int8)[0]


def _fast_or_reason(model: PreTrainedModel, int8: bool) -> tuple[FastBackend | None, str | None]:
    """The fast backend for ``model``, or ``None`` and why there is none."""
    model_type = model.config.model_type
    description = FAMILIES.get(model_type)  # its family file's row
    if description is None:
        return None, f"model_type {model_type!r} has no fast decoder"
    reason = refusal(model)
    if reason is not None:
        return None, f"the fast decoder does not run this {model_type} variant: {reason}"
    cls = EncoderDecoderBackend if isinstance(description, Seq2Seq) else DecoderOnlyBackend
    return cls(model, description, int8=int8), None


# Model types no backend of seqgen's runs: no fast decoder, and the generic backend hands the decoder the encoder's
# output as a plain ``BaseModelOutput``, while these models' own forward reads the encoder's router logits from it.
NO_BACKEND: dict[str, str] = dict.fromkeys(
    ("nllb-moe", "switch_transformers"),
    "its mixture-of-experts decoder reads the encoder's router logits, which seqgen's generic backend does not keep",
)


def backend_refusal(config: object) -> str | None:
    """Why neither a fast decoder nor the generic backend runs a model of this ``config`` (``generate()`` does:
    ``--backend auto`` picks it, ``--backend fast`` is refused up front), or ``None``."""
    model_type = str(getattr(config, "model_type", "") or "")
    why = NO_BACKEND.get(model_type)
    return f"model_type {model_type!r}: {why}" if why is not None else None


def own_widths(backend: ModelBackend) -> bool:
    """Whether ``backend`` (under a ``CapturedBackend`` or not) runs each input of a batch at its own width
    (``Batch.widths``): a fast encoder-decoder decoder; the generic backend pads to the widest input."""
    return isinstance(inner_backend(backend), EncoderDecoderBackend)


def to_int8(model: PreTrainedModel, fast: bool) -> ModelBackend | None:
    """``--dtype int8``: the int8 fast backend (``fast``), or ``None`` with every
    linear layer of ``model`` in int8 in place (the generic backend and ``generate()``), the quantized weights from,
    or into, the disk cache."""
    from seqgen_cli import startup
    from seqgen_cli.models.int8_cache import session

    linear_maps.use_int8_engine()  # before the cache's key and any packing
    with session(model), startup.stage("int8 weights"):
        if fast:
            return get_backend(model, int8=True)
        with linear_maps.packing_in_threads():
            quantize_linears(model)
        return None


def model_types() -> list[tuple[str, str]]:
    """``(model_type, what runs it)`` for every model type seqgen knows (``seqgen models``): each family of
    :data:`FAMILIES` on its fast decoder, each of :data:`NO_BACKEND` on ``generate()``."""
    rows = [
        (name, f"fast {'encoder-decoder' if isinstance(d, Seq2Seq) else 'decoder-only'} decoder ({d.position_kind} positions)")
        for name, d in FAMILIES.items()
    ]
    return rows + [(name, f"transformers generate() ({why})") for name, why in NO_BACKEND.items()]


def get_backend(model: PreTrainedModel, *, generic: bool = False, int8: bool = False) -> ModelBackend:
    """The fast backend for ``model`` if its family has one, else (or if ``generic``) the generic one, which
    carries the reason (``GenericBackend.reason``; :func:`backend_name`).

    ``int8``: linear layers in int8 (CPU), packed in threads (``linear_maps.packing_in_threads``); the model is
    modified in place."""
    with linear_maps.packing_in_threads() if int8 else nullcontext():
        backend, reason = (None, "asked for") if generic else _fast_or_reason(model, int8)
        if backend is None and int8:
            quantize_linears(model)
    # every weight packed: the generic backend reads the head's width
    return backend if backend is not None else GenericBackend(model, reason=reason)


def backend_stats(backend: ModelBackend) -> dict[str, Any]:
    """``--stats`` ``device``'s keys of the backend: ``engine`` (:func:`backend_name`), on the CPU ``cpu_isa`` and
    ``linear_maps`` (what runs the products: :func:`~.linear_maps.kernel`) and, where prompts went through the
    prompt tree (``prompt_tree.PromptTree.stats``), ``prompt_tree``: the segments computed, those shared, the
    tokens prefilled in segments and the tokens reused instead."""
    inner = inner_backend(backend)  # the capture wrapper's wrapped backend
    out: dict[str, Any] = {"engine": backend_name(backend)}
    if isinstance(inner, FastBackend) and inner.model.device.type == "cpu":  # generic: transformers' maps
        out |= {"cpu_isa": linear_maps.cpu_isa(), "linear_maps": linear_maps.kernel(inner.model.dtype, inner.int8)}
    tree = inner.prefill.tree.stats if isinstance(inner, DecoderOnlyBackend) else None
    return out | ({"prompt_tree": dict(tree)} if tree and tree["segments"] else {})


def backend_name(backend: ModelBackend) -> str:
    """Which backend runs the decode steps, in words (``--stats`` ``engine``, the closing line): the family whose
    description the shared decoder runs (``m2m_100 decoder``), or ``generic (<why no fast one>)``."""
    inner = inner_backend(backend)  # the capture wrapper's wrapped backend
    if isinstance(inner, GenericBackend):
        return f"generic ({inner.reason})" if inner.reason else "generic"
    return f"{inner.model.config.model_type} decoder"


__all__ = [
    "DecoderOnlyBackend",
    "EncoderDecoderBackend",
    "FastBackend",
    "GenericBackend",
    "backend_name",
    "backend_refusal",
    "backend_stats",
    "fast_backend",
    "get_backend",
    "inner_backend",
    "length_dependent_rope",
    "model_types",
    "own_widths",
    "to_int8",
]
