"""The progress bar on stderr: inputs done (of the total, once counted), outputs/s and tokens/s."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

from tqdm import tqdm

from seqgen_cli.pipeline.records import is_regular


def count_lines(paths: Sequence[str]) -> int | None:
    """Lines in ``paths`` when all are regular files (a fast byte scan), else ``None``."""
    if not paths or not all(p != "-" and is_regular(p) for p in paths):
        return None
    total = 0
    for path in paths:
        last = b"\n"
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                total += block.count(b"\n")
                last = block[-1:]
        total += last != b"\n"
    return total


class Progress:
    """A tqdm bar (or nothing when disabled); the total is counted in the background."""

    def __init__(
        self, enabled: bool, paths: Sequence[str] = (), initial: int = 0, total: int | None = None
    ) -> None:
        self.bar = tqdm(
            initial=initial, unit="input", disable=not enabled, file=sys.stderr, dynamic_ncols=True,
            smoothing=0.1, leave=False,
        )  # fmt: skip
        self._total: int | None = total
        if enabled and paths and total is None:
            threading.Thread(target=self._count, args=(list(paths),), daemon=True).start()

    def _count(self, paths: list[str]) -> None:
        self._total = count_lines(paths)

    def update(self, inputs: int, tokens_per_second: float) -> None:
        if self.bar.disable:
            return
        if self._total is not None and self.bar.total is None:
            self.bar.total = self._total
        self.bar.set_postfix_str(f"{tokens_per_second:.0f} tok/s", refresh=False)
        self.bar.update(inputs)

    def start_at(self, done: int) -> None:
        """A resumed run starts with ``done`` inputs already written."""
        self.bar.initial = self.bar.n = done

    def set(self, done: int, tokens_per_second: float) -> None:
        """Show ``done`` inputs (a sum over workers, which can also go down when one is lost)."""
        if self.bar.disable or done == self.bar.n:
            return
        if self._total is not None and self.bar.total is None:
            self.bar.total = self._total
        self.bar.set_postfix_str(f"{tokens_per_second:.0f} tok/s", refresh=False)
        self.bar.update(done - self.bar.n)

    def write(self, message: str) -> None:
        """A line on stderr that does not break the bar."""
        tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


class CountingProgress(Progress):
    """No bar: counts the inputs done and keeps the warnings (a Ray worker's, read by the driver)."""

    def __init__(self) -> None:
        super().__init__(False)
        self.done = 0
        self.messages: list[str] = []

    def update(self, inputs: int, tokens_per_second: float) -> None:
        self.done += inputs

    def write(self, message: str) -> None:
        self.messages.append(message)
