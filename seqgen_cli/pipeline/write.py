"""Writing outputs in input order: text lines or JSONL."""

from __future__ import annotations

import json
from typing import TextIO

from seqgen_cli.pipeline.read import Record


def format_output(record: Record, outputs: list[str], output_format: str, output_field: str) -> str:
    """The output line(s) for one input, newline-terminated.

    Text: one line per returned sequence (``num_return_sequences`` consecutive lines, best first);
    newlines inside a generation become spaces so line alignment holds. JSONL: the input object
    (or ``{}`` for text input) with ``output_field`` set to the string, or to a list when more than one
    sequence is returned.
    """
    if output_format == "jsonl":
        obj = dict(record.fields) if record.fields is not None else {}
        obj[output_field] = outputs[0] if len(outputs) == 1 else outputs
        return json.dumps(obj, ensure_ascii=False) + "\n"
    return "".join(" ".join(o.splitlines()) + "\n" for o in outputs)


def write_output(out: TextIO, text: str, flush: bool) -> None:
    out.write(text)
    if flush:
        out.flush()
