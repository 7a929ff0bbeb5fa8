"""The host-sync recorder (``tests/search/test_host_sync.py`` and ``tests/models/test_static_step.py`` use it).

On the CPU tensors already live on the host, so :class:`SyncRecorder` detects the *ops* that would
synchronise on a GPU rather than transfers: a ``TorchDispatchMode`` sees every aten op, and ``tolist`` /
``numpy`` / ``cpu`` / ``to("cpu")`` (which never reach the dispatcher for a CPU tensor) are wrapped at the
Python level. Each op is recorded with the loop iteration and the phase it ran in (see search/test_host_sync.py).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqgen_cli.search.processors import LogitsPipeline
from seqgen_cli.search.rows import Rows

aten = torch.ops.aten

# Ops whose result (or output size) the host must read from the device.
SYNC_OPS = frozenset(
    {
        aten._local_scalar_dense,  # .item(), int(t), float(t)
        aten.item,  # .item() as seen under inference mode
        aten.is_nonzero,  # bool(t), `if t:`
        aten.nonzero,  # also torch.where(cond), argwhere
        aten.masked_select,
        aten.equal,
        aten.allclose,
        aten._unique,
        aten._unique2,
        aten.unique_dim,
        aten.unique_consecutive,
        aten.bincount,
        aten.multinomial,  # checks its probabilities with .item() inside ATen on CUDA (search.sampling.draw)
    }
)
BOOL_INDEX_OPS = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
# Functions that run on the CPU only (``beam.pick_topk`` gives ``wide_topk``, and through it ``topk_in_order``, to CPU
# logits alone), where reading a value on the host waits for no device: their reads are not violations.
CPU_ONLY = frozenset({"wide_topk", "topk_in_order", "_topk_of_chunks"})


@dataclass
class Event:
    phase: str  # setup | step | check | finish
    iteration: int  # loop iteration (-1: before the first)
    op: str
    where: str  # innermost frames in seqgen_cli (or the test)

    def __str__(self) -> str:
        return f"iteration {self.iteration} ({self.phase}): {self.op} at {self.where}"


@dataclass
class SyncRecorder(TorchDispatchMode):
    """Records the synchronising ops of one search call, with the iteration and phase they ran in."""

    events: list[Event] = field(default_factory=list)
    checks: list[int] = field(default_factory=list)  # iterations that ran Rows.check
    iteration: int = -1
    phase: str = "setup"

    def __post_init__(self) -> None:
        super().__init__()

    # -- what the instrumented code calls --------------------------------------------------------
    def record(self, op: str) -> None:
        frames = [
            f for f in traceback.extract_stack()[:-2] if "seqgen_cli" in f.filename or "/tests/" in f.filename
        ]
        frames = [f for f in frames if not f.filename.endswith("host_sync.py") or f.name.startswith("inj")]
        where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:3])
        self.events.append(Event(self.phase, self.iteration, op, where))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            self.record(str(func))
        elif packet in BOOL_INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        ):
            self.record(f"{func} with a boolean mask")
        elif packet is aten.lift_fresh and args[0].dim() > 0:
            self.record("torch.tensor(host data): a copy from pageable host memory")
        return func(*args, **kwargs)

    def violations(self) -> list[Event]:
        return [e for e in self.events if e.phase == "step" and e.where.split(" < ")[0].split()[-1] not in CPU_ONLY]

    @property
    def iterations(self) -> int:
        return self.iteration + 1


def _to_host(args: tuple, kwargs: dict) -> bool:
    """``.to("cpu")`` / ``.to(device="cpu")``: a copy to the host. (``.to(x.device)``, device-generic code,
    is not flagged: on a GPU run it stays on the GPU.)"""
    targets = [*args, kwargs.get("device")]
    return any(isinstance(a, str) and a.startswith("cpu") for a in targets)


@contextmanager
def recording(
    backend: Any, first: tuple[Any, str] = (LogitsPipeline, "__call__"), step_name: str = "step"
) -> Iterator[SyncRecorder]:
    """Run the code inside under a :class:`SyncRecorder` that follows the loop through ``backend``'s steps:
    an iteration starts with ``first`` (a class and its method: by default the processors, which run first in
    every iteration) and steps through ``backend.<step_name>``."""
    rec = SyncRecorder()
    owner, method = first
    start, check, remaining = getattr(owner, method), Rows.check, Rows.remaining
    step = getattr(backend, step_name)

    def on_start(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec.iteration += 1
        rec.phase = "step"
        return start(self, *args, **kwargs)

    def on_check(self: Rows, done: torch.Tensor) -> Any:
        rec.phase = "check"
        rec.checks.append(rec.iteration)
        return check(self, done)

    def on_remaining(self: Rows) -> Any:
        rec.phase = "finish"
        return remaining(self)

    def on_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        rec.phase = "step"
        return step(*args, **kwargs)

    def python_level(name: str, original: Callable, to_host_only: bool = False) -> Callable:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not to_host_only or _to_host(args, kwargs):
                rec.record(f"Tensor.{name}")
            return original(self, *args, **kwargs)

        return wrapper

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(owner, method, on_start))
        stack.enter_context(mock.patch.object(Rows, "check", on_check))
        stack.enter_context(mock.patch.object(Rows, "remaining", on_remaining))
        stack.enter_context(mock.patch.object(backend, step_name, on_step))
        for name in ("tolist", "numpy", "cpu"):
            stack.enter_context(
                mock.patch.object(torch.Tensor, name, python_level(name, getattr(torch.Tensor, name)))
            )
        stack.enter_context(
            mock.patch.object(torch.Tensor, "to", python_level("to", torch.Tensor.to, to_host_only=True))
        )
        stack.enter_context(rec)
        yield rec


# The beam settings most host-sync cases start from.
BEAM = dict(
    num_beams=4,
    no_repeat_ngram_size=3,
    min_new_tokens=5,
    max_new_tokens=24,
    length_penalty=2.0,
    early_stopping=True,
)
