"""The exception types users see: printed as a single line, non-zero exit, no traceback."""

from __future__ import annotations

import os


class SeqgenError(Exception):
    """A user-facing error; ``str(err)`` is the whole message (name the file, line and problem)."""

    exit_code = 2


class WriteError(SeqgenError):
    """Writing an output file, or its index, journal or manifest, failed: disk full, no permission, I/O."""

    exit_code = 1

    @classmethod
    def of(cls, err: OSError, path: str | os.PathLike[str]) -> WriteError:
        """``no space left on device writing PATH`` (the OS's reason, then the file)."""
        reason = err.strerror or str(err)
        return cls(f"{reason[:1].lower()}{reason[1:]} writing {os.fspath(path)}")


class Aborted(SeqgenError):
    """A run stopped by something other than its input (a write error, memory, a bug): says where its
    outputs are and how to go on."""

    exit_code = 1


OOM_MESSAGES = (
    "out of memory",  # CUDA's allocator and "CUDA error: out of memory", MPS
    "can't allocate memory",  # the CPU allocator (DefaultCPUAllocator) on Linux
    "not enough memory",  # the CPU allocator in older torch ("... Buy new RAM!")
    "status_alloc_failed",  # cuBLAS / cuDNN workspace or handle allocation
)


def is_oom(err: BaseException) -> bool:
    """Out of memory on the device or the host: ``MemoryError``, ``torch.OutOfMemoryError``, or a
    ``RuntimeError`` carrying one of the allocators' messages (:data:`OOM_MESSAGES`)."""
    if isinstance(err, MemoryError):
        return True
    try:
        import torch

        if isinstance(err, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    message = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in message for m in OOM_MESSAGES)


def one_line(text: str) -> str:
    """``text`` as one line of a terminal: a newline, tab or other control character inside it (a file name can
    hold one) written as its escape (``\\n``), so a message stays the one line it is meant to be."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
