"""No file a command writes may be a file it reads or writes otherwise.

Every path of a run is named with its role (``input``, ``-o``, ``--stats``, ``--reference``, the index and
journal beside ``-o``); :func:`check_distinct` compares each written one with every other by file identity
(device and inode after following symlinks, so hard links and symlinks count; the resolved path for a file
not there yet), before anything is opened for writing. ``-`` is standard input when read and standard output
when written. Devices, pipes and sockets are streams, not files, and are not compared (``-o /dev/null --stats
/dev/null`` is fine), except standard output itself: two writers there would mix their lines.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from typing import NamedTuple

from seqgen_cli.errors import SeqgenError

STDOUT = ("stdout",)


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
