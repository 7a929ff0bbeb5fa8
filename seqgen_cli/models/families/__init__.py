"""Every fast family, a file each: its decoder layer read from the model (or seqgen's own tree), the rows that
describe its decoder (``FAMILIES``: ``model_type`` -> :class:`~seqgen_cli.models.layers.Seq2Seq` /
:class:`~seqgen_cli.models.layers.Causal`) and, where seqgen loads it without transformers' model classes, its
module tree (``TREES``: ``model_type`` -> its ``Tree``).

- ``bart.py``: BART, mBART, Marian, Pegasus, M2M-100 / NLLB, LED, Pegasus-X (encoder-decoder; own tree)
- ``t5.py``: T5, mT5, LongT5, UMT5 (encoder-decoder; own tree)
- ``t5gemma.py``: T5Gemma, T5Gemma 2 (encoder-decoder; own tree for T5Gemma)
- ``gpt2.py``, ``llama.py`` (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3), ``phi3.py`` (decoder-only)

This package is the one place that names a ``model_type`` of a fast family (tests/models/test_families.py holds it), and it
holds what else seqgen knows of model types by name: the position tables their decoders index (:func:`decoder_table`)
and whose inputs their positions do not limit (:func:`source_limited`). Adding a family: a file here (its layer
reader, its facts, its rows), listed in :data:`FILES`, and a fixture in tests/tiny_models.py (``FAMILY_CONFIGS``).

A variant a decoder does not reproduce exactly (a length-dependent RoPE, an attention kind not written) has its reason
in :func:`refusal`; such a model runs the generic backend, which names the reason.
"""

from __future__ import annotations

from typing import Any

from seqgen_cli.models.families import bart, gpt2, llama, phi3, t5, t5gemma
from seqgen_cli.models.layers import Causal, Seq2Seq
from seqgen_cli.models.tree import OwnSeq2Seq

FILES = (bart, t5, t5gemma, gpt2, llama, phi3)
FAMILIES: dict[str, Seq2Seq | Causal] = {name: row for file in FILES for name, row in file.FAMILIES.items()}
TREES: dict[str, type[OwnSeq2Seq]] = {name: tree for file in FILES for name, tree in getattr(file, "TREES", {}).items()}
SINUSOID_CLASSES = bart.SINUSOID_CLASSES  # transformers' sinusoid tables that loading builds faster

# Model types that run on the generic backend or generate() and whose decoder indexes a fixed position table, and
# the config field that sizes it (a position past it: ``IndexError: index out of range in self``). Relative, rotary,
# ALiBi and sinusoids that grow on demand (XGLM, FSMT) have no such limit, and neither has a type not listed.
OTHER_TABLES: dict[str, str] = {
    **dict.fromkeys(
        ("plbart", "mvp", "blenderbot", "blenderbot-small", "bigbird_pegasus", "opt", "biogpt", "gpt_neo"),
        "max_position_embeddings",
    ),
    "gpt_bigcode": "n_positions",
}


def decoder_table(config: Any) -> tuple[str, int] | None:
    """``(field, size)`` of the fixed position table a model's decoder indexes (a family's ``table``, or
    :data:`OTHER_TABLES`), from its ``config`` alone; ``None`` where positions have no hard limit."""
    model_type = getattr(config, "model_type", None) or ""
    description = FAMILIES.get(model_type)
    field = description.table if description is not None else OTHER_TABLES.get(model_type)
    size = getattr(config, field, None) if field else None
    return (field, size) if field and isinstance(size, int) and size > 0 else None


def source_limited(config: Any) -> bool:
    """Whether the encoder's position limit (``max_position_embeddings``, ``n_positions``) limits an input: not
    for the families whose positions are relative or rotary (T5's ``n_positions`` is no limit)."""
    description = FAMILIES.get(getattr(config, "model_type", None) or "")
    return not isinstance(description, Seq2Seq) or description.source_limit


STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # frequencies that do not depend on the sequence length


def length_dependent_rope(config: Any) -> str | None:
    """The ``rope_type`` of ``config`` (a decoder's own, each layer type's) whose frequencies transformers picks
    by the sequence length in each call, or ``None``: ``longrope`` (the long or the short factors by the batch's
    furthest position; Phi-3 also runs the whole sequence again once its *padded* length passes
    ``original_max_position_embeddings``) and the ``dynamic`` kinds (NTK scaling to the furthest position). Such a
    model's outputs, ``generate()``'s too, depend on the padding and on the lengths of the inputs beside it, so
    seqgen runs it unpadded, in batches of one length (``Generator.width``)."""
    cfg = getattr(config, "decoder", None) or config  # T5Gemma: the decoder's own config
    ropes = getattr(cfg, "rope_parameters", None) or {}
    per_type = [v for v in ropes.values() if isinstance(v, dict)] or [ropes]  # Gemma3: one per layer type
    for rope in per_type:
        kind = str(rope.get("rope_type", "default"))
        if kind == "longrope" or "dynamic" in kind:  # transformers' dynamic_rope_update: these two
            return kind
    return None


def refusal(model: Any) -> str | None:
    """Why the family's decoder would not reproduce this variant exactly, or ``None``."""
    cfg = model.config
    description = FAMILIES.get(cfg.model_type)
    if description is not None and description.refuse is not None and (why := description.refuse(cfg)) is not None:
        return why
    if description is None or not description.position_kind.startswith("rotary"):
        return None
    cfg = getattr(cfg, "decoder", None) or cfg  # T5Gemma: the decoder's own config
    ropes = getattr(cfg, "rope_parameters", None) or {}
    per_type = [v for v in ropes.values() if isinstance(v, dict)] or [ropes]  # Gemma3: one per layer type
    for rope in per_type:
        kind = rope.get("rope_type", "default")
        if kind not in STATIC_ROPE:
            return f"rope_type {kind!r} (length-dependent RoPE) is not supported by the fast backend"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 is not supported by the fast backend"
    types = getattr(cfg, "layer_types", None) or ()
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        return f"attention kinds {sorted(set(types))} are not supported by the fast backend"
    return None
