"""Reading inputs: plain text lines or JSONL, from files or stdin, with one-line errors naming the line."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from seqgen_cli.errors import SeqgenError

DEFAULT_FIELDS = ("text", "src", "source", "input")


@dataclass
class Record:
    """One input: its text and, for JSONL, the whole object (passed through to JSONL output).

    ``error`` is set (and ``text`` empty) for a bad line read with ``on_error="skip"``; ``fields`` then holds
    its JSON object if it parsed as one.
    """

    index: int  # position among all inputs, 0-based
    source: str  # file name ("<stdin>" for standard input)
    line: int  # 1-based line number in that file
    text: str
    fields: dict[str, Any] | None = field(default=None)
    error: str | None = None

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


class BadLine(SeqgenError):
    """A line that cannot be an input; ``fields``: its JSON object when it parsed as one (kept in JSONL
    output by ``--on-error skip``)."""

    def __init__(self, message: str, fields: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.fields = fields


def _open(path: str) -> tuple[BinaryIO, str]:
    if path == "-":
        if sys.stdin is None:
            raise SeqgenError("standard input is closed: give input files, or pipe the input in")
        return sys.stdin.buffer, "<stdin>"
    try:
        return open(path, "rb"), path
    except FileNotFoundError:
        raise SeqgenError(f"{path}: no such input file") from None
    except IsADirectoryError:
        raise SeqgenError(f"{path}: is a folder, not an input file") from None
    except OSError as err:
        raise SeqgenError(f"{path}: cannot read: {err.strerror}") from None


def check_inputs(paths: Sequence[str]) -> None:
    """Fail early (before the model loads) on an input file that cannot be opened."""
    for path in paths or ["-"]:
        stream = _open(path)[0]
        if path != "-":
            stream.close()


def _stat(path: str) -> os.stat_result | None:
    """``os.stat`` of ``path`` (``-``: standard input), or None when there is nothing to stat."""
    try:
        return os.fstat(sys.stdin.fileno()) if path == "-" else os.stat(path)
    except (OSError, ValueError, AttributeError):  # missing, or stdin closed or replaced (no fileno)
        return None


def _stdout_stat() -> os.stat_result | None:
    try:
        return os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return None


def check_not_output(inputs: Sequence[str], output: str, what: str = "input") -> None:
    """Refuse an input (``-``: stdin) that is the output file (``-``: stdout) under any name: the same
    inode through a hard link, a symlink or another path. Checked before anything is opened for writing."""
    out = _stdout_stat() if output == "-" else _stat(output)
    if out is None or not stat.S_ISREG(out.st_mode):  # a new file, a pipe or a device: nothing to destroy
        return
    for path in inputs or ["-"]:
        st = _stat(path)
        if st is None or (st.st_dev, st.st_ino) != (out.st_dev, out.st_ino):
            continue
        if path == "-":
            raise SeqgenError(
                f"standard input is the output file {output}: writing it would destroy the input"
            )
        if output == "-":
            raise SeqgenError(
                f"standard output is the {what} file {path}: writing it would destroy the {what}"
            )
        same = "" if os.path.abspath(path) == os.path.abspath(output) else f" (the same file as {path})"
        raise SeqgenError(f"{output} is both an {what} and the output{same}")


def is_regular(path: str) -> bool:
    """Whether ``path`` (``-`` = stdin) is a regular file, i.e. reads never wait on a writer."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode if path == "-" else os.stat(path).st_mode
    except (OSError, ValueError, AttributeError):  # AttributeError: stdin closed (None)
        return False
    return stat.S_ISREG(mode)


def _detect(path: str, first: bytes) -> str:
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    stripped = first.strip()
    if stripped.startswith(b"{") and stripped.endswith(b"}"):
        try:
            return "jsonl" if isinstance(json.loads(stripped), dict) else "text"
        except ValueError:
            return "text"
    return "text"


def read_records(
    paths: Sequence[str],
    input_format: str = "auto",
    input_field: str | None = None,
    on_error: str = "fail",
    select: tuple[int, int] | None = None,
) -> Iterator[Record]:
    """Stream records from ``paths`` (``-`` = stdin) in order, never holding a whole file.

    A bad line raises :class:`SeqgenError` naming it; with ``on_error="skip"`` it becomes a record
    with ``error`` set instead, so that output alignment holds. ``select=(lo, hi)``: only the inputs
    ``lo <= index < hi`` (one shard of ``--shard I/N``), re-indexed from 0; the others are not parsed
    (a bad line outside the range is not this shard's error), only counted.
    """
    lo, hi = select if select is not None else (0, None)
    index = 0
    for path in paths or ["-"]:
        stream, name = _open(path)
        try:
            fmt = input_format
            for number, raw in enumerate(stream, start=1):
                if fmt == "auto":
                    fmt = _detect(path, raw)  # from the file's first line, selected or not
                if hi is not None and index >= hi:
                    return
                if index >= lo:
                    try:
                        yield _record(index - lo, name, number, raw, fmt, input_field)
                    except SeqgenError as err:
                        if on_error != "skip":
                            raise
                        fields = err.fields if isinstance(err, BadLine) else None
                        yield Record(index - lo, name, number, "", fields, error=str(err))
                index += 1
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()


def _record(index: int, name: str, number: int, raw: bytes, fmt: str, input_field: str | None) -> Record:
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise SeqgenError(f"{name}:{number}: not valid UTF-8 (byte {err.start + 1})") from None
    if fmt == "jsonl":
        return _json_record(index, name, number, line, input_field)
    return Record(index, name, number, line)


def _json_record(index: int, name: str, number: int, line: str, input_field: str | None) -> Record:
    if not line.strip():
        raise SeqgenError(f"{name}:{number}: empty line in JSONL input (expected a JSON object)")
    try:
        obj = json.loads(line)
    except ValueError as err:
        raise SeqgenError(f"{name}:{number}: invalid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise SeqgenError(f"{name}:{number}: expected a JSON object, got {type(obj).__name__}")
    key = input_field or next((k for k in DEFAULT_FIELDS if k in obj), None)
    if key is None or key not in obj:
        wanted = repr(input_field) if input_field else " or ".join(repr(k) for k in DEFAULT_FIELDS)
        have = ", ".join(map(repr, obj)) or "none"
        raise BadLine(
            f"{name}:{number}: no field {wanted} (fields: {have}; choose one with --input-field)", obj
        )
    text = obj[key]
    if not isinstance(text, str):
        raise BadLine(f"{name}:{number}: field {key!r} is {type(text).__name__}, expected a string", obj)
    return Record(index, name, number, text, obj)
