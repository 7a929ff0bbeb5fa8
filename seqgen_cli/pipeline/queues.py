"""The hand-over between the pipeline's threads: a put on a bounded queue that gives up when told to stop."""

from __future__ import annotations

import queue
from collections.abc import Callable

POLL_SECONDS = 0.1


def put_unless(q: queue.Queue, obj: object, stopped: Callable[[], bool]) -> bool:
    """Put ``obj`` on ``q``, waiting while it is full, unless ``stopped()`` (asked before each try); True when
    it was put."""
    while not stopped():
        try:
            q.put(obj, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False
