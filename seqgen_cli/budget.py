"""The device memory budget that batches and the capture path's kept states are held to: on the ground floor, as
the generator, its batcher and the kept-state pool of ``models/`` all read it (it reads only the device).

The budget has one owner, :class:`DeviceBudget`: what a batch may hold (``limit``) and what the run holds
against it for later batches (``held``: the capture path's kept states), asked by the batcher
(:meth:`DeviceBudget.memory_limit`, over ``Generator.batch_bytes``) and by the kept-state pool
(:meth:`DeviceBudget.fits`, ``models/kept.py``) alike. On CUDA ``limit`` is the free memory
(:func:`free_memory_budget`), read when the model is loaded and again by :meth:`DeviceBudget.after` after the first
batch of each new ``(inputs, width)`` shape has run, and after a batch that set up something that outlives it (a
kept state allocated, a shape compiled: by default a shape's first batches run uncompiled): one
``torch.cuda.mem_get_info`` per such batch, never per step. Elsewhere there is no budget.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqgen_cli.batching import Item, MemoryLimit
from seqgen_cli.shapes import input_width

HEADROOM = 0.25  # of the free memory: left to fragmentation, other processes, an eager step (uncounted)


def device_memory(device: torch.device) -> int | None:
    """The memory of ``device`` in bytes: the GPU's, or the machine's for the CPU; ``None`` where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def out_of_memory(need: int | None, new_tokens: int, device: torch.device) -> str:
    """Why one input ran out of memory alone: where its caches and logits at the new-token limit (``need``
    bytes) take more than ``device`` has, that limit is named (T5's relative positions set none, so
    ``--max-new-tokens 2147483647`` passes every check), else plain "out of memory"."""
    total = device_memory(device)
    if need is None or total is None or need <= total:
        return "out of memory"
    return (
        f"out of memory: one input's caches for up to {new_tokens} new tokens (--max-new-tokens / --max-length) "
        f"take {need / 2**30:,.1f} GiB, more than the {total / 2**30:,.1f} GiB of {device}"
    )


def free_memory_budget(device: Any, held: int = 0) -> int | None:
    """The default memory budget: on CUDA the free memory (the driver's free, plus what torch's allocator
    holds unused, plus ``held``: bytes it holds for state a later batch reuses or releases) less
    :data:`HEADROOM`; ``None`` (no limit) elsewhere."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int((free + unused + held) * (1 - HEADROOM))


class DeviceBudget:
    """The device memory budget (module docstring): ``limit``, the bytes a batch may hold (``None``: no limit;
    ``Generator.memory_budget`` reads and sets it), and ``held``, the bytes held against it for later batches (the
    kept states', counted back in when the budget is read: a later batch refills or releases them)."""

    def __init__(self, device: torch.device, limit: int | None = None) -> None:
        self.device, self.limit = device, limit
        self.held = 0  # bytes held for later batches (the kept states of models/kept.py)
        self.set_ups = 0  # things set up that outlive a batch: kept states allocated, shapes compiled
        self.shapes: set[tuple[int, int]] = set()  # batch shapes run, the budget read after each
        self.reads = 0
        self._read_at = 0  # set_ups at the last read

    @classmethod
    def read(cls, device: torch.device) -> DeviceBudget:
        """``device``'s budget now (:func:`free_memory_budget`: on CUDA the free memory; elsewhere none)."""
        return cls(device, free_memory_budget(device))

    def hold(self, nbytes: int) -> None:
        """``nbytes`` more are held for later batches (negative: released)."""
        self.held += nbytes

    def set_up(self) -> None:
        """Something that outlives its batch was set up (a kept state allocated, a shape compiled: a graph pool):
        :meth:`after` reads the budget again."""
        self.set_ups += 1

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit beside what is held (the kept-state pool asks before it keeps another)."""
        return self.limit is None or self.held + nbytes <= self.limit

    def memory_limit(self, cost: Callable[[int, int], int | None]) -> MemoryLimit | None:
        """The batcher's limit: :attr:`limit` as each batch is cut (read again as shapes run) over ``cost``
        (``Generator.batch_bytes``); ``None`` without a limit or where ``cost`` cannot say."""
        if self.limit is None or cost(1, 1) is None:
            return None
        return MemoryLimit(lambda: self.limit, cost)  # type: ignore[arg-type]: cost is checked above

    def after(self, items: Sequence[Item]) -> int | None:
        """The limit after ``items`` ran as a batch: read again (CUDA) if its ``(inputs, width)`` shape is new or
        something was set up since the last read."""
        if self.device.type != "cuda" or not items:
            return self.limit
        shape = (len(items), input_width(max(len(it.ids or ()) for it in items)))
        if shape in self.shapes and self.set_ups == self._read_at:
            return self.limit
        self.shapes.add(shape)
        self._read_at = self.set_ups
        self.reads += 1
        self.limit = free_memory_budget(self.device, self.held)
        return self.limit
