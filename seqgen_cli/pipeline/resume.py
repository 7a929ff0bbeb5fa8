"""``--resume``: continue an interrupted run from its output file and side index.

Resuming checks the settings the index (:mod:`~.formats`) was written with, re-reads (without regenerating)
the inputs already done, checks their digest, and the run truncates the output to the recorded length and
goes on from there. Journaled outputs carry their input's hash and are reused only for the same input.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline.formats import IndexEntry, InputDigest, file_sha256, index_path, read_index
from seqgen_cli.pipeline.records import Record


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
    if last.offset and file_sha256(out, last.offset).hexdigest() != last.output_sha256:
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
