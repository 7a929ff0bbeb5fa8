"""A graph-capturable decode step (issue 10) and the capture path.

The fast backends' step has three parts; only the middle one touches the model, and it has static shapes:

    state.cache.check(state.t)                host: ValueError past the slots allocated by start()
    logits = backend.decode(state, tokens)    tensors only: the part that is compiled and captured
    state.t += 1; state.cache.advance()       host counter; the device slot tensor moves on (queued)

``decode`` reads the step's slot from a device tensor (``cache.slot``), writes the caches with
``index_copy_``, attends over all preallocated slots under a mask built from tensors and never branches on the
step number (``models/kv_cache.py``), so one compiled graph serves every step of a batch shape.

:class:`CapturedBackend` (CUDA, ``--capture``, the default there) runs ``decode`` through
``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)``: a CUDA graph per batch shape,
replayed every step. Shapes are bounded: inputs are padded to a power-of-two number of *slots* (copies of the
last input; their rows run idle), sources (or prompts) to a multiple of ``WIDTH`` tokens and the new-token
slots to a multiple of ``SLOTS``; finished inputs idle in their slot, and the rows are compacted only when
they fit a smaller power of two. At most ``MAX_SHAPES`` shapes are compiled; later ones run ``decode``
eagerly. A compile error (or a first run that fails) falls back to eager for good, with the reason in
:attr:`CapturedBackend.path` (``--stats``: ``step_path``). Everything else (CPU, ``--no-capture``, the
generic backend) runs the plain backend: :func:`capture` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.models.kv_cache import check_slot
from seqgen_cli.search.protocol import Batch, ModelBackend

Decode = Callable[[Any, Tensor], Tensor]  # (backend state, tokens [N]) -> logits [N, V]

WIDTH = 64  # source / prompt lengths are padded to a multiple of this
SLOTS = 64  # new-token slots are allocated in multiples of this
MAX_SHAPES = 8  # batch shapes compiled at most (torch._dynamo's default recompile limit); then eager


def static_step(decode: Decode, state: Any, tokens: Tensor) -> Tensor:
    """One step of a static-step backend: ``decode`` (eager or compiled) between the host bookkeeping.

    ``state`` has ``t`` (host step counter) and ``cache`` (``check(t)``, ``advance()``); tokens [N] ->
    logits [N, V]."""
    state.cache.check(state.t)
    logits = decode(state, tokens)
    state.t += 1
    state.cache.advance()
    return logits


def compile_decode(decode: Decode) -> Decode:
    """CUDA graphs through ``torch.compile``: one graph per shape, replayed (static caches, see above)."""
    return torch.compile(decode, mode="reduce-overhead", fullgraph=True, dynamic=False)


def capture(
    backend: ModelBackend,
    device: torch.device,
    enabled: bool,
    compiler: Callable[[Decode], Decode] = compile_decode,
) -> tuple[ModelBackend, str]:
    """The backend to run and its step path: ``(CapturedBackend, "captured")`` where the step can be captured,
    else ``(backend, "eager (<reason>)")``."""
    if not enabled:
        reason = "--no-capture"
    elif device.type != "cuda":
        reason = f"{device.type}: no CUDA graphs"
    elif not hasattr(backend, "decode"):
        reason = f"{type(backend).__name__} has no static step"
    else:
        return CapturedBackend(backend, compiler), "captured"
    return backend, f"eager ({reason})"


def bucket(n: int) -> int:
    """The smallest power of two >= ``n``."""
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tensors_of(obj: Any, seen: set[int] | None = None) -> Iterator[Tensor]:
    """Every tensor a backend or its state holds (attributes, lists, ``partial`` arguments, nested objects;
    not inside ``nn.Module``s, whose parameters torch.compile already treats as static), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from tensors_of(item, seen)
    elif isinstance(obj, partial):
        yield from tensors_of([*obj.args, *obj.keywords.values()], seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module | type):
        for value in vars(obj).values():
            yield from tensors_of(value, seen)


def mark_static(obj: Any) -> None:
    """The tensors of a backend (fused weights) or its state keep their addresses while a graph replays
    (reorder is in place): CUDA graphs read them where they are instead of copying them in every replay. A new
    address (next batch, compaction) re-records the graph (torch's limit: 128 re-records per function)."""
    for t in tensors_of(obj):
        torch._dynamo.mark_static_address(t)


def pad_batch(batch: Batch, inputs: int, width: int, left: bool) -> Batch:
    """``batch`` [B, S] padded to ``inputs`` rows (copies of the last input) and ``width`` columns (masked;
    on the left for decoder-only prompts, on the right for sources)."""
    ids, mask = batch.input_ids, batch.attention_mask
    b, s = ids.shape
    ids = torch.cat([ids, ids[-1:].expand(inputs - b, s)])  # [inputs, S]
    mask = torch.cat([mask, mask[-1:].expand(inputs - b, s)])
    pad = ids.new_zeros(inputs, width - s)  # [inputs, width - S]: token 0, masked
    ids = torch.cat([pad, ids] if left else [ids, pad], dim=1)  # [inputs, width]
    mask = torch.cat([pad, mask] if left else [mask, pad], dim=1)
    return Batch(ids, mask)


@dataclass
class CapturedState:
    """A call on :class:`CapturedBackend`: the backend's state over the padded batch, and where the running
    rows are in it."""

    inner: Any  # the wrapped backend's state (physical slots)
    rows_per_input: int
    inputs: Tensor  # [B] int64: physical slot of each running input
    rows: Tensor  # [B * R] int64: physical row of each running row
    tokens: Tensor  # [P * R] int64: the step's input tokens for every physical row (idle rows: stale ones)
    limit: int  # steps the search may run (slots are rounded up)
    shape: tuple[int, ...]  # (physical rows, padded width, slots): one compiled graph each


class CapturedBackend:
    """:class:`~seqgen_cli.search.protocol.ModelBackend` over a static-step backend with ``decode`` compiled
    (see the module docstring). ``path``: ``"captured"``, or how it fell back to eager."""

    def __init__(self, backend: Any, compiler: Callable[[Decode], Decode] = compile_decode) -> None:
        self.backend = backend
        self.is_encoder_decoder = backend.is_encoder_decoder
        self.vocab_size = backend.vocab_size
        self.max_position_embeddings = getattr(backend, "max_position_embeddings", None)
        mark_static(backend)
        self.compiled: Decode | None = compiler(backend.decode)
        self.shapes: set[tuple[int, ...]] = set()  # shapes compiled so far
        self.path = "captured"

    @torch.inference_mode()
    def start(
        self, batch: Batch, rows_per_input: int, max_new_tokens: int
    ) -> tuple[CapturedState, Tensor | None]:
        b, s = batch.input_ids.shape
        r, slots = rows_per_input, round_up(max(1, max_new_tokens), SLOTS)
        padded = pad_batch(batch, bucket(b), round_up(s, WIDTH), left=not self.is_encoder_decoder)
        inner, first = self.backend.start(padded, r, slots)
        inner.cache.make_static()  # all T slots: the default on CUDA, and on the CPU too under this class
        mark_static(inner)
        device = batch.input_ids.device
        state = CapturedState(
            inner,
            r,
            inputs=torch.arange(b, device=device),
            rows=torch.arange(b * r, device=device),
            tokens=torch.zeros(bucket(b) * r, dtype=torch.long, device=device),
            limit=max(1, max_new_tokens),
            shape=(bucket(b) * r, padded.input_ids.shape[1], slots),
        )
        return state, None if first is None else first[:b]  # [B, V]

    @torch.inference_mode()
    def step(self, state: CapturedState, tokens: Tensor) -> Tensor:
        check_slot(state.inner.t, state.limit)
        state.tokens.index_copy_(0, state.rows, tokens)
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be overwritten
        logits = static_step(self._decoder(state.shape), state.inner, state.tokens)  # [P * R, V]
        return logits.index_select(0, state.rows)  # [N, V], a copy: the graph's output is overwritten

    def _decoder(self, shape: tuple[int, ...]) -> Decode:
        """The compiled ``decode`` for a shape already compiled; for a new one, a first call that falls back
        to eager on a compile error; eager once ``MAX_SHAPES`` are compiled or after a failure."""
        compiled = self.compiled
        if compiled is None or shape in self.shapes:
            return compiled or self.backend.decode
        if len(self.shapes) >= MAX_SHAPES:
            self.path = f"captured ({MAX_SHAPES} shapes; eager beyond)"
            return self.backend.decode

        def first_call(state: Any, tokens: Tensor) -> Tensor:
            try:  # past torch's recompile limit (shapes of all instances): an error, not a silent eager run
                with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                    logits = compiled(state, tokens)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as err:  # noqa: BLE001 - any compile/capture failure: eager, with the reason
                self.compiled = None
                self.path = f"eager ({type(err).__name__}: {str(err).strip().splitlines()[0][:200]})"
                return self.backend.decode(state, tokens)  # decode is idempotent: same slot, same values
            self.shapes.add(shape)
            return logits

        return first_call

    @torch.inference_mode()
    def reorder(self, state: CapturedState, rows: Tensor) -> None:
        """Physical row ``state.rows[i]`` continues ``state.rows[rows[i]]``; idle rows continue themselves."""
        n = state.tokens.shape[0]
        physical = torch.arange(n, device=rows.device).index_copy_(
            0, state.rows, state.rows.index_select(0, rows)
        )  # [P * R]
        self.backend.reorder(state.inner, physical)

    @torch.inference_mode()
    def drop(self, state: CapturedState, keep: Tensor, rows: Tensor) -> None:
        """Finished inputs idle in their slots; the slots shrink (a new shape) only to a smaller power of two."""
        inputs, r = state.inputs.index_select(0, keep), state.rows_per_input  # [B']
        b, slots = inputs.shape[0], bucket(inputs.shape[0])
        if slots * r == state.tokens.shape[0]:
            state.inputs, state.rows = inputs, state.rows.index_select(0, rows)
            return
        kept = torch.cat([inputs, inputs[-1:].expand(slots - b)])  # [slots]: the last one again as padding
        kept_rows = (kept[:, None] * r + torch.arange(r, device=kept.device)).reshape(-1)  # [slots * R]
        state.tokens = state.tokens.index_select(0, kept_rows)
        self.backend.drop(state.inner, kept, kept_rows)
        mark_static(state.inner)
        state.inputs = torch.arange(b, device=kept.device)
        state.rows = torch.arange(b * r, device=kept.device)
        state.shape = (slots * r, *state.shape[1:])
