"""A checkpoint folder as transformers reads it, and what seqgen refuses of it.

:func:`weight_files` picks the weight files ``from_pretrained`` loads (``config.json``'s ``transformers_weights``,
else the first of :data:`WEIGHTS` present, an index with its shards); :func:`read_files` adds the other files that
decide the outputs (config, generation config, tokenizer files). One list serves the own loader
(``models/own_model.py``), the content digests of ``--resume`` (``digests.py``) and the check that no output
overwrites a file the run reads (``pipeline/paths.py``), so each covers exactly the files the model came from.

Refused, each with one line before any input is read: a weight file outside the folder (an index naming
``../x.safetensors`` or an absolute path: transformers would read it), and a checkpoint that needs its own Python
code (``auto_map`` for a model or tokenizer class transformers does not have). seqgen never runs a checkpoint's
code: every ``from_pretrained`` gets ``trust_remote_code=False``, so transformers never asks on stdin (which is
seqgen's input) either; where transformers has the class, its own runs and ``auto_map`` is ignored, as
``trust_remote_code=False`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from seqgen_cli.errors import SeqgenError

# transformers' order of choice in a local folder (``modeling_utils._get_resolved_checkpoint_files``)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")  # files only read where chosen
# Files transformers does not read for a PyTorch model: other frameworks' weights and the model card.
NOT_READ = (".h5", ".msgpack", ".onnx", ".onnx_data", ".tflite", ".ot", ".gguf", ".mlmodel", ".md")

StatKey = tuple[int, ...]


def read_json(path: Path, what: str) -> Any:
    """``path``'s JSON, or one line naming the file (``what``: the model's name) and the fault."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise SeqgenError(f"model {what}: cannot read {path.name}: {err.strerror or err}") from None
    except (ValueError, RecursionError) as err:
        raise SeqgenError(f"model {what}: {path.name} is not valid JSON: {err}") from None


def inside(folder: Path, name: str, what: str, named_by: str) -> Path:
    """``folder / name`` where that stays inside ``folder`` (as written: a hub snapshot's links point elsewhere,
    its names do not), else one line: weights come from the checkpoint folder only."""
    path = Path(os.path.normpath(folder.absolute() / name))
    base = os.path.normpath(folder.absolute())
    if os.path.isabs(name) or os.path.commonpath([base, str(path)]) != base:
        raise SeqgenError(
            f"model {what}: {named_by} names a weight file outside the checkpoint folder ({name}); seqgen reads "
            "weights from the checkpoint folder only"
        )
    return path


def weight_files(folder: Path, what: str = "") -> list[Path]:
    """The weight files ``from_pretrained`` reads from ``folder``: an index first, then its shards (sorted);
    ``[]`` where there are none (transformers' own error follows)."""
    what = what or str(folder)
    config = read_json(folder / "config.json", what)
    explicit = config.get("transformers_weights") if isinstance(config, dict) else None
    if isinstance(explicit, str) and explicit:
        chosen = inside(folder, explicit, what, "config.json's transformers_weights")
    else:
        chosen = next((folder / name for name in WEIGHTS if (folder / name).is_file()), None)
        if chosen is None:
            return []
    if not chosen.name.endswith(".index.json"):
        return [chosen]
    index = read_json(chosen, what)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SeqgenError(f"model {what}: {chosen.name} has no weight_map of file names")
    shards = [inside(folder, name, what, chosen.name) for name in sorted(set(weight_map.values()))]
    if missing := [name for name, p in zip(sorted(set(weight_map.values())), shards, strict=True) if not p.is_file()]:
        raise SeqgenError(f"model {what}: {chosen.name} names {', '.join(missing)}, not in the checkpoint folder")
    return [chosen, *shards]


def file_of(folder: Path, key: str) -> str:
    """The weight file of ``folder`` that holds the tensor ``key`` (an index's entry, else the one file)."""
    files = weight_files(folder)
    if files and files[0].name.endswith(".index.json"):
        name = (read_json(files[0], str(folder)).get("weight_map") or {}).get(key)
        return str(name) if name else files[0].name
    return relative(folder, files[0]) if files else "the weights"


# Read by transformers, some silently skipped if bad: checked up front.
JSON_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)


def check_json_files(folder: Path, what: str) -> None:
    """One line naming the file where a JSON file transformers reads is not JSON (a bad ``generation_config.json``
    would silently give the library's defaults; a bad tokenizer file an error about another file), or where
    ``tokenizer.json`` has no tokenizer model."""
    for name in JSON_FILES:
        if (folder / name).is_file():
            data = read_json(folder / name, what)
            if name == "tokenizer.json" and not (isinstance(data, dict) and isinstance(data.get("model"), dict)):
                raise SeqgenError(f"model {what}: tokenizer.json holds no tokenizer model (its \"model\" is not an object)")


def read_files(folder: Path, what: str = "") -> list[Path]:
    """Every file of ``folder`` whose bytes decide a run's outputs: the top-level files but the model card,
    other frameworks' weights and weight files transformers does not choose, and :func:`weight_files` (shards in
    subfolders too). Sorted by their name in the folder."""
    top = [p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file()]
    chosen = weight_files(folder, what)
    others = [
        p
        for p in top
        if not p.name.lower().endswith(NOT_READ)
        and not p.name.endswith(WEIGHT_SUFFIXES)
        and not p.name.endswith((".safetensors.index.json", ".bin.index.json"))
    ]
    unique = {os.path.normpath(p.absolute()): p for p in [*others, *chosen]}
    return sorted(unique.values(), key=lambda p: relative(folder, p))


def relative(folder: Path, path: Path) -> str:
    """``path``'s name inside ``folder`` (``model.safetensors``, ``shards/part-1.safetensors``)."""
    return Path(os.path.normpath(path.absolute())).relative_to(os.path.normpath(folder.absolute())).as_posix()


def stat_key(path: Path) -> StatKey:
    """What a rewrite of ``path`` changes: size, modification and status-change times, inode, device (of the file
    a link points to)."""
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def snapshot(folder: Path, what: str = "") -> dict[str, StatKey]:
    """``{name in the folder: stat key}`` of :func:`read_files`: taken before the model loads, compared after
    (:func:`check_unchanged`) and when the digests are made, so the digests are of the bytes that loaded."""
    return {relative(folder, p): stat_key(p) for p in read_files(folder, what)}


def check_unchanged(folder: Path, before: dict[str, StatKey], what: str) -> None:
    """One line where a file of ``before`` was written, replaced or removed since it was taken."""
    for name, key in before.items():
        try:
            now = stat_key(folder / name)
        except OSError:
            now = None
        if now != key:
            raise SeqgenError(
                f"model {what}: {name} changed while the model was in use (written, replaced or removed): run "
                "again once the checkpoint is saved"
            )


def refuse_code(folder: Path, what: str = "") -> None:
    """One line for a checkpoint that needs its own Python code (``auto_map`` naming a model, config or tokenizer
    class transformers does not have): seqgen never runs it; and for a CTranslate2 model folder (its config.json
    has no ``model_type``), which is not a checkpoint seqgen reads."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    what = what or str(folder)
    config = read_json(folder / "config.json", what) if (folder / "config.json").is_file() else {}
    config = config if isinstance(config, dict) else {}
    model_type = config.get("model_type")
    vocabularies = ("shared_vocabulary.json", "source_vocabulary.json", "vocabulary.json", "shared_vocabulary.txt")
    if not model_type and (folder / "model.bin").is_file() and any((folder / v).is_file() for v in vocabularies):
        raise SeqgenError(
            f"{what} is a CTranslate2 model (model.bin and its vocabulary): seqgen reads the Hugging Face checkpoint "
            "it was converted from (config.json with a model_type, its weights and tokenizer)"
        )
    if config.get("auto_map") and model_type not in CONFIG_MAPPING:
        raise SeqgenError(_code_message(what, "config.json", config["auto_map"], f"model_type {model_type!r}"))
    path = folder / "tokenizer_config.json"
    settings = read_json(path, what) if path.is_file() else {}
    settings = settings if isinstance(settings, dict) else {}
    name = settings.get("tokenizer_class")
    try:
        native = not name or tokenizer_class_from_name(str(name)) is not None  # none: the model type's
    except (ImportError, AttributeError, ValueError):
        native = False
    if settings.get("auto_map") and not native:
        raise SeqgenError(_code_message(what, path.name, settings["auto_map"], f"tokenizer_class {name!r}"))


def _code_message(what: str, file: str, auto_map: Any, kind: str) -> str:
    names = list(auto_map.values()) if isinstance(auto_map, dict) else auto_map
    flat = [n for v in (names if isinstance(names, list | tuple) else [names]) for n in (v if isinstance(v, list) else [v])]
    code = ", ".join(str(n) for n in flat if n)[:120] or "auto_map"
    return (
        f"model {what}: its {file} asks to run the checkpoint's own Python code ({code}) for a {kind} transformers "
        "does not have; seqgen never runs a checkpoint's code: use a checkpoint of a model type transformers has"
    )
