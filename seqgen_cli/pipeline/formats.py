"""The files beside an output, and how they are written and read: index, journal, ``--shard`` part manifest.

- **index** ``OUTPUT.seqgen-index``: JSON lines, a header ``{"seqgen_index": 2, "settings": ...}`` then, per
  flush, ``{"done", "offset", "sha256", "output_sha256"}``: inputs written, the output's byte length,
  :class:`InputDigest` of those inputs, SHA-256 of the output's bytes so far. Removed when the run completes.
- **journal** ``OUTPUT.seqgen-journal``: outputs that wait for an earlier input, ``{"i", "in", "out", "sha256"}``
  (input index, :func:`input_key`, output text, :func:`journal_digest` of the three). Removed when the run
  completes. An entry whose digest does not hold is not used (:func:`load_journal`).
- **manifest** ``PART.seqgen-part``: a finished ``--shard`` part, ``{"seqgen_part": 2, "settings", "inputs",
  "bytes", "sha256"}`` (the part's SHA-256; written whole or not at all; read by ``seqgen merge``).
- **parts folder** ``OUTPUT.seqgen-parts/``: a ``--workers`` run's part files (:mod:`~.worker`), each with its
  index, journal and lock, and the driver's mark. Removed by the run that completes ``OUTPUT``, a one-process
  ``--resume`` included (:func:`remove_parts`).

What a resume does with them is :mod:`~.resume`; who writes them is :mod:`~.sinks`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from seqgen_cli.errors import SeqgenError, WriteError
from seqgen_cli.pipeline.records import Record
from seqgen_cli.whole import write_whole

INDEX_SUFFIX = ".seqgen-index"
JOURNAL_SUFFIX = ".seqgen-journal"
MANIFEST_SUFFIX = ".seqgen-part"  # a finished --shard part, for `seqgen merge` (see merge.py)
EMPTY_SHA256 = hashlib.sha256().hexdigest()
INDEX_VERSION = 2
MANIFEST_VERSION = 2
PARTS_SUFFIX = ".seqgen-parts"  # a --workers run's part files (see worker.py)
DRIVER_MARK = ".seqgen-driver"  # in the parts folder: the driver's node id (workers that see it share it)
PART_NAME = re.compile(r"\d{12,}-\d+-[0-9a-f]{16}\.part")  # as shards.Cutter names a shard's part file
LOCK_SUFFIX = ".lock"  # beside a part file: held by the worker writing it


def index_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}{INDEX_SUFFIX}")


def journal_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}{JOURNAL_SUFFIX}")


def manifest_path(part: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(part)}{MANIFEST_SUFFIX}")


def parts_dir(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}{PARTS_SUFFIX}")


def part_files(part: str | os.PathLike[str]) -> tuple[Path, ...]:
    """A ``--workers`` part file and what lies beside it: its index, journal and lock."""
    return (Path(part), index_path(part), journal_path(part), Path(f"{os.fspath(part)}{LOCK_SUFFIX}"))


def remove_part(part: str | os.PathLike[str]) -> None:
    """Remove a ``--workers`` part file and what lies beside it (:func:`part_files`)."""
    for path in part_files(part):
        path.unlink(missing_ok=True)


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


def journal_digest(index: int, key: str, out: str) -> str:
    """SHA-256 of a journal entry's output text bound to its input index and :func:`input_key`: an entry edited,
    moved to another input or damaged since it was written no longer matches. A check against accidents (a hand
    edit, a torn or garbled write), not against someone who recomputes it."""
    return hashlib.sha256(json.dumps([index, key, out]).encode("ascii")).hexdigest()


class Journal(JsonLog):
    """Finished outputs that wait for an earlier input: ``{"i": index, "in": input_key, "out": text, "sha256":
    journal_digest}``.

    The journal has no version header: an older seqgen's entries (no ``sha256``) are still read, as untrusted
    (:func:`load_journal` discards them and their inputs are generated anew), so that an interrupted run of the
    previous format still resumes from its output and index; bumping :data:`INDEX_VERSION` would refuse it
    whole, and what a journal holds can always be generated again.
    """

    def __init__(self, output: str | os.PathLike[str], *, fresh: bool) -> None:
        super().__init__(journal_path(output), fresh=fresh)

    def add(self, entries: list[tuple[int, str, str]]) -> None:
        """``(index, input_key(record), output text)`` per entry."""
        self.append(
            [
                {"i": i, "in": key, "out": out, "sha256": journal_digest(i, key, out)}
                for i, key, out in entries
            ]
        )


# why a journal entry is not used (load_journal's warning names each)
EDITED = "edited or damaged since written: the output does not match its digest"
NO_DIGEST = "without a digest: written by an older seqgen, not trusted"
UNREADABLE = "unreadable: torn or garbled"


def load_journal(output: str | os.PathLike[str], done: int) -> tuple[dict[int, tuple[str, str]], str | None]:
    """The journaled outputs of inputs ``done`` and later whose digest holds: index -> (input key, output text);
    and, when entries were discarded (their inputs are then generated anew, never written from the journal), a
    warning that says how many and why."""
    path = journal_path(output)
    if not path.exists():
        return {}, None
    good: dict[int, tuple[str, str]] = {}
    bad: dict[int, str] = {}  # index -> why its entry is not used
    unreadable = 0
    with open(path, "rb") as fh:
        for line in fh:
            entry = _journal_entry(line)
            if entry is None:
                unreadable += 1
                continue
            i, key, out, digest = entry
            if i < done:
                continue
            if digest is None:
                bad[i] = NO_DIGEST
            elif digest != journal_digest(i, key, out):
                bad[i] = EDITED
            else:
                good[i] = (key, out)
    reasons = Counter(why for i, why in bad.items() if i not in good)  # a later good entry for it: no loss
    reasons[UNREADABLE] += unreadable
    total = sum(reasons.values())
    if not total:
        return good, None
    why = "; ".join(f"{n} {reason}" for reason, n in reasons.items() if n)
    entries = "entry" if total == 1 else "entries"
    return (
        good,
        f"discarded {total} {entries} of {path.name} ({why}); the inputs they were for are generated anew",
    )


def _journal_entry(line: bytes) -> tuple[int, str, str, str | None] | None:
    """``(index, input key, output text, digest or None)`` of a journal line; None when it is not one."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict):
        return None
    i, key, out, digest = entry.get("i"), entry.get("in"), entry.get("out"), entry.get("sha256")
    if type(i) is not int or not isinstance(key, str) or not isinstance(out, str):
        return None
    if "sha256" not in entry:
        return i, key, out, None  # the previous format
    return i, key, out, digest if isinstance(digest, str) else ""  # "": matches no digest


# -- the part manifest ------------------------------------------------------------------------------------


def write_manifest(part: str, settings: dict[str, Any], inputs: int, size: int, sha256: str) -> None:
    """Record a finished part (written whole, or not at all)."""
    path = manifest_path(part)
    entry = {
        "seqgen_part": MANIFEST_VERSION,
        "settings": settings,
        "inputs": inputs,
        "bytes": size,
        "sha256": sha256,
    }
    write_whole(path, json.dumps(entry, sort_keys=True) + "\n")


def prefix_sha256(path: str | os.PathLike[str], size: int | None = None) -> Any:
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


# -- the parts folder ---------------------------------------------------------------------------------------


def remove_parts(output: str | os.PathLike[str]) -> bool:
    """Remove what a ``--workers`` run wrote in ``output``'s parts folder (part files with their index, journal
    and lock; the driver's mark), then the folder if that emptied it; a part a worker still holds locked stays.
    True when no parts folder is left."""
    try:
        import fcntl
    except ImportError:  # no locks here, so no --workers run (worker.py needs them) wrote a part
        fcntl = None  # type: ignore[assignment]
    folder = parts_dir(output)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    for base in sorted({b for b in map(_part_of, names) if b is not None}):
        part = folder / base
        try:
            lock = os.open(f"{part}{LOCK_SUFFIX}", os.O_RDONLY)
        except FileNotFoundError:
            lock = None
        except OSError:
            continue
        try:
            if lock is not None and fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a worker writes it
            remove_part(part)
        except OSError:
            continue
        finally:
            if lock is not None:
                os.close(lock)
    with contextlib.suppress(OSError):
        (folder / DRIVER_MARK).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        return not folder.exists()
    return True


def _part_of(name: str) -> str | None:
    """The part file ``name`` is, or lies beside (index, journal, lock); None: not one seqgen writes."""
    for suffix in ("", INDEX_SUFFIX, JOURNAL_SUFFIX, LOCK_SUFFIX):
        base = name[: len(name) - len(suffix)]
        if name.endswith(suffix) and PART_NAME.fullmatch(base):
            return base
    return None
