"""``--resume``: continue an interrupted run from its output file and side index.

Resuming checks the settings the index (:mod:`~.formats`) was written with (the run's :func:`fingerprint`, which
``seqgen merge`` compares too), re-reads (without regenerating) the inputs already done, checks their digest,
and the run truncates the output to the recorded length and goes on from there. Journaled outputs carry their
input's hash and are reused only for the same input (:class:`JournalReuse`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from seqgen_cli.batching import Item
from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline.formats import (
    IndexEntry,
    InputDigest,
    index_path,
    input_key,
    prefix_sha256,
    read_index,
)
from seqgen_cli.pipeline.records import Record
from seqgen_cli.rules import GENERATION_KEYS

if TYPE_CHECKING:  # not at run time: it loads torch, and `seqgen merge` (which checks settings here) need not
    from seqgen_cli.generator import Generator
    from seqgen_cli.outputs import OutputText


def check_fresh(output: str) -> None:
    """A run without ``--resume`` must not overwrite an interrupted one."""
    index = index_path(output)
    if index.exists():
        raise SeqgenError(
            f"{output} holds an interrupted run ({index.name} exists): add --resume to continue it, "
            f"or delete {index.name} to start over"
        )


def load(output: str | os.PathLike[str], settings: dict[str, Any]) -> IndexEntry | None:
    """What an interrupted run to ``output`` left, checked against ``settings``; ``None``: start fresh."""
    index = index_path(output)
    out = Path(output)
    if not index.exists():
        if out.exists() and out.stat().st_size > 0:
            if not _ends_with_newline(out):
                raise SeqgenError(
                    f"--resume: {output} has no {index.name} and its last line is torn (no newline at the end): "
                    "it did not finish and cannot be resumed; delete it to start over"
                )
            raise SeqgenError(
                f"--resume: {output} has no {index.name} (it finished, or was not written by seqgen); "
                "nothing to resume: remove it or drop --resume"
            )
        return None
    old, last = read_index(output)
    if old != settings:
        raise SeqgenError(
            f"--resume: {output} was written with different settings ({differences(old, settings)}); "
            f"rerun with the same settings, or delete {index.name} to start over"
        )
    size = out.stat().st_size if out.exists() else 0
    if last.offset > size:
        raise SeqgenError(
            f"--resume: {output} is shorter than {index.name} records; delete both to start over"
        )
    if last.offset and prefix_sha256(out, last.offset).hexdigest() != last.output_sha256:
        raise SeqgenError(
            f"--resume: the first {last.done} outputs in {output} were changed since they were written "
            f"(edited, reordered or replaced); delete both {output} and {index.name} to start over"
        )
    return last


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def skip_done(records: Iterator[Record], state: IndexEntry, digest: InputDigest) -> Iterator[Record]:
    """Read past the ``state.done`` inputs already written, hashing and checking them, now.

    Returns the iterator positioned at the first input still to generate.
    """
    records = iter(records)
    seen = 0
    while seen < state.done:
        record = next(records, None)
        if record is None:
            raise SeqgenError(
                f"--resume: the input has only {seen} entries but the interrupted run already wrote {state.done}"
            )
        digest.update(record)
        seen += 1
    if state.done and digest.hexdigest() != state.sha256:
        raise SeqgenError(
            f"--resume: the first {seen} inputs differ from those of the interrupted run (same files, same order?)"
        )
    return records


def differences(old: dict[str, Any], new: dict[str, Any], ignore: tuple[str, ...] = ()) -> str:
    """The settings that differ (but ``ignore``), named; for the model, its files that changed; "" if none."""
    keys = sorted(k for k in set(old) | set(new) if k not in ignore and old.get(k) != new.get(k))
    was, now = (d.get("model", {}).get("files") for d in (old, new))
    if "model" in keys and isinstance(was, dict) and isinstance(now, dict):
        changed = sorted(n for n in set(was) | set(now) if was.get(n) != now.get(n))
        keys[keys.index("model")] = f"model: {', '.join(changed)} changed"
    return ", ".join(keys)


# Where each option of `seqgen generate` that changes the outputs shows in the fingerprint (the flags of
# cli.GENERATION_OPTIONS and --preset reach it through the resolved generation config; --shard through
# ShardRange.settings): FINGERPRINTED is this table plus every generation key. Every other option is in
# OUTPUT_NEUTRAL; tests/pipeline/test_resume.py holds the two to the command's options.
_FINGERPRINTED_OPTIONS = {
    "model": "model",
    "preset": "generation",
    "backend": "backend",
    "device": "device",
    "dtype": "dtype",
    "prefix": "prefix",
    "max_source_length": "max_source_length",
    "seed": "seed",
    "input_format": "input_format",
    "input_field": "input_field",
    "output_format": "output_format",
    "output_field": "output_field",
    "on_error": "on_error",
    "shard_spec": "shard",
    "target_lang": "generation",  # resolved into forced_bos_token_id
    "stop": "generation",  # stop_strings
    "scores": "generation",  # output_scores
    **dict.fromkeys(("chat", "system_prompt", "chat_template", "chat_template_kwargs", "prompt_template"), "prompt"),
    **dict.fromkeys(("json_schema", "regex", "grammar", "choice"), "grammar"),  # structured outputs
    **dict.fromkeys(("keep_stop", "reasoning"), "text"),  # the text written (outputs.py)
}
# How a run goes, not what it writes: batching and look-ahead, CUDA graphs and refill (the same outputs; on a
# GPU they may change rounding as batch composition does), where files and reports go, Ray's resources, checks.
OUTPUT_NEUTRAL = frozenset(
    {
        "inputs",
        "output",
        "batch_size",
        "batch_tokens",
        "sort_window",
        "capture",
        "refill",
        "resume",
        "stats_path",
        "reference",
        "metrics",
        "workers",
        "address",
        "gpus_per_worker",
        "cpus_per_worker",
        "shard_size",
        "verify_spec",
        "quiet",
        "show_prompt",
    }
)

# The generation keys come from rules.py, which loads neither torch nor transformers (``seqgen merge`` imports this
# module too).
FINGERPRINTED = {**_FINGERPRINTED_OPTIONS, **dict.fromkeys(GENERATION_KEYS, "generation")}


class RecordOptions(Protocol):
    """The job's options that shape its records and output lines (``JobOptions`` has them)."""

    input_format: str
    input_field: str | None
    output_format: str
    output_field: str
    on_error: str


def fingerprint(gen: Generator, opts: RecordOptions) -> dict[str, Any]:
    """What decides the output bytes, in a JSON-comparable form: the resolved settings (checkpoint, preset and
    flags merged), the model's identity, device kind, dtype and backend (``--resume``, the journal and
    ``seqgen merge`` compare it; :data:`FINGERPRINTED`)."""
    generation = {
        k: v
        for k, v in json.loads(gen.config.to_json_string(use_diff=False)).items()
        if not k.startswith("_") and k != "transformers_version"
    }
    loaded = gen.loaded
    settings = dict(
        model=model_identity(gen.model, gen.loaded.files),
        backend=gen.backend,
        device=loaded.device.type,
        dtype=loaded.dtype_name,
        generation=generation,
        prefix=gen.prefix,
        **({"prompt": prompt} if (prompt := {k: v for k, v in gen.prompt.describe().items() if k != "prefix"}) else {}),
        max_source_length=gen.max_source_length,
        **({"grammar": [g.spec.kind, g.spec.source]} if (g := gen.grammar) is not None else {}),
        **({"text": text} if (text := written_text(gen.texts)) else {}),
        seed=gen.seed,
        input_format=opts.input_format,
        input_field=opts.input_field,
        output_format=opts.output_format,
        output_field=opts.output_field,
        on_error=opts.on_error,
    )
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def written_text(texts: OutputText) -> dict[str, Any]:
    """How the outputs' texts are written where it differs from the decoded tokens (``outputs.py``): the stop
    string cut or kept, the reasoning; empty where neither applies (no stop strings, reasoning kept)."""
    cut = {"keep_stop": texts.keep_stop} if texts.stops else {}
    return cut | ({"reasoning": texts.reasoning} if texts.reasoning != "keep" else {})


def model_identity(model: Any, files: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint by content: the SHA-256 of each file of its folder that decides the outputs (weights,
    config, generation config, tokenizer files; :mod:`seqgen_cli.digests`, cached per file), so that a checkpoint
    saved anew, even at the same sizes, is another model and a moved or copied one the same. A model without a
    folder (built in memory) is its name."""
    from seqgen_cli.digests import checkpoint_folder, folder_digests

    name = str(getattr(model.config, "_name_or_path", ""))
    folder = checkpoint_folder(name) if name else None
    if folder is None:
        return {"name": name}
    return {"files": folder_digests(folder, dict(files) if files is not None else None)}


class JournalReuse:
    """A resumed run's journaled outputs, reused where their input is unchanged; shared by the generate loop and
    the writer thread (thread-safe).

    The loop hands each batch's inputs to :meth:`take` before generating: those with a journaled output for the
    same input are not generated; the writer thread collects each such output, once, with :meth:`pop`.
    """

    def __init__(self, journal: Mapping[int, tuple[str, str]] | None = None) -> None:
        self._journal = dict(journal or {})  # input index -> (input key, output): not looked at yet
        self._checked: dict[int, str] = {}  # input index -> output, checked against its input: for the writer
        self._lock = threading.Lock()

    def take(self, items: list[Item]) -> tuple[list[Item], list[Item]]:
        """Split ``items`` into those whose journaled output is for the same input (reused) and the rest (to
        generate: not journaled, or the input changed since)."""
        reused, todo = [], []
        with self._lock:
            for it in items:
                entry = self._journal.pop(it.index, None)
                if entry is not None and entry[0] == input_key(it.record):
                    self._checked[it.index] = entry[1]
                    reused.append(it)
                else:
                    todo.append(it)
        return reused, todo

    def pop(self, index: int) -> str | None:
        """The journaled output (its line or lines) of input ``index`` that :meth:`take` reused, or None."""
        with self._lock:
            return self._checked.pop(index, None)
