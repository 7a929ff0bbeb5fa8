"""``seqgen merge``: join the part files of a ``--shard I/N`` run into the file one process writes."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline import resume
from seqgen_cli.pipeline.records import check_not_output


def check_part(part: str) -> int:
    """A complete part's size; one-line errors for a missing, unfinished or torn one."""
    path = Path(part)
    if not path.is_file():
        raise SeqgenError(f"{part}: no such part file")
    for side in (resume.index_path(part), resume.journal_path(part)):
        if side.exists():
            raise SeqgenError(
                f"{part}: incomplete ({side.name} exists): finish that shard with --resume first"
            )
    size = path.stat().st_size
    if size:
        with open(path, "rb") as fh:
            fh.seek(size - 1)
            if fh.read(1) != b"\n":
                raise SeqgenError(f"{part}: not a complete seqgen output (its last line has no newline)")
    return size


def merge_parts(parts: Sequence[str], output: str) -> int:
    """Concatenate ``parts`` (in shard order) into ``output`` (``-``: stdout); returns the lines written.

    Every part is checked before anything is written; a file output appears whole or not at all.
    """
    if not parts:
        raise SeqgenError("give the part files, in shard order")
    for part in parts:
        check_part(part)
    check_not_output(parts, output, what="part")
    if output == "-":
        for part in parts:
            with open(part, "rb") as fh:
                shutil.copyfileobj(fh, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return sum(_lines(p) for p in parts)
    target = Path(output).resolve()
    if not target.parent.is_dir():
        raise SeqgenError(f"output folder {target.parent} does not exist")
    resume.check_fresh(output)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    shutil.copyfileobj(fh, out)
            out.flush()
            os.fsync(out.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as a file seqgen generate writes (mkstemp makes it private)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return _lines(output)


def _lines(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 20), b""))
