"""Encoder-decoder checkpoints without transformers' model classes: a checkpoint's ``config.json``,
``generation_config.json`` and safetensors read straight into a module tree named as transformers names it, so that
:class:`~seqgen_cli.models.encoder_decoder.EncoderDecoderBackend` reads it as it reads transformers' model; its
encoder runs here. Each family file that has one declares its tree (``TREES``: ``model_type`` -> its ``Tree``, a
:class:`~seqgen_cli.models.tree.OwnSeq2Seq`): ``families/bart.py`` (BART, mBART, Marian, Pegasus, M2M-100 / NLLB),
``families/t5.py`` (T5, mT5, UMT5), ``families/t5gemma.py`` (T5Gemma).

Why: importing a transformers model class costs 1.0-1.4 s of a CPU process (``torch.distributed.tensor``,
``torch._dynamo``, the loss functions; docs/EXPERIMENTS.md, "Start-up and small jobs against CTranslate2"), more than
a small job decodes. :func:`load` is used for the fast engine on the CPU in float32, bfloat16 and int8 only; ``generate()``
(``--backend hf``, ``--verify``, the benchmarks' reference) gets transformers' model (``Loaded.reference``).

Exactness: an encoder runs transformers' operations in transformers' order (``scaled_dot_product_attention`` with
its mask, or T5Gemma's eager attention, the same additions and norms), so its output is bit-identical, and every weight is the checkpoint's
tensor, tied as transformers ties it (tests/models/test_own_model.py). A checkpoint it does not read the same way returns
``None`` from :func:`load`, with the reason, and transformers loads it: a key it does not expect or lacks, no
safetensors, an activation or attention implementation it does not have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from seqgen_cli.checkpoint import weight_files
from seqgen_cli.models.families import TREES
from seqgen_cli.models.families import refusal as decoder_refusal
from seqgen_cli.models.resident import release
from seqgen_cli.models.tree import ACTIVATIONS, OwnSeq2Seq


def read_safetensors(folder: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of the safetensors files transformers reads from the folder (``checkpoint.weight_files``: one
    file, an index of shards, ``transformers_weights``), as views of the mapped files; ``None`` where those are not
    safetensors."""
    from safetensors.torch import load_file

    files = [p for p in weight_files(folder) if not p.name.endswith(".index.json")]
    if not files or not all(p.name.endswith(".safetensors") for p in files):
        return None
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors


def tie(tensors: dict[str, torch.Tensor], ties: dict[str, str]) -> dict[str, str]:
    """transformers' ties on loading (``PreTrainedModel.tie_weights``), into ``tensors``; returns those made
    (target -> source). A pair the checkpoint holds both of, with other values, stays untied (flan-t5's own
    ``lm_head.weight``); where it holds only the target, the source takes the target's tensor; where neither, a
    later pair of the same source that is held gives it."""
    made: dict[str, str] = {}
    pairs = list(ties.items())
    for i, (target, source) in enumerate(pairs):
        if source in tensors and target in tensors:
            a, b = tensors[source], tensors[target]
            if a is not b and not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
                continue
        elif target in tensors:
            target, source = source, target
        elif source not in tensors:
            held = next((t for t, s in pairs[i + 1 :] if s == source and t in tensors), None)
            if held is None:
                continue  # missing: reported as missing
            source = held
        tensors[target] = tensors[source]
        made[target] = source
    return made


def refusal(config: Any) -> str | None:
    """Why :func:`load` does not build this model (transformers loads it), or ``None``."""
    from types import SimpleNamespace

    if config.model_type not in TREES:
        return f"model_type {config.model_type!r} has no own module tree"
    parts = [p for p in (getattr(config, "encoder", None), getattr(config, "decoder", None)) if hasattr(p, "to_dict")]
    for part in parts or [config]:  # T5Gemma: a config per stack
        names = ("dense_act_fn", "activation_function", "hidden_activation")
        act = next((getattr(part, n) for n in names if getattr(part, n, None)), None)
        if act not in ACTIVATIONS:
            return f"activation {act!r} is not written here"
    attention = TREES[config.model_type].ATTENTION
    if getattr(config, "_attn_implementation_internal", None) not in (None, attention):
        return f"an attention implementation other than {attention}"
    return decoder_refusal(SimpleNamespace(config=config))  # a variant the fast decoder does not run: transformers'


def load(source: str, config: Any, dtype: torch.dtype = torch.float32) -> tuple[OwnSeq2Seq | None, str | None]:
    """The checkpoint folder ``source`` as its tree in ``dtype`` (float32, bfloat16) on the CPU, eval mode, or
    ``None`` and why transformers should load it instead."""
    reason = refusal(config)
    folder = Path(source)
    try:
        tensors = None if reason or not folder.is_dir() else read_safetensors(folder)
    except Exception as err:  # noqa: BLE001 - safetensors' errors: transformers names them for the user
        return None, f"{type(err).__name__}: {err}"
    if reason or tensors is None:
        return None, reason or "no safetensors in the folder"
    with torch.device("meta"):
        model = TREES[config.model_type](config)
    model.generation_config, model.name_or_path = generation_config(source), source
    expected = model.state_dict().keys()
    model.complete(tensors)
    ties = tie(tensors, model.ties())
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        names = sorted(missing) or sorted(unexpected)
        return None, f"{'missing' if missing else 'unexpected'} weights ({names[0]}, ...)"
    floats = in_dtype(tensors, dtype)  # as from_pretrained(dtype=)
    try:
        model.load_state_dict(floats, strict=True, assign=True)
    except RuntimeError as err:  # a shape the config does not give
        return None, str(err).strip().splitlines()[-1].strip()
    for target, src in ties.items():  # one Parameter, as transformers' tied modules hold
        owner, name = target.rsplit(".", 1)
        setattr(model.get_submodule(owner), name, model.get_parameter(src))
    model.finish()
    return model.eval().requires_grad_(False), None


def in_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``tensors`` in ``dtype``: each tensor converted once (tied names share one: NLLB's 1 GB embedding is three
    names), and the checkpoint's file pages of each handed back as soon as it is (``resident.release``): a
    bfloat16 load of a float32 checkpoint holds the converted weights and one tensor's file pages at a time, not the
    whole file beside them (NLLB-600M's shape: docs/BENCHMARKS.md, "bfloat16 and int8 on the CPU")."""
    out: dict[str, torch.Tensor] = {}
    done: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dtype == dtype:
            out[name] = t
            continue
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in done:
            done[key] = t.to(dtype)
            release([t])
        out[name] = done[key]
    return out


def generation_config(source: str) -> Any:
    """The checkpoint's generation settings as ``from_pretrained`` sets them: ``generation_config.json``, else
    those of ``config.json``."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except OSError:
        return GenerationConfig.from_pretrained(source, config_file_name="config.json", _from_model_config=True)
