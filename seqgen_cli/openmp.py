"""The OpenMP wait policy and thread count of the ``seqgen`` process and of an import of ``seqgen_cli``.

torch's CPU wheel runs its intra-op pool, MKL and oneDNN on GNU OpenMP (the bundled ``libgomp``;
``torch.__config__.parallel_info()`` says "ATen parallel backend: OpenMP"). A decode step is hundreds of small
parallel regions, and between two regions an idle thread either spins (quick to start the next region, but
busy all the time) or sleeps (woken by a futex for the next region: ~25 % slower on a quiet box). With another
process on one of the cores, a spinning team loses: the thread that shares a core gets no scheduler credit for
its waits, and each region's barrier waits for it to be scheduled again (docs/EXPERIMENTS.md, "Load").

OpenMP reads its wait settings once, when torch first loads it, so they cannot follow the load; the thread count
can. Two settings, then:

* Importing ``seqgen_cli`` (library use: ``Generator``) before torch sets ``OMP_WAIT_POLICY=PASSIVE``: safe
  everywhere, and the thread count stays the program's.
* The ``seqgen`` process (:func:`seqgen_cli.cli.run`, :func:`choose_wait`) looks at the cores when it starts.
  Where other processes run on at least half of them, it sets the passive policy and keeps every thread: a team
  that sleeps between regions takes its share of the shared cores (on 2 cores beside one busy process, 2
  passive threads decode 1.2× faster than 1 thread on the free core; docs/EXPERIMENTS.md, "Load"). Otherwise it
  bounds the spin (:data:`SPIN_COUNT`, ~tens of microseconds) and runs a :class:`ThreadGovernor`: every
  :data:`INTERVAL` seconds of decoding it reads how much of its cores other processes used (``/proc/stat``
  against its own CPU time) and runs torch on the cores left free, so spinning threads never share a core with
  another process for longer than that.

A user's own wait setting (:data:`WAIT_SETTINGS`) is kept, and ``OMP_NUM_THREADS`` fixes the thread count.
When torch is already imported it is too late to set a policy, and nothing is set.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, MutableMapping

# A user's own wait setting (standard, GNU, Intel OpenMP) is kept: seqgen then sets nothing.
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPIN_COUNT = "20000"  # libgomp's spins before an idle thread sleeps (its default: 300,000, a few ms)
INTERVAL = 0.25  # seconds between two looks at the cores' load
MARK = "SEQGEN_OMP_SET"  # names the wait setting seqgen made (replaced by the next choice, never a user's)


def prefer_passive_wait(environ: MutableMapping[str, str]) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` unless a user set any of :data:`WAIT_SETTINGS`.

    Returns whether it set it. Effective only before the OpenMP runtime loads (before ``import torch``).
    """
    return _set_wait(environ, "OMP_WAIT_POLICY", "PASSIVE")


def prefer_bounded_spin(environ: MutableMapping[str, str]) -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` in ``environ`` unless a user set a wait setting (the
    passive policy set by importing the package is replaced). For a process whose thread count follows the
    load (:class:`ThreadGovernor`). Returns whether it set it."""
    return _set_wait(environ, "GOMP_SPINCOUNT", SPIN_COUNT)


def _users_wait(environ: MutableMapping[str, str]) -> bool:
    """Whether a user set any of :data:`WAIT_SETTINGS` (not the one seqgen made, named by :data:`MARK` in the
    environment, which a child process sees too)."""
    return any(key in environ and key != environ.get(MARK) for key in WAIT_SETTINGS)


def _set_wait(environ: MutableMapping[str, str], name: str, value: str) -> bool:
    if _users_wait(environ):
        return False
    environ.pop(environ.get(MARK, ""), None)
    environ[name], environ[MARK] = value, name
    return True


def choose_wait(environ: MutableMapping[str, str], read_loadavg: Callable[[], str] | None = None) -> str:
    """The ``seqgen`` process's setting, before torch loads: ``"passive"`` (:func:`prefer_passive_wait`, every
    thread) where other processes' running threads (:func:`others_running`) fill at least half of this process's
    cores, else a bounded spin (:func:`prefer_bounded_spin`) with a :class:`ThreadGovernor` (``"governed"``;
    ``"fixed"`` where ``OMP_NUM_THREADS`` fixes the count). A user's wait setting or thread count is never
    replaced, and with either no passive policy is chosen."""
    global _CHOICE
    user = _users_wait(environ) or "OMP_NUM_THREADS" in environ
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not user and 2 * others_running(read_loadavg or _read_loadavg) >= cores:
        prefer_passive_wait(environ)
        _CHOICE = "passive"
    else:
        prefer_bounded_spin(environ)
        _CHOICE = "governed" if govern_threads(environ) else "fixed"
    return _CHOICE


def others_running(read_loadavg: Callable[[], str], looks: int = 5, pause: float = 0.002) -> int:
    """Threads of other processes running or ready to run now: ``/proc/loadavg``'s running count (its fourth
    field, ``running/total``) less this thread, the median of ``looks`` looks ``pause`` seconds apart (a
    snapshot each, so short-lived work seldom counts); 0 where it cannot be read."""
    counts = []
    for i in range(looks):
        try:
            counts.append(int(read_loadavg().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return 0
        if i + 1 < looks:
            time.sleep(pause)
    return max(0, sorted(counts)[len(counts) // 2])


def _read_loadavg() -> str:
    with open("/proc/loadavg", encoding="ascii") as f:
        return f.read()


def busy_seconds(stat: str, cpus: Collection[int]) -> float:
    """CPU seconds ``cpus`` spent busy since boot (user, nice, system, irq, softirq, steal), from the text of
    ``/proc/stat`` (its ``cpuN`` lines, in clock ticks)."""
    ticks = 0
    for line in stat.splitlines():
        name, _, fields = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields.split()]
            ticks += sum(values[:3]) + sum(values[5:8])  # user nice system | idle iowait | irq softirq steal
    return ticks / os.sysconf("SC_CLK_TCK")


def _read_stat() -> str:
    with open("/proc/stat", encoding="ascii") as f:
        return f.read()


class ThreadGovernor:
    """torch's intra-op thread count from the cores other processes leave free.

    :meth:`tick` is called by the decode loop on the thread that runs torch (the count is that thread's): at
    most every ``interval`` seconds it compares the busy time of the process's cores with its own CPU time;
    what others used, in cores, leaves ``free = cores - others``, and the count becomes ``round(free)`` (at
    least 1, at most ``threads``): fewer at once (spinning threads beside another process lose most), more once
    two looks in a row agree."""

    def __init__(
        self,
        threads: int,
        cpus: Collection[int],
        set_threads: Callable[[int], None],
        *,
        interval: float = INTERVAL,
        read_stat: Callable[[], str] = _read_stat,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
    ) -> None:
        self.limit, self.cpus, self.set_threads = threads, frozenset(cpus), set_threads
        self.interval, self.read_stat, self.clock, self.cpu_time = interval, read_stat, clock, cpu_time
        self.threads = threads  # the count in force
        self.changes = 0  # how often it changed
        self._last: tuple[float, float, float] | None = None  # (clock, busy seconds, own CPU seconds)
        self._want: int | None = None  # the previous look's count
        self._due = 0.0

    def tick(self) -> None:
        now = self.clock()
        if now < self._due:
            return
        self._due = now + self.interval
        try:
            sample = (now, busy_seconds(self.read_stat(), self.cpus), self.cpu_time())
        except (OSError, ValueError):  # no /proc (not Linux): the count stays
            return
        last, self._last = self._last, sample
        if last is None or sample[0] <= last[0]:
            return
        others = max(0.0, (sample[1] - last[1]) - (sample[2] - last[2])) / (sample[0] - last[0])
        want = max(1, min(self.limit, round(len(self.cpus) - others)))
        if want < self.threads or (want > self.threads and want == self._want):
            self.set_threads(want)
            self.threads = want
            self.changes += 1
        self._want = want


_GOVERNOR: ThreadGovernor | None = None
_CHOICE: str | None = None  # what choose_wait chose, for --stats


def govern_threads(environ: MutableMapping[str, str]) -> bool:
    """Install the process's :class:`ThreadGovernor` (started by the first :func:`tick`) unless
    ``OMP_NUM_THREADS`` fixes the count or this is not Linux. Returns whether it did."""
    global _GOVERNOR
    if (
        "OMP_NUM_THREADS" in environ
        or not os.path.exists("/proc/stat")
        or not hasattr(os, "sched_getaffinity")
    ):
        return False

    def set_threads(n: int) -> None:
        import torch

        torch.set_num_threads(n)

    _GOVERNOR = ThreadGovernor(0, os.sched_getaffinity(0), set_threads)
    _GOVERNOR.tick()  # the first look: the next one, in the decode loop, sees the load since the start
    return True


def tick() -> None:
    """A decode step is done (the loop's host check): the governor, if any, may look at the load now."""
    governor = _GOVERNOR
    if governor is None:
        return
    if governor.limit == 0:  # first tick: the count torch chose (or the CLI set) is the ceiling
        import torch

        governor.limit = governor.threads = torch.get_num_threads()
    governor.tick()


def governor_stats() -> dict[str, int | str] | None:
    """``--stats``: the governor's thread count now and its changes; ``{"wait": "passive"}`` where
    :func:`choose_wait` chose sleeping threads; ``None`` without either."""
    g = _GOVERNOR
    if _CHOICE == "passive":
        return {"wait": "passive"}
    return (
        None
        if g is None or g.limit == 0
        else {"threads": g.threads, "max_threads": g.limit, "changes": g.changes}
    )
