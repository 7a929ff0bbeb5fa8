"""A command's paths, checked before the (slow) model load: each can be read or written, and no file a command
writes is a file it reads or writes otherwise.

:func:`check_output` and :func:`check_writable` say in one line why an output cannot be written,
:func:`check_reference` that ``--reference`` does not have one line per input. Every path of a run is named with
its role (``input``, ``-o``, ``--stats``, ``--reference``, the index and journal beside ``-o``: :func:`job_roles`);
:func:`check_distinct` compares each written one with every other by file identity (device and inode after
following symlinks, so hard links and symlinks count; the resolved path for a file not there yet), before
anything is opened for writing. ``-`` is standard input when read and standard output when written. Devices,
pipes and sockets are streams, not files, and are not compared (``-o /dev/null --stats /dev/null`` is fine),
except standard output itself: two writers there would mix their lines.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from seqgen_cli import checkpoint
from seqgen_cli.digests import checkpoint_folder
from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline.formats import index_path, journal_path, manifest_path
from seqgen_cli.pipeline.shards import ShardRange, count_lines
from seqgen_cli.pipeline.sinks import check_not_busy, is_stream

STDOUT = ("stdout",)
BENCH_REPORTS = ("bench.json", "bench.md", "bench.png")  # what `seqgen bench` writes into --out


class Role(NamedTuple):
    """A path and what the command does with it: ``what`` names it in messages (``input``, ``--stats``)."""

    what: str
    path: str
    writes: bool


def read(what: str, path: str) -> Role:
    return Role(what, path, False)


def written(what: str, path: str) -> Role:
    return Role(what, path, True)


def _identity(role: Role) -> tuple | None:
    """What tells two paths apart: (device, inode) of a regular file, the resolved path of one not there yet,
    ``STDOUT`` for standard output; None for a stream (device, pipe, socket) or an unreadable path."""
    if role.path == "-":
        if role.writes:
            return STDOUT
        return _file(lambda: os.fstat(sys.stdin.fileno()))
    try:
        st = os.stat(role.path)
    except FileNotFoundError:
        return ("new", os.path.realpath(role.path))
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _file(get_stat) -> tuple | None:
    try:
        st = get_stat()
    except (OSError, ValueError, AttributeError):  # closed, or replaced by an object without a file
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _stdout_file() -> tuple | None:
    return _file(lambda: os.fstat(sys.stdout.fileno()))


def check_distinct(roles: Sequence[Role]) -> None:
    """One-line error when a written path is the same file as any other path of the command."""
    ids = [_identity(r) for r in roles]
    out = _stdout_file()  # standard output redirected to a file is that file too
    for i, (role, ident) in enumerate(zip(roles, ids, strict=True)):
        if not role.writes or ident is None:
            continue
        for j, (other, other_id) in enumerate(zip(roles, ids, strict=True)):
            if j == i or other_id is None:
                continue
            same = other_id == ident
            if not same and out is not None and STDOUT in (ident, other_id):
                same = out in (ident, other_id)
            if same and (j < i or not other.writes):  # each clash once
                raise SeqgenError(_clash(role, other))


def _label(role: Role) -> str:
    if role.path == "-":
        return f"{role.what} - (standard output)" if role.writes else "standard input"
    return f"{role.what} {role.path}"


def _clash(writes: Role, other: Role) -> str:
    if other.writes:
        return f"{_label(writes)} is the same file as {_label(other)}: give each its own file"
    return (
        f"{_label(other)} is the same file as {_label(writes)}: writing {writes.what} would destroy the "
        f"{other.what}"
    )


def job_roles(
    inputs: Sequence[str], output: str, *, stats: str | None, reference: str | None, part: bool,
    model: Sequence[tuple[Path, Path]] = (),
) -> list[Role]:
    """Every file a ``seqgen generate`` job reads or writes, with its role (for :func:`check_distinct`);
    ``part``: a ``--shard`` part, which gets a manifest; ``model``: the checkpoint's files (:func:`model_files`)."""
    roles = [read("input", p) for p in inputs or ["-"]]
    roles += [read(f"the model's {checkpoint.relative(folder, p)}", str(p)) for folder, p in model]
    roles.append(written("-o", output))
    if not is_stream(output):
        roles += [
            written("the index", str(index_path(output))),
            written("the journal", str(journal_path(output))),
        ]
        if part:
            roles.append(written("the part manifest", str(manifest_path(output))))
    if stats:
        roles.append(written("--stats", stats))
    if reference:
        roles.append(read("--reference", reference))
    return roles


def model_files(model: str | None) -> list[tuple[Path, Path]]:
    """``(folder, file)`` of each file the checkpoint ``model`` is read from (none for a name without a local
    folder), after refusing one that needs its own code or names weights outside its folder (one line each)."""
    folder = checkpoint_folder(model) if model else None
    if folder is None or not (folder / "config.json").is_file():
        return []  # the model load names what is wrong
    checkpoint.refuse_code(folder, str(model))
    return [(folder, p) for p in checkpoint.read_files(folder, str(model))]


def check_bench(input: str, out: str, model: str) -> None:  # noqa: A002 - the command's word
    """``seqgen bench``, before the (slow) model load: no report it writes into ``out`` is its ``input``, and a
    checkpoint that needs its own code is refused before any baseline loads it (:func:`model_files`)."""
    check_distinct([read("input", input), *(written("--out", str(Path(out) / name)) for name in BENCH_REPORTS)])
    model_files(model)


def check_output(output: str, resume: bool) -> None:
    """``-o``: standard output open, a stream not resumed, a file writable and not being written by another
    run."""
    if output == "-" and sys.stdout is None:
        raise SeqgenError("standard output is closed: give -o FILE")
    if is_stream(output):
        if resume:
            where = "output written to stdout" if output == "-" else f"{output} is not a regular file, so it"
            raise SeqgenError(f"--resume needs -o FILE: {where} cannot be resumed")
    else:
        check_writable(output, "output")
        check_not_busy(output)


def check_writable(path: str, what: str) -> None:
    """One line naming the folder or file when ``path`` cannot be written (as far as can be told now)."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise SeqgenError(f"{what} folder {parent} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SeqgenError(f"cannot write {path}: permission denied")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SeqgenError(f"cannot write into {parent}: permission denied")


def check_reference(inputs: Sequence[str], reference: str, shard: ShardRange | None) -> None:
    """``--reference`` has one line per input (per input of the shard, with ``--shard``; one per input too with
    ``--num-return-sequences``): checked now, when the input files and the reference are regular files, rather
    than found by the scoring after generating. Streams (stdin, pipes) are not read here."""
    refs = count_lines([reference])
    if refs is None:
        return
    if shard is not None:
        wanted, what = shard.size, f"shard {shard.index}/{shard.count} of the input has"
    else:
        counted = count_lines(list(inputs))
        if counted is None:
            return
        wanted, what = counted, "the input has"
    if refs != wanted:
        raise SeqgenError(
            f"--reference {reference} has {refs} {'line' if refs == 1 else 'lines'} but {what} "
            f"{wanted} {'input' if wanted == 1 else 'inputs'}: give one reference line per input"
        )
