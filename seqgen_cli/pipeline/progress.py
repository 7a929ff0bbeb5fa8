"""The progress bar on stderr: inputs done (of the total, once counted), outputs/s and tokens/s; warnings."""

from __future__ import annotations

import logging
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from tqdm import tqdm

from seqgen_cli.errors import one_line
from seqgen_cli.pipeline.shards import count_lines

MAX_WARNINGS = 20  # shown per run; the rest are counted in the summary


def bar_wanted(output: str) -> bool:
    """Whether a progress bar may show: stderr is a terminal and the outputs (``-o output``; ``-``: stdout) do
    not go to that terminal, where the bar's redraws and the output lines would overwrite each other."""
    return _isatty(sys.stderr) and not _to_terminal(output)


def _isatty(stream: object) -> bool:
    try:
        return stream is not None and stream.isatty()  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _to_terminal(output: str) -> bool:
    """Whether ``output`` is stdout on a terminal, the controlling terminal or stderr's terminal."""
    if output == "-":
        return _isatty(sys.stdout)
    path = os.path.realpath(output)  # /dev/stdout -> /proc/self/fd/1 -> /dev/pts/N
    if path == "/dev/tty":
        return True
    try:
        mode, device = os.stat(path), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISCHR(mode.st_mode) and mode.st_rdev == device.st_rdev


class Progress:
    """A tqdm bar (or nothing when disabled); the total is counted in the background. Warnings go above it,
    the first :data:`MAX_WARNINGS` of them."""

    def __init__(
        self, enabled: bool, paths: Sequence[str] = (), initial: int = 0, total: int | None = None
    ) -> None:
        self.bar = tqdm(
            initial=initial,
            unit="input",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
            smoothing=0.1,
            leave=False,
        )
        self._total: int | None = total
        self.warned = 0
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

    def warn(self, message: str) -> None:
        """``seqgen: warning: message`` (up to :data:`MAX_WARNINGS`, then one line that says the rest are not
        shown)."""
        self.warned += 1
        if self.warned <= MAX_WARNINGS:
            self.write(f"seqgen: warning: {one_line(message)}")
        elif self.warned == MAX_WARNINGS + 1:
            self.write("seqgen: warning: further warnings not shown (see the counts at the end)")

    def write(self, message: str) -> None:
        """A line on stderr that does not break the bar."""
        tqdm.write(message, file=sys.stderr)

    @contextmanager
    def notes(self, source: str = "seqgen_cli.models") -> Iterator[None]:
        """While the bar shows, the engine's notes above it (``source``'s INFO records: a shape compiling, which
        pauses the bar), as ``seqgen: <note>``."""
        if self.bar.disable:
            yield
            return
        logger, handler = logging.getLogger(source), _Lines(self.write)
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)

    def close(self) -> None:
        self.bar.close()


class _Lines(logging.Handler):
    """Log records as ``seqgen: <message>`` lines through ``write``."""

    def __init__(self, write: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.lines = write

    def emit(self, record: logging.LogRecord) -> None:
        self.lines(f"seqgen: {record.getMessage()}")


class CountingProgress(Progress):
    """No bar: counts the inputs done and keeps the warnings, all of them (a Ray worker's: the driver shows
    them, through its own :meth:`Progress.warn`)."""

    def __init__(self) -> None:
        super().__init__(False)
        self.done = 0
        self.messages: list[str] = []

    def update(self, inputs: int, tokens_per_second: float) -> None:
        self.done += inputs

    def warn(self, message: str) -> None:
        self.messages.append(message)
