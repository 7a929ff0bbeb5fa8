"""What a fast backend (``decoder_only.py``, ``encoder_decoder.py``) offers beyond the search's protocols
(``search/protocol.py``: :class:`~seqgen_cli.search.protocol.ModelBackend`, the refill engine's
:class:`~seqgen_cli.search.protocol.RefillBackend`): the static step and the kept states that the capture path runs
it by (``capture.py``, ``kept.py``), the byte counts the batcher and ``--stats`` read, and what ``models/__init__``
reports of it. A backend that runs a fast backend's steps its own way (the capture wrapper) is a
:class:`Wrapper`: :func:`inner_backend` finds the backend whose decoder runs.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from seqgen_cli.search.protocol import Batch, ModelBackend, RefillBackend


class FastState(Protocol):
    """A fast backend's state, as ``lane_table.run_step`` and the capture path drive it."""

    cache: Any  # its caches (``kv_cache.py``): bounds, spans, positions, static addresses
    t: int  # steps fed so far (host counter)


@runtime_checkable
class FastBackend(RefillBackend, Protocol):
    """A fast backend: a search's batch (``start``/``step``/``reorder``/``keep``), the refill engine's lanes
    (``open_lanes``/``join``/``leave``), and the capture path's static step and kept states."""

    model: torch.nn.Module  # the transformers model (or seqgen's own tree) whose weights it runs
    int8: bool  # its linear maps as int8 copies (``--dtype int8``)
    max_position_embeddings: int | None  # the inputs' position limit (graph widths stop there); None: none

    def decode(self, state: Any, tokens: Tensor) -> Tensor:
        """The step's tensor work, static shapes and no host branch (compiled and captured): tokens [N] -> logits
        [N, V]. ``step`` is ``lane_table.run_step`` over it."""
        ...

    def restart(self, state: Any, batch: Batch) -> Tensor | None:
        """The static ``state`` of an earlier batch of this shape takes ``batch`` in place, as ``start`` would
        (its tensors keep their addresses); ``start``'s first logits."""
        ...

    def keep_into(self, state: Any, keep: Tensor, rows: Tensor, into: Any = None) -> Any:
        """Inputs ``keep`` (rows ``rows``) of the static ``state`` copied into ``into`` (a kept state of that many
        inputs; a new one if ``None``); ``state`` is left as it is."""
        ...

    def lane_width(self, state: Any) -> int:
        """The lanes' source (prompt) width: one compiled shape each."""
        ...

    def cache_bytes(self, inputs: int, width: int, rows_per_input: int, new_tokens: int) -> int:
        """Bytes ``start`` allocates for such a batch (the batcher's memory budget, the kept states')."""
        ...

    def cache_nbytes(self, state: Any) -> dict[str, int]:
        """Bytes ``state`` holds, by part (``--stats``)."""
        ...


@runtime_checkable
class Wrapper(Protocol):
    """A backend over a fast backend that runs its steps its own way (``capture.CapturedBackend``)."""

    def unwrap(self) -> FastBackend:
        """The fast backend it wraps: whose decoder runs the steps."""
        ...


def inner_backend(backend: ModelBackend) -> ModelBackend:
    """The backend whose decoder runs ``backend``'s steps: a :class:`Wrapper`'s fast backend, or ``backend``."""
    return backend.unwrap() if isinstance(backend, Wrapper) else backend
