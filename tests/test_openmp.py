"""The ``seqgen`` process, and an import of ``seqgen_cli`` before torch, set a passive OpenMP wait policy before
torch loads, unless the user chose one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from seqgen_cli.openmp import WAIT_SETTINGS, prefer_passive_wait

REPO = Path(__file__).resolve().parent.parent
# run() with main replaced by a probe: what the command would see, then the process's exit.
PROBE = """
import os, sys
import seqgen_cli.cli as cli
cli.main = lambda args: print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
cli.run([])
"""


def _child(code: str, **settings: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_SETTINGS}
    env.update(settings, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_unset_becomes_passive() -> None:
    environ: dict[str, str] = {"OMP_NUM_THREADS": "2"}
    assert prefer_passive_wait(environ)
    assert environ == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "active"), ("GOMP_SPINCOUNT", "300000"),
                                        ("KMP_BLOCKTIME", "200"), ("OMP_WAIT_POLICY", "")])  # fmt: skip
def test_a_users_setting_is_kept(name: str, value: str) -> None:
    environ = {name: value}
    assert not prefer_passive_wait(environ)
    assert environ == {name: value}


def test_process_entry_sets_it_before_torch_loads() -> None:
    assert _child(PROBE) == "PASSIVE False"
    assert _child(PROBE, OMP_WAIT_POLICY="active") == "active False"
    assert _child(PROBE, GOMP_SPINCOUNT="300000") == "None False"


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
