"""The files beside an output, and how they are written and read: index, journal, ``--shard`` part manifest.

- **index** ``OUTPUT.seqgen-index``: JSON lines, a header ``{"seqgen_index": 2, "settings": ...}`` then, per
  flush, ``{"done", "offset", "sha256", "output_sha256"}``: inputs written, the output's byte length,
  :class:`InputDigest` of those inputs, SHA-256 of the output's bytes so far. Removed when the run completes.
- **journal** ``OUTPUT.seqgen-journal``: outputs that wait for an earlier input, ``{"i", "in", "out"}`` (input
  index, :func:`input_key`, output text). Removed when the run completes.
- **manifest** ``PART.seqgen-part``: a finished ``--shard`` part, ``{"seqgen_part": 2, "settings", "inputs",
  "bytes", "sha256"}`` (the part's SHA-256; written whole or not at all; read by ``seqgen merge``).

What a resume does with them is :mod:`~.resume`; who writes them is :mod:`~.sinks`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from seqgen_cli.errors import SeqgenError, WriteError
from seqgen_cli.pipeline.records import Record

INDEX_SUFFIX = ".seqgen-index"
JOURNAL_SUFFIX = ".seqgen-journal"
MANIFEST_SUFFIX = ".seqgen-part"  # a finished --shard part, for `seqgen merge` (see merge.py)
EMPTY_SHA256 = hashlib.sha256().hexdigest()
INDEX_VERSION = 2
MANIFEST_VERSION = 2


def index_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}{INDEX_SUFFIX}")


def journal_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}{JOURNAL_SUFFIX}")


def manifest_path(part: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(part)}{MANIFEST_SUFFIX}")


# -- what the digests hash -------------------------------------------------------------------------------


class InputDigest:
    """A running SHA-256 over the inputs, in order (text, JSON object, or the read error)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, record: Record) -> None:
        self.update_encoded(self.encode(record))

    @staticmethod
    def encode(record: Record) -> bytes:
        """What :meth:`update` hashes for ``record`` (to feed several digests at the cost of one)."""
        if record.error is not None:
            part = "\x02" + record.error
        elif record.fields is not None:
            part = "\x01" + json.dumps(record.fields, sort_keys=True, ensure_ascii=False)
        else:
            part = record.text
        return part.encode("utf-8", "surrogatepass") + b"\n"

    def update_encoded(self, data: bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def copy(self) -> InputDigest:
        """The digest so far, to go on from separately."""
        other = InputDigest()
        other._h = self._h.copy()
        return other


def input_key(record: Record) -> str:
    """SHA-256 of one input (as :class:`InputDigest` hashes it): a journaled output is reused only for the
    same input."""
    return hashlib.sha256(InputDigest.encode(record)).hexdigest()


# -- JSON-lines logs (index, journal) -----------------------------------------------------------------------


class JsonLog:
    """An append-only file of JSON lines, each batch of lines written whole and fsynced; removed when complete.

    Reopened to append, a torn last line (a kill in the middle of a write) is cut first; a failed write is
    cut back, so the file never holds a torn line before good ones.
    """

    def __init__(self, path: Path, *, fresh: bool) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if fresh else 0), 0o666)
        except OSError as err:
            raise WriteError.of(err, path) from err
        try:
            self._size = _whole_lines_size(self._fd)
            os.ftruncate(self._fd, self._size)
            os.lseek(self._fd, self._size, os.SEEK_SET)
        except OSError as err:
            os.close(self._fd)
            raise WriteError.of(err, path) from err

    def append(self, entries: list[dict[str, Any]]) -> None:
        if not entries:
            return
        data = "".join(json.dumps(e) + "\n" for e in entries).encode()
        try:
            write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
                os.lseek(self._fd, self._size, os.SEEK_SET)
            raise WriteError.of(err, self.path) from err
        self._size += len(data)

    def close(self, complete: bool) -> None:
        """Close; a complete run's file is removed (nothing is left to resume)."""
        os.close(self._fd)
        if complete:
            self.path.unlink(missing_ok=True)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (or an ``OSError``, e.g. the disk is full)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _whole_lines_size(fd: int) -> int:
    """The file's length up to and including its last newline."""
    pos = os.fstat(fd).st_size
    while pos > 0:
        start = max(0, pos - (1 << 16))
        block = os.pread(fd, pos - start, start)
        cut = block.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        pos = start
    return 0


def read_json_lines(path: Path) -> Iterator[Any]:
    """The entries of a :class:`JsonLog`, up to a torn last line (a kill mid-write)."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except ValueError:
                return


# -- the index --------------------------------------------------------------------------------------------


@dataclass
class IndexEntry:
    """One progress entry of the index: what is durable in the output."""

    done: int  # inputs written
    offset: int  # the output's byte length after them
    sha256: str  # InputDigest of those inputs
    output_sha256: str = EMPTY_SHA256  # of the output's first ``offset`` bytes


class IndexWriter(JsonLog):
    """Progress entries (:class:`IndexEntry`) after the settings header."""

    def __init__(self, output: str | os.PathLike[str], settings: dict[str, Any], *, fresh: bool) -> None:
        super().__init__(index_path(output), fresh=fresh)
        if fresh:
            header = {"seqgen_index": INDEX_VERSION, "settings": settings}
            self.append([header, asdict(IndexEntry(0, 0, ""))])

    def add(self, entry: IndexEntry) -> None:
        self.append([asdict(entry)])


def read_index(output: str | os.PathLike[str]) -> tuple[dict[str, Any], IndexEntry]:
    """The settings ``output``'s index was written with and its last progress entry."""
    index = index_path(output)
    header: dict[str, Any] | None = None
    last = IndexEntry(0, 0, "")
    for entry in read_json_lines(index):
        if header is None:
            header = entry
        elif isinstance(entry, dict) and "done" in entry:
            last = IndexEntry(
                int(entry["done"]),
                int(entry["offset"]),
                str(entry["sha256"]),
                str(entry.get("output_sha256", "")),
            )
    if not isinstance(header, dict) or header.get("seqgen_index") != INDEX_VERSION:
        raise SeqgenError(f"--resume: {index} is not a seqgen index; delete it to start over")
    return header.get("settings", {}), last


# -- the journal ------------------------------------------------------------------------------------------


class Journal(JsonLog):
    """Finished outputs that wait for an earlier input: ``{"i": index, "in": input_key, "out": text}``."""

    def __init__(self, output: str | os.PathLike[str], *, fresh: bool) -> None:
        super().__init__(journal_path(output), fresh=fresh)

    def add(self, entries: list[tuple[int, str, str]]) -> None:
        """``(index, input_key(record), output text)`` per entry."""
        self.append([{"i": i, "in": key, "out": out} for i, key, out in entries])


def load_journal(output: str | os.PathLike[str], done: int) -> dict[int, tuple[str, str]]:
    """The journaled outputs of inputs ``done`` and later: index -> (input key, output text)."""
    path = journal_path(output)
    if not path.exists():
        return {}
    entries = (e for e in read_json_lines(path) if isinstance(e, dict) and e.get("i", -1) >= done)
    return {int(e["i"]): (str(e.get("in", "")), str(e["out"])) for e in entries}


# -- the part manifest ------------------------------------------------------------------------------------


def write_manifest(part: str, settings: dict[str, Any], inputs: int, size: int, sha256: str) -> None:
    """Record a finished part (written whole, or not at all)."""
    path = manifest_path(part)
    entry = {
        "seqgen_part": MANIFEST_VERSION, "settings": settings, "inputs": inputs, "bytes": size, "sha256": sha256,
    }  # fmt: skip
    tmp = Path(f"{path}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise WriteError.of(err, path) from err


def file_sha256(path: str | os.PathLike[str], size: int | None = None) -> Any:
    """A SHA-256 hash object over the file's first ``size`` bytes (all of them: None), to compare or go on."""
    h = hashlib.sha256()
    left = size
    with open(path, "rb") as fh:
        while left is None or left > 0:
            block = fh.read(1 << 20 if left is None else min(left, 1 << 20))
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)
    return h


def read_manifest(part: str | os.PathLike[str]) -> dict[str, Any]:
    """A part's manifest as written by :func:`write_manifest` (``FileNotFoundError`` when there is none,
    ``ValueError`` when it is not JSON)."""
    return json.loads(manifest_path(part).read_text(encoding="utf-8"))
