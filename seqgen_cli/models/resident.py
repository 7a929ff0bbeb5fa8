"""Hand back the resident pages of checkpoint weights that a backend has replaced (``--dtype int8``, fused maps).

transformers maps a checkpoint's safetensors files into memory (private file mappings) and leaves its weights
there: a weight's pages become resident when first read, and stay for as long as the mapping lives, which is as
long as any weight of the file does (the embedding, the norms). A backend that reads a float32 weight once to make
its own copy (an int8 copy, a fused q|k|v matrix) would otherwise hold both: NLLB-600M's int8 run kept all 2.3 GB of
float32 pages beside its int8 maps. :func:`release` gives such pages back (``madvise(MADV_DONTNEED)``); a later
read of them (the embedding's rows, the model's own modules under ``--backend hf``) faults them in again from the
file, with the same values.

Safe by construction, whatever the tensor: only whole pages inside the tensor that ``/proc/self/pagemap`` says are
file pages or shared memory (bit 61) are dropped, and nothing is done if any of its pages is private anonymous
memory (resident or swapped: a page written after the mapping, or a tensor of torch's own allocator), whose
contents ``MADV_DONTNEED`` would discard. A file changed on disk meanwhile is seen as it would be without this
(Linux maps the page cache's pages privately until written). Elsewhere than Linux, or where ``pagemap`` cannot be
read, nothing is released.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

import numpy as np
import torch

MADV_DONTNEED = 4  # Linux
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PRESENT, SWAPPED, FILE_OR_SHARED = 63, 62, 61  # pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst)

_madvise = None


def _libc_madvise():  # noqa: ANN202 - a ctypes function
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise = libc.madvise
    return _madvise


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The whole pages inside the bytes ``t`` spans: [start, stop) addresses, page-aligned inwards."""
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1 if t.numel() else 0
    first = t.data_ptr()
    last = first + reach * t.element_size()
    return -(-first // PAGE) * PAGE, last // PAGE * PAGE


def _only_file_pages(pagemap: int, start: int, stop: int) -> bool:
    """Whether no page in [start, stop) is private anonymous memory (resident or swapped)."""
    entries = np.frombuffer(os.pread(pagemap, (stop - start) // PAGE * 8, start // PAGE * 8), dtype=np.uint64)
    anonymous = (entries >> PRESENT | entries >> SWAPPED) & ~(entries >> FILE_OR_SHARED) & 1
    return not anonymous.any()


def release(tensors: Iterable[torch.Tensor | None]) -> int:
    """Drop the file pages of ``tensors`` (CPU) from this process's resident memory (module docstring); the
    tensors stay valid. Returns the bytes dropped."""
    spans = []
    for t in tensors:
        if t is None or t.device.type != "cpu" or t.layout != torch.strided:
            continue  # another device, a sparse or other layout: no plain range of memory
        start, stop = _span(t)
        if stop > start:
            spans.append((start, stop))
    if not spans or not os.path.exists("/proc/self/pagemap"):
        return 0
    dropped = 0
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return 0
    try:
        madvise = _libc_madvise()
        for start, stop in spans:
            if _only_file_pages(pagemap, start, stop) and madvise(start, stop - start, MADV_DONTNEED) == 0:
                dropped += stop - start
    except (OSError, AttributeError):  # no madvise in this libc, an unreadable pagemap: keep the pages
        return dropped
    finally:
        os.close(pagemap)
    return dropped
