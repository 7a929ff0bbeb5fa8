"""``seqgen merge``: join the part files of a ``--shard I/N`` run into the file one process writes.

A finished ``--shard I/N`` run leaves a manifest beside its part, ``PART.seqgen-part`` (JSON: the settings,
with the shard and the whole input's line count and SHA-256, the inputs written and the part's length;
:func:`~.formats.write_manifest`, called as the part's sink closes complete).
Merge checks that the parts are shards 0 to N-1 of the same N, in order, of the same input and settings,
before it writes anything. The manifests stay: the parts can be merged again.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline import paths
from seqgen_cli.pipeline.formats import index_path, journal_path, manifest_path, prefix_sha256, read_manifest
from seqgen_cli.pipeline.resume import check_fresh, differences
from seqgen_cli.pipeline.shards import shard_range
from seqgen_cli.pipeline.sinks import check_not_busy, is_stream, open_stream
from seqgen_cli.whole import write_whole


def check_part(part: str) -> dict[str, Any]:
    """A finished part's manifest; one-line errors for a missing, unfinished, changed or torn part."""
    path = Path(part)
    if not path.is_file():
        raise SeqgenError(f"{part}: no such part file")
    for side in (index_path(part), journal_path(part)):
        if side.exists():
            raise SeqgenError(
                f"{part}: incomplete ({side.name} exists): finish that shard with --resume first"
            )
    manifest = manifest_path(part)
    try:
        entry = read_manifest(part)
        settings, size = entry["settings"], int(entry["bytes"])
        i, n = settings["shard"]
        lines = int(settings["input"]["lines"])
    except FileNotFoundError:
        raise SeqgenError(
            f"{part}: no {manifest.name} beside it: not the finished output of `seqgen generate --shard I/N`"
        ) from None
    except (OSError, ValueError, KeyError, TypeError):
        raise SeqgenError(f"{part}: {manifest.name} is not a seqgen part manifest") from None
    if path.stat().st_size != size:
        raise SeqgenError(
            f"{part}: changed since its shard finished ({path.stat().st_size} bytes, {manifest.name} says {size})"
        )
    if prefix_sha256(path).hexdigest() != entry.get("sha256"):
        raise SeqgenError(
            f"{part}: changed since its shard finished (its bytes differ from {manifest.name}'s digest)"
        )
    lo, hi = shard_range(lines, i, n)
    if entry.get("inputs") != hi - lo:
        raise SeqgenError(f"{part}: holds {entry.get('inputs')} inputs, shard {i}/{n} has {hi - lo}")
    if size:
        with open(path, "rb") as fh:
            fh.seek(size - 1)
            if fh.read(1) != b"\n":
                raise SeqgenError(f"{part}: not a complete seqgen output (its last line has no newline)")
    return settings


def check_parts(parts: Sequence[str]) -> None:
    """One-line errors unless ``parts`` are the shards 0 to N-1 of one job (same input and settings), in order."""
    settings = [check_part(p) for p in parts]
    first, ref = settings[0], parts[0]
    for part, s in zip(parts, settings, strict=True):
        if s.get("input") != first.get("input"):
            raise SeqgenError(f"{part} and {ref} were made from different inputs: not parts of one job")
        differ = differences(first, s, ignore=("shard", "input"))
        if differ:
            raise SeqgenError(
                f"{part} and {ref} were written with different settings ({differ}): not parts of one job"
            )
    shards = [tuple(s["shard"]) for s in settings]
    n = shards[0][1]
    seen: dict[int, str] = {}
    for part, (i, k) in zip(parts, shards, strict=True):
        if k != n:
            raise SeqgenError(
                f"{part} is shard {i}/{k}, {ref} is shard {shards[0][0]}/{n}: not parts of one job"
            )
        if i in seen:
            raise SeqgenError(f"shard {i}/{n} is given twice: {seen[i]} and {part}")
        seen[i] = part
    missing = [f"{i}/{n}" for i in range(n) if i not in seen]
    if missing:
        raise SeqgenError(f"missing shard {', '.join(missing)}: give all {n} parts, in shard order")
    for position, (part, (i, _)) in enumerate(zip(parts, shards, strict=True)):
        if i != position:
            raise SeqgenError(
                f"parts out of order: {part} is shard {i}/{n} but comes at position {position}; "
                f"give them in shard order (0 to {n - 1})"
            )


def merge_parts(parts: Sequence[str], output: str) -> int:
    """Concatenate ``parts`` (in shard order) into ``output`` (``-``: stdout); returns the lines written.

    Every part is checked before anything is written; a file output appears whole or not at all.
    """
    if not parts:
        raise SeqgenError("give the part files, in shard order")
    if output == "-" and sys.stdout is None:
        raise SeqgenError("standard output is closed: give -o FILE")
    check_parts(parts)
    roles = [paths.read("part", p) for p in parts] + [
        paths.read("part manifest", str(manifest_path(p))) for p in parts
    ]
    paths.check_distinct([*roles, paths.written("-o", output)])
    if is_stream(output):  # stdout, /dev/null, a pipe: written into, never replaced
        sink = open_stream(output)
        try:
            for part in parts:
                with open(part, "rb") as fh:
                    for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                        sink.write(block, inputs=0)
        finally:
            sink.close(complete=True)
        return sum(_lines(p) for p in parts)
    target = Path(output).resolve()
    if not target.parent.is_dir():
        raise SeqgenError(f"output folder {target.parent} does not exist")
    check_not_busy(output)  # a seqgen generate writing it: replacing the file would lose its outputs
    check_fresh(output)

    def copy(out: BinaryIO) -> None:
        for part in parts:
            with open(part, "rb") as fh:
                shutil.copyfileobj(fh, out)

    write_whole(target, copy)
    return _lines(output)


def _lines(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 20), b""))
