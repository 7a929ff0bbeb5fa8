"""What a ``--workers`` driver spends per input, the part that does not scale with workers: reading, parsing, both
digests, cutting into shards (4,096 inputs) and pickling what is shipped to a worker. Prints microseconds and
bytes shipped per input. See docs/EXPERIMENTS.md ("Scale-out on Ray")::

    python scripts/harness/driver_cost.py FILE
"""

import pickle
import sys
import time

from seqgen_cli.pipeline import formats, records, shards, worker

t0, n, nbytes = time.perf_counter(), 0, 0
cutter = shards.Cutter(records.read_records([sys.argv[1]], on_error="skip"), 0, 4096, formats.InputDigest(), 4)
while not cutter.finished:
    if (shard := cutter.take()) is None:
        time.sleep(0.001)
        continue
    nbytes += len(pickle.dumps(worker.ShardTask(shard.name, shard.records)))
    n += len(shard.records)
print(f"{1e6 * (time.perf_counter() - t0) / n:.1f} us/input, {nbytes / n:.0f} bytes/input")
