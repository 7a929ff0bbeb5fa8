"""Where a process's seconds go before its first decode step: ``--stats`` ``startup``.

``stage(name)`` times a piece of start-up (importing transformers, the tokenizer, the model class, the weights, the
int8 weights, the fast backend); ``mark(name)`` notes how long after the process started something first happened
(the CLI's ``main``, the first batch handed to the engine). The process's start is the kernel's (``/proc/self/stat``:
the interpreter's own start-up and imports included); where that cannot be read (not Linux), from when
``seqgen_cli`` was imported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_STAGES: dict[str, float] = {}
_MARKS: dict[str, float] = {}


def _process_age() -> float | None:
    """Seconds since the kernel started this process (Linux), else ``None``."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, clock ticks after boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_AGE_AT_IMPORT = _process_age()
_IMPORTED = time.perf_counter()


def since_start() -> float:
    """Seconds since the process started (since this module's import where the kernel does not say)."""
    return (_AGE_AT_IMPORT or 0.0) + time.perf_counter() - _IMPORTED


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Time a piece of start-up (added up where it runs more than once)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _STAGES[name] = _STAGES.get(name, 0.0) + time.perf_counter() - start


def mark(name: str) -> None:
    """Note when ``name`` first happened, in seconds since the process started."""
    _MARKS.setdefault(name, since_start())


def reset() -> None:
    """Start counting afresh (a command starts: in one process, the CLI's tests run many)."""
    _STAGES.clear()
    _MARKS.clear()


def report() -> dict[str, Any]:
    """``{"stages": {name: seconds}, "since_process_start": {name: seconds}}`` so far."""
    return {"stages": dict(_STAGES), "since_process_start": dict(_MARKS)}
