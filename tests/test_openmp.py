"""An import of ``seqgen_cli`` before torch sets a passive OpenMP wait policy, the ``seqgen`` process a bounded
spin and a thread count that follows the load, unless the user chose a policy or a count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from seqgen_cli import openmp
from seqgen_cli.openmp import (
    MARK,
    SPIN_COUNT,
    WAIT_SETTINGS,
    ThreadGovernor,
    busy_seconds,
    prefer_bounded_spin,
    prefer_passive_wait,
)

REPO = Path(__file__).resolve().parent.parent
# run() with main replaced by a probe: what the command would see, then the process's exit.
PROBE = """
import os, sys
import seqgen_cli.cli as cli
from seqgen_cli import openmp
openmp._read_loadavg = lambda: "0.00 0.00 0.00 1/100 1"  # a quiet box: only this process runs
cli.main = lambda args: print(
    os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules,
    openmp._GOVERNOR is not None,
)
cli.run([])
"""


def _child(code: str, **settings: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in (*WAIT_SETTINGS, MARK, "OMP_NUM_THREADS")}
    env.update(settings, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_unset_becomes_passive() -> None:
    environ: dict[str, str] = {"OMP_NUM_THREADS": "2"}
    assert prefer_passive_wait(environ)
    assert environ == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", MARK: "OMP_WAIT_POLICY"}


def test_the_process_replaces_the_imports_passive_policy_with_a_bounded_spin() -> None:
    environ: dict[str, str] = {}
    assert prefer_passive_wait(environ) and prefer_bounded_spin(environ)
    assert environ == {"GOMP_SPINCOUNT": SPIN_COUNT, MARK: "GOMP_SPINCOUNT"}


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "active"), ("GOMP_SPINCOUNT", "300000"),
                                        ("KMP_BLOCKTIME", "200"), ("OMP_WAIT_POLICY", "")])  # fmt: skip
def test_a_users_setting_is_kept(name: str, value: str) -> None:
    environ = {name: value}
    assert not prefer_passive_wait(environ) and not prefer_bounded_spin(environ)
    assert environ == {name: value}


def _loadavg(*running: int):
    """A ``/proc/loadavg`` reader whose looks see ``running`` running threads in turn (this one included)."""
    looks = iter(running)
    return lambda: f"1.00 1.00 1.00 {next(looks)}/321 4242"


@pytest.mark.parametrize(
    ("cores", "running", "user", "choice"),
    [
        (2, (2, 2, 1, 2, 3), {}, "passive"),  # another running thread on 2 cores (median of the looks)
        (2, (1, 2, 1, 1, 3), {}, "governed"),  # a short-lived one seen twice of five: quiet
        (4, (2, 2, 2, 2, 2), {}, "governed"),  # 1 of 4 cores taken: spin on the 3 free ones
        (4, (3, 3, 3, 3, 3), {}, "passive"),
        (2, (3, 3, 3, 3, 3), {"OMP_WAIT_POLICY": "active"}, "governed"),  # a user's policy stays
        (2, (3, 3, 3, 3, 3), {"OMP_NUM_THREADS": "2"}, "fixed"),  # a user's count stays
    ],
)
def test_the_process_sleeps_its_threads_where_others_fill_half_its_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, running: tuple[int, ...], user: dict[str, str], choice: str
) -> None:
    monkeypatch.setattr(openmp.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(openmp, "_GOVERNOR", None)
    monkeypatch.setattr(openmp, "_CHOICE", None)
    environ = dict(user)
    assert openmp.choose_wait(environ, _loadavg(*running)) == choice
    assert (openmp._GOVERNOR is not None) == (choice == "governed")
    if choice == "passive":
        assert environ == {"OMP_WAIT_POLICY": "PASSIVE", MARK: "OMP_WAIT_POLICY"}
        assert openmp.governor_stats() == {"wait": "passive"}
    elif not user:
        assert environ == {"GOMP_SPINCOUNT": SPIN_COUNT, MARK: "GOMP_SPINCOUNT"}
    else:
        assert all(environ[k] == v for k, v in user.items()) and "OMP_WAIT_POLICY" not in set(environ) - set(
            user
        )


def test_others_running_is_zero_where_loadavg_cannot_be_read() -> None:
    def broken() -> str:
        raise OSError("no /proc")

    assert openmp.others_running(broken) == 0
    assert openmp.others_running(lambda: "garbage") == 0


def test_process_entry_sets_it_before_torch_loads() -> None:
    assert _child(PROBE) == f"None {SPIN_COUNT} False True"
    assert _child(PROBE, OMP_WAIT_POLICY="active") == "active None False True"
    assert _child(PROBE, GOMP_SPINCOUNT="300000") == "None 300000 False True"
    assert _child(PROBE, OMP_NUM_THREADS="2") == f"None {SPIN_COUNT} False False"  # the user's count stays


def test_importing_the_library_prefers_a_passive_wait() -> None:
    code = "import seqgen_cli, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert _child(code) == "PASSIVE"
    assert _child(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert _child(code, KMP_BLOCKTIME="200") == "None"


def test_the_policy_reaches_torch_through_the_generator_import() -> None:
    """``from seqgen_cli.generator import Generator`` (which imports torch) sets it before torch loads."""
    code = "import os; from seqgen_cli.generator import Generator; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert _child(code) == "PASSIVE"


def test_too_late_once_torch_is_imported() -> None:
    """torch first: its OpenMP has read its settings already; nothing is set (see the README)."""
    code = "import os, torch, seqgen_cli; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert _child(code) == "None"


STAT = """cpu  900 0 100 5000 0 0 0 0 0 0
cpu0 100 5 20 1000 7 1 2 3 0 0
cpu1 200 0 30 2000 0 0 0 0 0 0
cpu2 400 0 40 1000 0 0 0 0 0 0
intr 1 2 3
"""


def test_busy_seconds_reads_the_processes_cores_only() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(STAT, {0, 1}) == pytest.approx((100 + 5 + 20 + 1 + 2 + 3 + 200 + 30) / tick)
    assert busy_seconds(STAT, {2}) == pytest.approx(440 / tick)
    assert busy_seconds(_read_proc_stat(), {0}) >= 0  # the real file parses


def _read_proc_stat() -> str:
    return Path("/proc/stat").read_text() if Path("/proc/stat").exists() else STAT


class FakeCores:
    """Two cores: each look, the process used ``own`` cores and others ``others`` over ``dt`` seconds."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.counts: list[int] = []

    def advance(self, dt: float, own: float, others: float) -> None:
        self.now += dt
        self.own += own * dt
        self.busy += (own + others) * dt

    def governor(self) -> ThreadGovernor:
        tick = os.sysconf("SC_CLK_TCK")
        stat = lambda: f"cpu0 {round(self.busy * tick)} 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0\n"  # noqa: E731
        return ThreadGovernor(
            2, {0, 1}, self.counts.append, interval=0.5, read_stat=stat, clock=lambda: self.now,
            cpu_time=lambda: self.own,
        )  # fmt: skip


def test_the_thread_count_follows_the_free_cores() -> None:
    cores = FakeCores()
    g = cores.governor()
    g.tick()  # first look: nothing to compare with
    for own, others in [(2, 0), (2, 0)]:  # quiet: both cores stay
        cores.advance(0.5, own, others)
        g.tick()
    assert cores.counts == [] and g.threads == 2
    cores.advance(0.1, 1.3, 0.7)  # before the interval: no look
    g.tick()
    assert cores.counts == []
    cores.advance(0.5, 1.3, 0.7)  # a busy process arrives: at once one thread, on the free core
    g.tick()
    assert cores.counts == [1] and g.threads == 1
    cores.advance(0.5, 1.0, 1.0)
    g.tick()
    cores.advance(0.5, 1.0, 0.05)  # it leaves: one look is not enough to go back up
    g.tick()
    assert cores.counts == [1]
    cores.advance(0.5, 1.0, 0.05)  # the second look agrees: both cores
    g.tick()
    assert cores.counts == [1, 2] and g.changes == 2
    cores.advance(0.5, 1.6, 0.6)  # others at 0.6 cores: 1.4 free rounds to one thread
    g.tick()
    assert cores.counts == [1, 2, 1]


def test_no_proc_stat_leaves_the_count(tmp_path: Path) -> None:
    def missing() -> str:
        raise OSError("no /proc")

    counts: list[int] = []
    g = ThreadGovernor(2, {0, 1}, counts.append, interval=0.0, read_stat=missing)
    for _ in range(3):
        g.tick()
    assert counts == [] and g.threads == 2


def test_the_decode_loop_ticks_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The governor can only act where torch runs: the decode loop ticks once per step."""
    from seqgen_cli.config import resolve_generation_config
    from seqgen_cli.models import get_backend
    from seqgen_cli.search import generate
    from tests.tiny_models import cached_build, load, text_batch

    ticks: list[int] = []

    class Counting:
        limit = 1

        def tick(self) -> None:
            ticks.append(1)

    monkeypatch.setattr(openmp, "_GOVERNOR", Counting())
    loaded = load(cached_build("bart"))
    config = resolve_generation_config(
        loaded.model.generation_config, None, dict(num_beams=2, min_new_tokens=6, max_new_tokens=6)
    )
    generate(get_backend(loaded.model), text_batch(loaded, 2), config)
    assert (
        len(ticks) == 5
    )  # 6 tokens: the first from start_rows' step, a backend step for each of the other 5
