"""The exception types users see: printed as a single line, non-zero exit, no traceback."""

from __future__ import annotations

import os


class SeqgenError(Exception):
    """A user-facing error; ``str(err)`` is the whole message (name the file, line and problem)."""

    exit_code = 2


class WriteError(SeqgenError):
    """Writing an output file, or its index, journal or manifest, failed: disk full, no permission, I/O."""

    exit_code = 1

    @classmethod
    def of(cls, err: OSError, path: str | os.PathLike[str]) -> WriteError:
        """``no space left on device writing PATH`` (the OS's reason, then the file)."""
        reason = err.strerror or str(err)
        return cls(f"{reason[:1].lower()}{reason[1:]} writing {os.fspath(path)}")


class Aborted(SeqgenError):
    """A run stopped by something other than its input (a write error, memory, a bug): says where its
    outputs are and how to go on."""

    exit_code = 1
