"""How the ``seqgen`` process stops: SIGTERM (a job scheduler's stop) as Ctrl-C, and an exit that skips the
interpreter's teardown. Light: the command line imports it before anything heavy.

:func:`on_sigterm` is the one SIGTERM handler, for the process and for a run. ``seqgen`` sets it first thing
(:func:`install`, before torch is imported: model loading included); a job's run sets it around itself
(:func:`sigterm_as_interrupt`) for callers that did not. While a command or a run is on, SIGTERM raises
``KeyboardInterrupt``: what is done is written, exit 130. Before a command runs (click still parsing the
arguments, which would turn the interrupt into "Aborted!" and exit 1) nothing is open: the process says so and
exits 130 at once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

_running = False  # a command (or a run) is on: SIGTERM raises KeyboardInterrupt


def on_sigterm(signum: int, frame: object) -> None:
    """The SIGTERM handler: Ctrl-C while a command runs; before one, ``seqgen: interrupted`` and exit 130."""
    if _running:
        raise KeyboardInterrupt
    with contextlib.suppress(OSError):  # stderr closed: the exit status says it
        os.write(2, b"seqgen: interrupted\n")
    os._exit(130)


def install() -> None:
    """For the whole process, from its start: SIGTERM is :func:`on_sigterm`."""
    signal.signal(signal.SIGTERM, on_sigterm)


def command_started() -> None:
    """A command runs: from now on SIGTERM is Ctrl-C (what is done is written, exit 130)."""
    global _running
    _running = True


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Around a run (in the main thread; elsewhere signals cannot be set): SIGTERM is Ctrl-C, then the
    handler and state before it come back."""
    global _running
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old, was = signal.signal(signal.SIGTERM, on_sigterm), _running
    _running = True
    try:
        yield
    finally:
        _running = was
        if old is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGTERM, old)


def exit_now(code: object) -> NoReturn:
    """End the process with the status of ``SystemExit(code)``, skipping the interpreter's teardown.

    Freeing the module graph that torch and transformers leave behind takes 0.7-1.5 s after the last output is
    written (docs/EXPERIMENTS.md, "Start-up"). By then every file is closed; this joins any non-daemon thread,
    flushes stdout and stderr, runs the ``atexit`` handlers (Ray, logging, temporary folders) and ends the
    process with ``os._exit``. Not on CPython: the ordinary exit.
    """
    if code is None or isinstance(code, int):
        status = code or 0
    else:  # sys.exit("message"): printed, status 1, as the interpreter does
        print(code, file=sys.stderr)
        status = 1
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is None:  # not CPython: the ordinary exit
        sys.exit(status)
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with it closed (`>&-`)
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or the reader went away: nothing more can be written
            pass
    run_exitfuncs()
    os._exit(status)
