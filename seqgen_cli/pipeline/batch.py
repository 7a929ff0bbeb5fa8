"""Batcher: within a look-ahead window, sort by source length and cut batches by a token budget.

A batch holds at most ``batch_size`` inputs and at most ``batch_tokens`` padded source tokens, counted
once per row the model runs (``rows`` = beams, or returned sequences when more). An input longer than
the budget on its own still forms a batch of one. Windows are consecutive in input order, so every
input of a later window comes after every input of an earlier one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from seqgen_cli.batching import plan_batches
from seqgen_cli.pipeline.tokenise import Chunk, Item


@dataclass
class Batch:
    items: list[Item]
    window: int  # which look-ahead window it came from (0, 1, ...)


class Batcher:
    """Turns tokenised chunks into batches; items with nothing to generate go to ``passthrough``.

    A window is cut when it holds ``window`` inputs, at the end of the input, or when the reader is
    starved (a pipe with nothing more to read yet), so a slow producer still sees its outputs early.
    ``window <= 1`` turns sorting off: batches follow input order.
    """

    def __init__(
        self,
        chunks: Iterator[Chunk],
        passthrough: Callable[[list[Item]], None],
        *,
        batch_size: int,
        batch_tokens: int | None = None,
        rows: int = 1,
        window: int = 2048,
    ) -> None:
        self._chunks = chunks
        self._passthrough = passthrough
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.rows = rows
        self.sort = window > 1
        self.window = window if self.sort else batch_size
        self.source_tokens = 0  # real source tokens in generated batches
        self.padded_tokens = 0  # the same, padded to each batch's widest input
        self.batches = 0
        self._windows = 0
        self._stopped = False

    def stop(self) -> None:
        """Finish the current window's batches, then end (read no further)."""
        self._stopped = True

    @property
    def padding_ratio(self) -> float:
        """Share of the padded source tokens that are padding."""
        return 1 - self.source_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def _cut(self, pending: list[Item]) -> Iterator[Batch]:
        lengths = [len(it.ids or ()) for it in pending]
        window = self._windows
        self._windows += 1
        for idx in plan_batches(lengths, self.batch_size, self.batch_tokens, self.rows, self.sort):
            width = max(lengths[i] for i in idx)
            self.source_tokens += sum(lengths[i] for i in idx)
            self.padded_tokens += width * len(idx)
            self.batches += 1
            yield Batch([pending[i] for i in idx], window)

    def __iter__(self) -> Iterator[Batch]:
        pending: list[Item] = []
        try:
            for chunk in self._chunks:
                if self._stopped:
                    return
                skip = [it for it in chunk.items if it.ids is None]
                if skip:
                    self._passthrough(skip)
                pending.extend(it for it in chunk.items if it.ids is not None)
                while len(pending) >= self.window and not self._stopped:
                    head, pending = pending[: self.window], pending[self.window :]
                    yield from self._cut(head)
                if pending and chunk.starved and not self._stopped:
                    yield from self._cut(pending)
                    pending = []
        except Exception:
            if pending and not self._stopped:  # generate what came before a bad line, then raise
                yield from self._cut(pending)
            raise
        if pending and not self._stopped:
            yield from self._cut(pending)
