"""The OpenMP wait policy of the ``seqgen`` process and of an import of ``seqgen_cli`` (load collapse).

torch's CPU wheel runs its intra-op pool, MKL and oneDNN on GNU OpenMP (the bundled ``libgomp``;
``torch.__config__.parallel_info()`` says "ATen parallel backend: OpenMP"). Unset, libgomp's idle threads
spin 300,000 times (a few ms) after each parallel region before they sleep, so every torch thread looks busy
all the time. With another process on one of the cores, the thread that shares it gets no scheduler credit for
its waits, each region's barrier waits for it to be scheduled again, and a decode made of thousands of small
regions runs many times slower (docs/BENCHMARKS.md, "Load"). With ``OMP_WAIT_POLICY=PASSIVE`` idle threads
sleep at once and are woken for the next region, at about the same speed on a quiet box.

OpenMP reads its settings once, when its library loads, i.e. when torch is first imported: importing
``seqgen_cli`` (which the ``seqgen`` process, :func:`seqgen_cli.cli.run`, does first) sets the policy when torch
is not imported yet, so library users (``Generator``) get it too. When torch is already imported it is too late
and nothing is set: such a program sets ``OMP_WAIT_POLICY=PASSIVE`` itself before importing torch.
"""

from __future__ import annotations

from collections.abc import MutableMapping

# A user's own wait setting (standard, GNU, Intel OpenMP) is kept: seqgen then sets nothing.
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def prefer_passive_wait(environ: MutableMapping[str, str]) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` unless any of :data:`WAIT_SETTINGS` is set there.

    Returns whether it set it. Effective only before the OpenMP runtime loads (before ``import torch``).
    """
    if any(name in environ for name in WAIT_SETTINGS):
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
