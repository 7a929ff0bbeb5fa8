"""What checking cached int8 weights against the float32 ones costs (``int8_cache._agrees``): a warm start's
``Generator._quantize`` with the check (timed) and with every cached weight passed unchecked. See
docs/EXPERIMENTS.md ("int8 weight cache")::

    export SEQGEN_CACHE=/tmp/check-cache; rm -rf $SEQGEN_CACHE
    python scripts/experiments/bench_int8_check.py /tmp/bench-models/bart-base check    # cold: quantizes and fills the cache
    for r in 1 2 3; do for arm in check none; do python scripts/experiments/bench_int8_check.py /tmp/bench-models/bart-base $arm; done; done
"""

from __future__ import annotations

import sys
import time

from seqgen_cli.generator import Generator
from seqgen_cli.models import int8_cache

model, arm = sys.argv[1:]  # arm: "check" (as shipped, timed) or "none" (every cached weight passes unchecked)
spent, agrees, quantize = [0.0], int8_cache._agrees, Generator._quantize


def timed_agrees(*args):
    t0 = time.perf_counter()
    ok = agrees(*args)
    spent[0] += time.perf_counter() - t0
    return ok


def timed_quantize(self):
    t0 = time.perf_counter()
    quantize(self)
    print(f"{arm} _quantize {time.perf_counter() - t0:.3f} s, check {1000 * spent[0]:.1f} ms")


int8_cache._agrees = timed_agrees if arm == "check" else (lambda *args: True)
Generator._quantize = timed_quantize
Generator(model, dtype="int8")
