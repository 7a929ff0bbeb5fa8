"""The generate loop: read a window of inputs, sort by length, batch, generate, write in input order."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import TextIO

from tqdm import tqdm

from seqgen_cli.generator import Generator
from seqgen_cli.pipeline.read import Record
from seqgen_cli.pipeline.write import format_output, write_output


@dataclass
class Summary:
    """What a run did, for the closing line on stderr."""

    inputs: int = 0
    truncated: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    backend: str = ""
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        rate = self.inputs / self.seconds if self.seconds else 0.0
        tok = self.generated_tokens / self.seconds if self.seconds else 0.0
        return (
            f"seqgen: {self.inputs} inputs in {self.seconds:.1f}s ({rate:.2f} inputs/s, {tok:.1f} tokens/s), "
            f"backend {self.backend}"
        )


def make_batches(
    lengths: list[int], batch_size: int, batch_tokens: int | None, rows_per_input: int
) -> Iterator[list[int]]:
    """Group input positions, shortest first, so each batch has at most ``batch_size`` inputs and at most
    ``batch_tokens`` padded source tokens counted per row (``rows_per_input`` rows per input)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch: list[int] = []
    for i in order:
        width = max(lengths[i], max((lengths[j] for j in batch), default=0))
        too_many_tokens = (
            batch_tokens is not None and width * (len(batch) + 1) * rows_per_input > batch_tokens
        )
        if batch and (len(batch) >= batch_size or too_many_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def run(
    gen: Generator,
    records: Iterable[Record],
    out: TextIO,
    *,
    batch_size: int = 32,
    batch_tokens: int | None = None,
    output_format: str = "text",
    output_field: str = "output",
    progress: bool = False,
    flush_lines: bool = False,
    window: int | None = None,
) -> Summary:
    """Generate for every record and write the outputs to ``out`` in input order."""
    summary = Summary(backend=gen.backend)
    start = time.perf_counter()
    rows = max(gen.config.num_beams or 1, gen.config.num_return_sequences or 1)
    window = window or max(batch_size * 8, 256)
    stream = iter(records)
    bar = tqdm(unit="input", disable=not progress, dynamic_ncols=True, leave=False)
    try:
        while chunk := list(islice(stream, window)):
            live = [r for r in chunk if r.text.strip()]
            encoded = gen.encode([r.text for r in live])
            summary.truncated += sum(e.truncated for e in encoded)
            outputs: dict[int, list[str]] = {}
            for batch in make_batches([len(e.ids) for e in encoded], batch_size, batch_tokens, rows):
                results = gen.generate_ids([encoded[i].ids for i in batch])
                for i, seqs in zip(batch, results, strict=True):
                    outputs[live[i].index] = gen.decode(seqs)
                    summary.generated_tokens += sum(len(s) for s in seqs)
                bar.update(len(batch))
            n_out = gen.config.num_return_sequences or 1
            for r in chunk:
                texts = outputs.get(r.index, [""] * n_out)
                write_output(out, format_output(r, texts, output_format, output_field), flush_lines)
            out.flush()
            summary.inputs += len(chunk)
    finally:
        bar.close()
        summary.seconds = time.perf_counter() - start
    return summary
