"""Reading inputs: plain text lines or JSONL, from files or stdin, with one-line errors naming the line."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from seqgen_cli.errors import SeqgenError

DEFAULT_FIELDS = ("text", "src", "source", "input")
BOM = b"\xef\xbb\xbf"
# The longest input line read (bytes): far past any model's inputs (a line of it is ~16M tokens), and what keeps a
# file without newlines (``/dev/zero``, a binary file) from filling the memory line by line.
MAX_LINE_BYTES = 64 << 20
TOO_LONG = object()  # what :func:`lines` yields for a line past MAX_LINE_BYTES (the rest of it skipped)


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


class FieldClash(BadLine):
    """An input object that already holds a field JSONL output adds (:func:`output_fields`): writing the output
    would overwrite it."""


# the fields --scores adds to JSONL output -> the ``batching.Scored`` field each holds
SCORE_FIELDS = {"score": "score", "log_prob": "log_prob", "token_log_probs": "tokens"}


def output_fields(
    output_format: str,
    output_field: str,
    on_error: str,
    scores: bool = False,
    structured: bool = False,
    logprobs: bool = False,
) -> tuple[str, ...]:
    """The fields the output adds to each input object: ``--output-field`` with ``--output-format jsonl``,
    ``error`` too under ``--on-error skip``, :data:`SCORE_FIELDS` under ``--scores``, ``complete`` under a grammar
    (``structured``) and ``logprobs`` under ``--logprobs`` (JSONL only); none with text output. Raises when two are
    one field."""
    if logprobs and output_format != "jsonl":
        raise SeqgenError("--logprobs writes a JSONL field: add --output-format jsonl")
    if output_format != "jsonl":
        return ()
    if output_field == "error" and on_error == "skip":
        raise SeqgenError(
            "--output-field error is the field --on-error skip writes a skipped input's error to (JSONL output): "
            "choose another --output-field"
        )
    if output_field in SCORE_FIELDS and scores:
        raise SeqgenError(
            f"--output-field {output_field} is a field --scores writes (JSONL output): choose another"
        )
    added = {"complete": (structured, "structured outputs"), "logprobs": (logprobs, "--logprobs")}
    if output_field in added and added[output_field][0]:
        raise SeqgenError(
            f"--output-field {output_field} is the field {added[output_field][1]} write (JSONL output): choose another"
        )
    errors = ["error"] if on_error == "skip" else []
    more = [name for name, (on, _) in added.items() if on]
    return (output_field, *errors, *(SCORE_FIELDS if scores else []), *more)


def _clash(where: str, key: str, text_input: bool) -> FieldClash:
    """The input at ``where`` holds ``key``, a field the output adds: one line naming the way out."""
    if text_input:
        return FieldClash(
            f'{where}: text input is written to JSONL as {{"text": LINE, ...}}, so --output-field text would '
            "overwrite the input: choose another --output-field"
        )
    if key in SCORE_FIELDS:
        return FieldClash(
            f"{where}: the input already has a field {key!r}, which --scores writes in JSONL output (each output's "
            "score): rename it in the input, or use text output (its lines then begin with the scores)"
        )
    if key == "error":
        return FieldClash(
            f"{where}: the input already has a field 'error', which --on-error skip writes in JSONL output (a "
            "skipped input's error): rename it in the input, or leave out --on-error skip"
        )
    return FieldClash(
        f"{where}: the input already has a field {key!r}, which JSONL output would overwrite with the output: "
        "choose another name with --output-field"
    )


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


def check_inputs(
    paths: Sequence[str],
    input_format: str = "auto",
    input_field: str | None = None,
    reserved: Collection[str] = (),
    on_error: str = "skip",
    chat: bool = False,
) -> None:
    """Fail early (before the model loads) on an input file that cannot be opened, or whose first line stops the
    run: whatever ``--on-error`` says, ``--input-field`` for text input and a field the output would overwrite
    (``reserved``, :func:`output_fields`); under ``on_error="fail"`` any bad first line (the run would stop there
    with nothing written). ``chat``: as :func:`read_records` takes it.

    A regular file is opened, its first line read, and closed; anything else (a named pipe, ``/dev/stdin``, a
    process substitution) is only looked at: it can be read once, by the run (which checks the same on its first
    line before anything is written), and an open here would wait for a writer or take its data."""
    for path in paths or ["-"]:
        if path == "-" or not is_regular(path):
            _check_stream(path)
            continue
        stream, name = _open(path)
        with stream:
            raw = stream.readline(MAX_LINE_BYTES)
        if raw and len(raw) < MAX_LINE_BYTES:
            _check_first_line(path, name, raw, input_format, input_field, reserved, on_error, chat)


def _check_stream(path: str) -> None:
    if path == "-":
        if sys.stdin is None:
            raise SeqgenError("standard input is closed: give input files, or pipe the input in")
        return
    if not os.path.exists(path):
        raise SeqgenError(f"{path}: no such input file")
    if os.path.isdir(path):
        raise SeqgenError(f"{path}: is a folder, not an input file")
    if not os.access(path, os.R_OK):
        raise SeqgenError(f"{path}: cannot read: permission denied")


def is_regular(path: str) -> bool:
    """Whether ``path`` (``-`` = stdin) is a regular file, i.e. reads never wait on a writer."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode if path == "-" else os.stat(path).st_mode
    except (OSError, ValueError, AttributeError):  # AttributeError: stdin closed (None)
        return False
    return stat.S_ISREG(mode)


JSONL_EXTENSIONS = (".jsonl", ".json", ".ndjson")
# Read as text whatever their first line holds (a .txt file may well start with a JSON object).
TEXT_EXTENSIONS = (".txt", ".text", ".src", ".source", ".tgt", ".target", ".tok", ".raw")


def _check_first_line(
    path: str,
    name: str,
    raw: bytes,
    input_format: str,
    input_field: str | None,
    reserved: Collection[str],
    on_error: str,
    chat: bool,
) -> None:
    if raw.startswith(BOM):
        raw = raw[len(BOM) :]
    fmt = _detect(path, raw) if input_format == "auto" else input_format
    if fmt == "text" and input_field is not None:
        raise _text_with_field(name, input_format)
    try:
        _record(0, name, 1, raw, fmt, input_field, reserved, chat)
    except FieldClash:
        raise
    except SeqgenError:
        if on_error != "skip":  # the run would stop at it, having written nothing
            raise
        # skipped: the run meets it, under --on-error's rules


def _detect(path: str, first: bytes) -> str:
    """``--input-format auto``: by the file's extension; for stdin and other extensions, JSONL when the first
    line is a JSON object, else text."""
    suffix = os.path.splitext(path)[1].lower() if path != "-" else ""
    if suffix in JSONL_EXTENSIONS:
        return "jsonl"
    if suffix in TEXT_EXTENSIONS:
        return "text"
    stripped = first.strip()
    if stripped.startswith(b"{") and stripped.endswith(b"}"):
        try:
            return "jsonl" if isinstance(json.loads(stripped), dict) else "text"
        except (ValueError, RecursionError):  # nested past Python's recursion limit: read_records names it
            return "text"
    return "text"


def _text_with_field(name: str, input_format: str) -> SeqgenError:
    """``--input-field`` given for an input read as text: one line naming the input."""
    name = "stdin" if name == "<stdin>" else name
    if input_format == "auto":
        return SeqgenError(f"{name} is text (one input per line): --input-field needs JSONL input")
    return SeqgenError(f"{name} is read as text (--input-format text): --input-field needs JSONL input")


def read_records(
    paths: Sequence[str],
    input_format: str = "auto",
    input_field: str | None = None,
    on_error: str = "fail",
    select: tuple[int, int] | None = None,
    reserved: Collection[str] = (),
    chat: bool = False,
) -> Iterator[Record]:
    """Stream records from ``paths`` (``-`` = stdin) in order, never holding a whole file.

    A bad line raises :class:`SeqgenError` naming it; with ``on_error="skip"`` it becomes a record
    with ``error`` set instead, so that output alignment holds. ``select=(lo, hi)``: only the inputs
    ``lo <= index < hi`` (one shard of ``--shard I/N``), re-indexed from 0; the others are not parsed
    (a bad line outside the range is not this shard's error), only counted.

    A JSON object with a key twice is a bad line (JSON would keep the last value). ``reserved``: the fields the
    output adds (:func:`output_fields`); an input holding one (text input: ``text``) is a :class:`FieldClash`.
    On a file's first line that stops the run whatever ``on_error`` says: the output field is a setting, every
    line likely holds it; :func:`check_inputs` finds it there before the model loads, for a regular file.
    On a later line it is a bad line like any other (a skipped one is written without its object, which the
    output would overwrite). ``chat`` (``--chat``): a JSON object with a ``messages`` list and no input field is a
    conversation, its text the last message's (what ``--max-source-length`` shortens); one with both is a bad line.
    """
    lo, hi = select if select is not None else (0, None)
    index = 0
    for path in paths or ["-"]:
        stream, name = _open(path)
        try:
            fmt = input_format
            for number, raw in enumerate(lines(stream), start=1):
                if raw is TOO_LONG:
                    err = BadLine(
                        f"{name}:{number}: a line of more than {MAX_LINE_BYTES >> 20} MiB: not an input"
                    )
                    if on_error != "skip":
                        raise err
                    if lo <= index and (hi is None or index < hi):
                        yield Record(index - lo, name, number, "", None, error=str(err))
                    index += 1
                    continue
                if number == 1 and raw.startswith(BOM):  # a UTF-8 byte-order mark is not text
                    raw = raw[len(BOM) :]
                if fmt == "auto":
                    fmt = _detect(path, raw)  # from the file's first line, selected or not
                if number == 1 and fmt == "text" and input_field is not None:
                    raise _text_with_field(name, input_format)
                if hi is not None and index >= hi:
                    return
                if index >= lo:
                    try:
                        yield _record(index - lo, name, number, raw, fmt, input_field, reserved, chat)
                    except SeqgenError as err:
                        if on_error != "skip" or (number == 1 and isinstance(err, FieldClash)):
                            raise
                        fields = err.fields if isinstance(err, BadLine) else None  # a FieldClash: None
                        yield Record(index - lo, name, number, "", fields, error=str(err))
                index += 1
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()


def lines(stream: BinaryIO) -> Iterator[Any]:
    """``stream``'s lines (bytes, with their newline), each at most :data:`MAX_LINE_BYTES`: a longer one is
    :data:`TOO_LONG`, the rest of it read past when the next line is asked for (a run that stops there does not
    read an endless one to its end)."""
    while raw := stream.readline(MAX_LINE_BYTES):
        if len(raw) < MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        yield TOO_LONG
        while (rest := stream.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
            pass


def _record(
    index: int,
    name: str,
    number: int,
    raw: bytes,
    fmt: str,
    input_field: str | None,
    reserved: Collection[str] = (),
    chat: bool = False,
) -> Record:
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise SeqgenError(f"{name}:{number}: not valid UTF-8 (byte {err.start + 1})") from None
    if fmt == "jsonl":
        return _json_record(index, name, number, line, input_field, reserved, chat)
    if "text" in reserved:  # JSONL output of text input is {"text": line, ...}
        raise _clash(f"{name}:{number}", "text", text_input=True)
    return Record(index, name, number, line)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON value (write it as a string, or as null)")


def _finite(number: str) -> float:
    """``json.loads``'s ``parse_float``: a number past a float's range (``1e400``) would be written back as
    ``Infinity``, which is not JSON."""
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"{number} is past a float's range (write it as a string)")
    return value


class _DuplicateKey(Exception):
    """A key twice in one JSON object (raised by :func:`_unique` through ``json.loads``)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, or :class:`_DuplicateKey` naming a repeated key."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


def _json_record(
    index: int,
    name: str,
    number: int,
    line: str,
    input_field: str | None,
    reserved: Collection[str] = (),
    chat: bool = False,
) -> Record:
    if not line.strip():
        raise SeqgenError(f"{name}:{number}: empty line in JSONL input (expected a JSON object)")
    try:
        obj = json.loads(line, parse_constant=_not_json, parse_float=_finite, object_pairs_hook=_unique)
    except RecursionError:  # Python's JSON decoder recurses per level
        raise SeqgenError(
            f"{name}:{number}: invalid JSON: nested too deep for Python's JSON reader"
        ) from None
    except _DuplicateKey as dup:
        raise SeqgenError(
            f"{name}:{number}: duplicate key {dup.args[0]!r} in a JSON object (JSON would keep only its last value)"
        ) from None
    except ValueError as err:
        raise SeqgenError(f"{name}:{number}: invalid JSON: {err}") from None
    if isinstance(obj, list):  # a JSON document (an array of objects), not JSON Lines
        raise SeqgenError(
            f"{name}:{number}: a JSON array, not a JSONL line (one JSON object per line): write one object per line "
            "(e.g. jq -c '.[]' FILE), or read the file as text with --input-format text"
        )
    if not isinstance(obj, dict):
        raise SeqgenError(f"{name}:{number}: expected a JSON object, got {type(obj).__name__}")
    try:  # a \ud800 escape decodes to a lone surrogate: no tokenizer (and no UTF-8 output) takes it
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        char = err.object[err.start : err.end].encode("unicode_escape").decode()
        raise SeqgenError(
            f"{name}:{number}: not valid Unicode: a lone surrogate ({char}) from a JSON escape"
        ) from None
    if (clash := next((k for k in reserved if k in obj), None)) is not None:
        raise _clash(f"{name}:{number}", clash, text_input=False)
    key = input_field or next((k for k in DEFAULT_FIELDS if k in obj), None)
    if chat and "messages" in obj and key in obj:  # one rule: a text input or a conversation, never both
        raise BadLine(
            f'{name}:{number}: fields {key!r} and "messages" both given: under --chat an input is a text (the user '
            'message) or a "messages" conversation: keep one',
            obj,
        )
    if (
        key is None and chat and isinstance(messages := obj.get("messages"), list)
    ):  # a conversation (prompts.py)
        said = [
            m.get("content") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
        ]
        return Record(index, name, number, said[-1] if said else "", obj)  # its text: the last said
    if key is None or key not in obj:
        wanted = repr(input_field) if input_field else " or ".join(repr(k) for k in DEFAULT_FIELDS)
        have = ", ".join(map(repr, obj)) or "none"
        hint = '; a "messages" conversation needs --chat' if "messages" in obj and not chat else ""
        raise BadLine(
            f"{name}:{number}: no field {wanted} (fields: {have}; choose one with --input-field{hint})", obj
        )
    text = obj[key]
    if not isinstance(text, str):
        raise BadLine(f"{name}:{number}: field {key!r} is {type(text).__name__}, expected a string", obj)
    return Record(index, name, number, text, obj)
