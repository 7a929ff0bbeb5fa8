"""Where outputs go: a resumable file (complete lines only, plus a side index) or a stream.

``FileSink`` appends whole lines with one ``os.write`` per flush, so a crash or SIGKILL never leaves a
torn line, and after each ``fsync`` appends a JSON line to ``OUTPUT.seqgen-index``::

    {"done": 1200, "offset": 83411, "sha256": "..."}   # inputs written, bytes, digest of those inputs

The index's first line holds the run's settings. ``--resume`` truncates the output to the last
entry's offset and regenerates from input ``done`` on (see :mod:`seqgen_cli.pipeline.resume`).
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import BinaryIO

INDEX_SUFFIX = ".seqgen-index"


def index_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}{INDEX_SUFFIX}")


class Sink:
    """Receives formatted outputs in input order."""

    done = 0  # inputs whose outputs are written
    name = "<stdout>"

    def write(self, data: bytes, inputs: int = 1) -> None:
        raise NotImplementedError

    def commit(self, digest: str = "", force: bool = False) -> None:
        """Make what was written so far durable (as far as this sink can)."""

    def close(self, complete: bool) -> None:
        pass


class StreamSink(Sink):
    """Standard output (or any binary stream): flushed per output when it is a pipe or terminal."""

    def __init__(self, stream: BinaryIO, flush_lines: bool | None = None) -> None:
        self.stream = stream
        self.flush_lines = _is_interactive(stream) if flush_lines is None else flush_lines

    def write(self, data: bytes, inputs: int = 1) -> None:
        self.stream.write(data)
        self.done += inputs
        if self.flush_lines:
            self.stream.flush()

    def commit(self, digest: str = "", force: bool = False) -> None:
        self.stream.flush()

    def close(self, complete: bool) -> None:
        self.stream.flush()


def _is_interactive(stream: BinaryIO) -> bool:
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)


class FileSink(Sink):
    """A regular output file with its side index; ``start`` is where a resumed run goes on from."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        header: dict,
        *,
        done: int = 0,
        offset: int = 0,
        interval: float = 0.5,
    ) -> None:
        self.name = os.fspath(path)
        self.index = index_path(path)
        self.interval = interval
        flags = os.O_WRONLY | os.O_CREAT
        self.fd = os.open(self.name, flags, 0o666)
        os.ftruncate(self.fd, offset)  # a resumed run drops any unindexed tail
        os.lseek(self.fd, offset, os.SEEK_SET)
        self.done = self.committed = done
        self.offset = offset
        self._buf: list[bytes] = []
        self._last = time.monotonic()
        if done == 0:
            self._index = open(self.index, "w", encoding="utf-8")  # noqa: SIM115
            self._append({"seqgen_index": 1, "settings": header})
            self._append({"done": 0, "offset": 0, "sha256": ""})
        else:
            self._index = open(self.index, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, data: bytes, inputs: int = 1) -> None:
        self._buf.append(data)
        self.done += inputs

    def commit(self, digest: str = "", force: bool = False) -> None:
        if self.done == self.committed or (not force and time.monotonic() - self._last < self.interval):
            return
        data = b"".join(self._buf)
        self._buf.clear()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        os.fsync(self.fd)
        self.offset += len(data)
        self.committed = self.done
        self._append({"done": self.done, "offset": self.offset, "sha256": digest})
        self._last = time.monotonic()

    def _append(self, entry: dict) -> None:
        self._index.write(json.dumps(entry) + "\n")
        self._index.flush()
        os.fsync(self._index.fileno())

    def close(self, complete: bool) -> None:
        """Close; a complete run's index is removed (nothing is left to resume)."""
        os.close(self.fd)
        self._index.close()
        if complete:
            self.index.unlink(missing_ok=True)
