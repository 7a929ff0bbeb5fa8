"""Files written whole or not at all: a reader (or a crash half-way) never sees a half-written report, manifest or
merged output, and a failed write leaves the file that was there before.

:func:`write_whole` writes into a temporary file beside the target, flushes it to the disk and renames it over
the target (one ``os.replace``: atomic on one file system). The new file gets the permissions any new file of
the process gets (``mkstemp`` would make it private).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from seqgen_cli.errors import WriteError


def write_whole(path: str | os.PathLike[str], content: str | bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``content`` (text as UTF-8, bytes, or a function writing into the open file) to ``path``, whole or
    not at all; :class:`~seqgen_cli.errors.WriteError` naming ``path`` when it cannot be written."""
    target = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        raise WriteError.of(err, path) from err
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(content):
                content(fh)
            else:
                fh.write(content.encode("utf-8") if isinstance(content, str) else content)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise WriteError.of(err, path) from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: set it back at once
    os.umask(mask)
    return mask
