"""The stages of ``scripts/harness/gpu_bench.py`` (its docstring says what each measures; it parses the options, runs
the stages in order and writes the report):

* :mod:`.base`: what the stages share: device syncs and peak memory, models and inputs on the device, the
  ``--batches`` plan, the ``--budget`` and the loop that runs a table's cells;
* :mod:`.checks`: ``env``, ``equiv`` (the float32 equivalence harness on the device), ``sync`` (the host-sync
  audit) and ``cli`` (``Generator`` and ``seqgen generate`` on the device);
* :mod:`.tables`: the ``bart`` and ``gpt2`` tables, seqgen against ``generate()``;
* :mod:`.refill`: ``Generator(refill=True)`` against ``refill=False``.

The refill workload (EOS-biased checkpoint, batching as the CLI does, step counts) and interleaved timing come
from ``scripts/harness/_common.py``; imported with ``scripts/harness/`` on the import path, as ``gpu_bench.py`` sets it.
"""
