"""Token history of the running rows (what transformers calls ``input_ids`` inside its search loops), in its two
layouts, and how the processors read and write it at a step.

* dynamic (:class:`TokenHistory`): columns ``[0, length)`` filled, ``length`` a host int. A processor reads the
  filled columns by slicing, and a condition on the step (``cur_len < min_length``) is a host branch: no pass over
  what a step does not need, no device->host sync;
* static (:class:`StaticHistory`, the static beam search of ``static.py``): a fixed ``[N, W]`` buffer (the columns
  from ``length`` on zeros), the step and the batch's limits 0-d device tensors (:class:`StepLimits`). A processor
  reads every column and masks those it must not count, and a condition on the step is a ``torch.where``: one
  compiled graph serves every step of a shape.

The layout shows in the type of the step (:data:`Step`): the helpers here (:func:`filled`, :func:`unfilled`,
:func:`columns`, :func:`put_column`, :func:`gate`) branch on it, so each processor (``processors.py``,
``ngram.py``) is written once over both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqgen_cli.search.settings import SearchSettings

Step = int | Tensor  # a step's length (transformers' cur_len): host int (dynamic) or 0-d int64 device tensor
Cond = bool | Tensor  # a condition on the step: host bool (dynamic) or 0-d bool device tensor (static)


class TokenHistory:
    """Preallocated ``[N, max_length]`` token buffer; columns ``[0, length)`` are filled for every row.

    Columns ``[0, prompt_len)`` hold the decoder prompt (left-padded prompt for decoder-only models, the
    decoder start token for encoder-decoder models), exactly as transformers' ``input_ids`` would.
    """

    def __init__(
        self, prompt: torch.Tensor, max_length: int, pad_lengths: torch.Tensor | None = None
    ) -> None:
        n, prompt_len = prompt.shape  # prompt: [N, W] int64
        self.tokens = torch.zeros((n, max_length), dtype=torch.long, device=prompt.device)  # [N, max_length]
        self.tokens[:, :prompt_len] = prompt
        self.length = prompt_len  # host int: same for all rows (transformers' cur_len)
        self.prompt_len = prompt_len
        # [N] int64: leading pad positions per row (decoder-only left padding), or None when there are none.
        self.pad_lengths = pad_lengths
        self.cols = torch.arange(max_length + 1, device=prompt.device)  # [max_length + 1] column indices

    @property
    def filled(self) -> torch.Tensor:
        """``[N, length]`` view of the filled columns."""
        return self.tokens[:, : self.length]

    @property
    def generated(self) -> torch.Tensor:
        """``[N, length - prompt_len]`` view of the generated tokens."""
        return self.tokens[:, self.prompt_len : self.length]

    def append(self, tokens: torch.Tensor) -> None:
        """Append one token per row (``tokens``: [N] int64)."""
        put_column(self.tokens, self.length, tokens, self.cols)
        self.length += 1

    def select(self, rows: torch.Tensor) -> None:
        """Keep/reorder rows: new row ``i`` is old row ``rows[i]`` ([N'] int64)."""
        self.tokens = self.tokens.index_select(0, rows)
        if self.pad_lengths is not None:
            self.pad_lengths = self.pad_lengths.index_select(0, rows)


@dataclass(eq=False)
class StepLimits:
    """A batch's step counter and length limits for the static layout, 0-d int64 device tensors (refilled in place
    by every batch): the fields of ``SearchSettings`` that the processors compare the step with, as device values."""

    t: Tensor  # steps done
    prompt_len: Tensor  # decoder positions before the first generated token
    max_length: Tensor
    min_length: Tensor
    begin_index: Tensor

    @classmethod
    def zeros(cls, device: torch.device) -> StepLimits:
        return cls(*(torch.zeros((), dtype=torch.long, device=device) for _ in range(5)))

    def restart(self, s: SearchSettings) -> None:
        """Step 0 of a batch with settings ``s`` (one fill per value: queued, no copy from host memory)."""
        self.t.zero_()
        self.prompt_len.fill_(s.prompt_len)
        self.max_length.fill_(s.max_length)
        self.min_length.fill_(s.min_length)
        self.begin_index.fill_(s.begin_index)

    def tensors(self) -> list[Tensor]:
        return [self.t, self.prompt_len, self.max_length, self.min_length, self.begin_index]


@dataclass(eq=False)
class StaticHistory:
    """The rows' tokens ``[N, W]`` (prompt, then generated; zeros beyond), left padding per row and, with
    ``no_repeat_ngram_size``, the packed (n-1)-gram keys ``[N, W + 1]`` (``ngram.py``); ``cols``: ``arange(W + 1)``."""

    tokens: Tensor  # [N, W] int64
    pad_lengths: Tensor  # [N] int64: leading pad positions (decoder-only prompts), zeros otherwise
    keys: Tensor | None  # [N, W + 1] int64: key of the (n-1)-gram starting at each column
    cols: Tensor  # [W + 1] int64

    @classmethod
    def empty(cls, rows: int, width: int, packed_ngrams: bool, device: torch.device) -> StaticHistory:
        keys = torch.zeros((rows, width + 1), dtype=torch.long, device=device) if packed_ngrams else None
        tokens = torch.zeros((rows, width), dtype=torch.long, device=device)
        pads = torch.zeros(rows, dtype=torch.long, device=device)
        return cls(tokens, pads, keys, torch.arange(width + 1, device=device))

    def restart(self, history: TokenHistory, keys: Tensor | None, src: Tensor) -> None:
        """Take a batch's starting history (``TokenHistory``, its n-gram keys) in place: row ``i`` is row
        ``src[i]`` of it ([N] int64: idle lanes repeat a running row)."""
        width = history.tokens.shape[1]  # the batch's max_length <= W
        self.tokens.zero_()
        self.tokens[:, :width] = history.tokens.index_select(0, src)
        self.pad_lengths.zero_()
        if history.pad_lengths is not None:
            self.pad_lengths.copy_(history.pad_lengths.index_select(0, src))
        if self.keys is not None and keys is not None:
            self.keys.zero_()
            self.keys[:, : width + 1] = keys.index_select(0, src)

    def buffers(self) -> list[Tensor]:
        return [self.tokens] if self.keys is None else [self.tokens, self.keys]


History = TokenHistory | StaticHistory


def filled(tokens: Tensor, length: Step) -> Tensor:
    """The columns of ``tokens`` [N, C] a processor reads at ``length``: the filled ones ``[0, length)`` at a host
    length; every one at a device length (the processor masks those from ``length`` on: :func:`unfilled`)."""
    return tokens[:, :length] if isinstance(length, int) else tokens


def unfilled(h: History, length: Step, width: int) -> Tensor | None:
    """[N, width] (or [1, width]) bool: the columns of :func:`filled` that a processor must not count, a row's
    left padding and, at a device length, the columns from ``length`` on; ``None``: none."""
    cols = h.cols[:width]
    pad = None if h.pad_lengths is None else cols[None, :] < h.pad_lengths[:, None]
    return pad if isinstance(length, int) else either(pad, (cols >= length)[None, :])


def columns(tokens: Tensor, start: Step, count: int, cols: Tensor) -> Tensor:
    """``tokens[:, start : start + count]`` ([N, count]): a slice at a host ``start``, a gather at a device one
    (clamped into the buffer: columns before 0 read column 0, which the caller masks)."""
    if isinstance(start, int):
        return tokens[:, start : start + count]
    at = (start + cols[:count]).clamp(0, tokens.shape[1] - 1)  # [count]
    return tokens.gather(1, at[None, :].expand(tokens.shape[0], count))


def put_column(buf: Tensor, col: Step, values: Tensor, cols: Tensor, when: Cond = True) -> Tensor:
    """``buf[:, col] := values`` ([N]) where ``when``: at a host column in place (``when`` a host branch); at a
    device one a ``torch.where`` over ``buf`` (a new buffer: the static step is a pure function)."""
    if isinstance(col, int):
        if when:
            buf[:, col] = values
        return buf
    return torch.where(gate(cols[: buf.shape[1]] == col, when), values[:, None], buf)


def gate(mask: Tensor, when: Cond) -> Tensor:
    """``mask`` only where ``when`` holds (``True``: as it is; a device condition: ``mask & when``). A host
    ``False`` is the caller's to skip before it computes ``mask``."""
    return mask if when is True else mask & when


def either(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``a | b``, where ``None`` is "never"."""
    if a is None or b is None:
        return a if b is None else b
    return a | b


def unless(mask: Tensor, skip: Tensor | None) -> Tensor:
    """``mask`` except where ``skip`` (a 0-d bool; ``None``: never)."""
    return mask if skip is None else mask & ~skip
