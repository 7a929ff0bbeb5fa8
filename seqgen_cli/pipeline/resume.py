"""``--resume``: continue an interrupted run from its output file and side index.

The index (see :mod:`seqgen_cli.pipeline.sinks`) records the run's settings and, per flush, how many
inputs were written, the output's byte length and a SHA-256 of those inputs. Resuming checks the
settings, re-reads (without regenerating) the inputs already done, checks their digest, truncates the
output to the recorded length and goes on from there. Journaled outputs carry their input's hash and are
reused only for the same input. A finished ``--shard`` part also gets a manifest here (read by
:mod:`~.merge`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seqgen_cli.errors import SeqgenError, WriteError
from seqgen_cli.pipeline.records import Record

if TYPE_CHECKING:
    from seqgen_cli.generator import Generator
    from seqgen_cli.pipeline.job import JobOptions

INDEX_SUFFIX = ".seqgen-index"
JOURNAL_SUFFIX = ".seqgen-journal"
MANIFEST_SUFFIX = ".seqgen-part"  # a finished --shard part, for `seqgen merge` (see merge.py)
MANIFEST_VERSION = 1


def index_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}{INDEX_SUFFIX}")


def journal_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}{JOURNAL_SUFFIX}")


def manifest_path(part: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(part)}{MANIFEST_SUFFIX}")


def write_manifest(part: str, settings: dict[str, Any], inputs: int, size: int) -> None:
    """Record a finished part (written whole, or not at all)."""
    path = manifest_path(part)
    entry = {"seqgen_part": MANIFEST_VERSION, "settings": settings, "inputs": inputs, "bytes": size}
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


@dataclass
class ResumeState:
    done: int
    offset: int
    sha256: str


def fingerprint(gen: Generator, opts: JobOptions) -> dict[str, Any]:
    """The settings that decide the output bytes, in a JSON-comparable form (checked by ``--resume``)."""
    generation = {
        k: v
        for k, v in json.loads(gen.config.to_json_string(use_diff=False)).items()
        if not k.startswith("_") and k != "transformers_version"
    }
    name = str(getattr(gen.model.config, "_name_or_path", ""))
    settings = dict(
        model=os.path.realpath(name) if name and os.path.isdir(name) else name,
        backend=gen.backend,
        generation=generation,
        prefix=gen.prefix,
        max_source_length=gen.max_source_length,
        input_format=opts.input_format,
        input_field=opts.input_field,
        output_format=opts.output_format,
        output_field=opts.output_field,
        on_error=opts.on_error,
    )
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def check_fresh(output: str) -> None:
    """A run without ``--resume`` must not overwrite an interrupted one."""
    index = index_path(output)
    if index.exists():
        raise SeqgenError(
            f"{output} holds an interrupted run ({index.name} exists): add --resume to continue it, "
            f"or delete {index.name} to start over"
        )


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


class Journal(JsonLog):
    """Finished outputs that wait for an earlier input: ``{"i": index, "in": input_key, "out": text}``."""

    def __init__(self, output: str | os.PathLike[str], *, fresh: bool) -> None:
        super().__init__(journal_path(output), fresh=fresh)

    def add(self, entries: list[tuple[int, str, str]]) -> None:
        """``(index, input_key(record), output text)`` per entry."""
        self.append([{"i": i, "in": key, "out": out} for i, key, out in entries])


def input_key(record: Record) -> str:
    """SHA-256 of one input (as :class:`InputDigest` hashes it): a journaled output is reused only for the
    same input."""
    return hashlib.sha256(InputDigest.encode(record)).hexdigest()


def load_journal(output: str | os.PathLike[str], done: int) -> dict[int, tuple[str, str]]:
    """The journaled outputs of inputs ``done`` and later: index -> (input key, output text)."""
    path = journal_path(output)
    if not path.exists():
        return {}
    entries = (e for e in read_json_lines(path) if isinstance(e, dict) and e.get("i", -1) >= done)
    return {int(e["i"]): (str(e.get("in", "")), str(e["out"])) for e in entries}


class IndexWriter(JsonLog):
    """Progress entries ``{"done", "offset", "sha256"}`` after the settings header."""

    def __init__(self, output: str | os.PathLike[str], settings: dict[str, Any], *, fresh: bool) -> None:
        super().__init__(index_path(output), fresh=fresh)
        if fresh:
            self.append([{"seqgen_index": 1, "settings": settings}, {"done": 0, "offset": 0, "sha256": ""}])

    def add(self, done: int, offset: int, sha256: str) -> None:
        self.append([{"done": done, "offset": offset, "sha256": sha256}])


def load(output: str | os.PathLike[str], settings: dict[str, Any]) -> ResumeState | None:
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
    header, last = _read_index(index)
    old = header.get("settings", {})
    if old != settings:
        keys = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        raise SeqgenError(
            f"--resume: {output} was written with different settings ({', '.join(keys)}); "
            f"rerun with the same settings, or delete {index.name} to start over"
        )
    size = out.stat().st_size if out.exists() else 0
    if last.offset > size:
        raise SeqgenError(
            f"--resume: {output} is shorter than {index.name} records; delete both to start over"
        )
    return last


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def _read_index(index: Path) -> tuple[dict[str, Any], ResumeState]:
    header: dict[str, Any] | None = None
    last = ResumeState(0, 0, "")
    for entry in read_json_lines(index):
        if header is None:
            header = entry
        elif isinstance(entry, dict) and "done" in entry:
            last = ResumeState(int(entry["done"]), int(entry["offset"]), str(entry["sha256"]))
    if not isinstance(header, dict) or header.get("seqgen_index") != 1:
        raise SeqgenError(f"--resume: {index} is not a seqgen index; delete it to start over")
    return header, last


def skip_done(records: Iterator[Record], state: ResumeState, digest: InputDigest) -> Iterator[Record]:
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
