"""seqgen: fast, exact batch text generation for Hugging Face checkpoints.

Importing it makes idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``) unless the
user chose a wait policy or torch is already imported (:mod:`seqgen_cli.openmp`): on a machine shared with
other work, torch's spinning threads make generation many times slower (docs/EXPERIMENTS.md, "Load").
"""

import os
import sys
import time

from seqgen_cli.openmp import prefer_passive_wait

__version__ = "0.1.0"

# When the package was first imported: the `seqgen` process's start, near enough (the closing line's whole time).
STARTED = time.perf_counter()

if "torch" not in sys.modules:  # OpenMP reads its settings once, when torch loads it: after that, too late
    prefer_passive_wait(os.environ)
