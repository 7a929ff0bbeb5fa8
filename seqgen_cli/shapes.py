"""Every rule that decides a tensor's shape, in one place (the batcher, the backends, the capture path and the
refill engine all ask here).

Two widths, for two reasons:

- :func:`input_width`: the width one input is padded to for its arithmetic, whoever its neighbours (multiples of
  8, at most 12.5 % padding, never past the model's positions). The batcher groups inputs by it; a decoder-only
  prompt that joins a refill lane is prefilled at it.
- :func:`graph_width`: the width of a compiled (captured) shape, or of the refill lanes' sources and prompt
  regions: a power of two, at least :data:`MIN_WIDTH`, so a run compiles a handful of shapes.

An encoder-decoder batch mixes input widths: each input's encoder runs at its own :func:`input_width`, and the
batch's cross-attention keys/values span :func:`cross_width` (whole chunks of :data:`CROSS_CHUNK` positions,
``models/attention.attention``), zeros past an input's own width.

Rows and time: a captured batch pads its inputs to a power of two (:func:`graph_inputs`, and fewer as inputs
leave: :func:`compacted`), its new-token cache positions to a multiple of :data:`POSITIONS` (:func:`graph_positions`); a
static step (captured, or refill) attends a span bucket of those positions (:func:`span_bucket`).
"""

from __future__ import annotations

WIDTH_STEP = 8  # input widths are multiples of this (and finer steps are never used)
MIN_WIDTH = 64  # narrowest graph width; wider ones are powers of two
POSITIONS = 64  # a captured batch's new-token cache positions are allocated in multiples of this
MIN_SPAN = 64  # a static step's narrowest self-attention span (captured and refill steps)
CROSS_CHUNK = 64  # cross-attention sums its values over chunks of this many source positions


def power_of_two(n: int) -> int:
    """The smallest power of two >= ``n``."""
    return 1 << max(0, n - 1).bit_length()


def input_width(length: int, limit: int | None = None) -> int:
    """The width an input of ``length`` tokens is padded to, whoever its neighbours: ``length`` rounded up to a
    multiple of 8 tokens up to 128, beyond that of 1/16 of the next power of two (16 up to 256, 32 up to 512,
    ...): at most 12.5 % padding, 8 widths per doubling of the length; no padding past ``limit`` (the positions
    the model has).

    Why widths are fixed per input: the kernels that attend over a padded source (encoder self-attention,
    cross-attention, a decoder-only prompt) round differently at different widths even where the padding is
    masked, so an input padded to its neighbours' width would get other bits. Why multiples of 8: MKL's GEMM
    (the encoder's linear layers, ``B x width`` rows) and torch's CPU flash attention give a row the same bits
    whatever the batch and thread count when the row count and width are multiples of 8 (measured with 1-16
    threads; not with odd widths)."""
    step = max(WIDTH_STEP, power_of_two(length) // 16)
    width = -(-max(length, 1) // step) * step
    return width if limit is None else max(length, min(width, limit))


def cross_width(width: int) -> int:
    """The cross-attention width of a batch of sources padded to ``width``: whole :data:`CROSS_CHUNK` chunks
    (graph widths are already)."""
    return -(-width // CROSS_CHUNK) * CROSS_CHUNK


def graph_width(n: int, limit: int | None = None) -> int:
    """The graph width of ``n`` source (or prompt) tokens: the smallest power of two >= ``n``, at least
    :data:`MIN_WIDTH`, and at most ``limit`` (the model's position limit) when ``n`` fits in it."""
    width = max(MIN_WIDTH, power_of_two(n))
    return min(width, max(n, limit)) if limit else width


def graph_inputs(n: int) -> int:
    """The inputs a captured batch of ``n`` runs with (copies of the last one pad it): a power of two."""
    return power_of_two(n)


def compacted(running: int, start: int) -> int:
    """Graph inputs for ``running`` inputs of a captured batch that started with ``start``: the smallest power of
    two that holds them, but at most two halvings below ``start``. Fewer inputs save little on a GPU (the
    weights' traffic stays), another shape costs a compile: a batch runs at most 3 row shapes."""
    return max(power_of_two(running), start // 4, 1)


def graph_positions(new_tokens: int) -> int:
    """The new-token cache positions a captured batch allocates: a multiple of :data:`POSITIONS`."""
    return -(-max(1, new_tokens) // POSITIONS) * POSITIONS


def span_bucket(step: int, max_len: int) -> int:
    """Cache positions a static step attends when it (or, refill, its most advanced lane) writes position ``step``: the
    smallest power of two above ``step``, at least :data:`MIN_SPAN`, at most ``max_len``. A step reads at most
    twice the positions written (once past :data:`MIN_SPAN`), and a run compiles one graph per bucket it reaches."""
    return min(max_len, max(MIN_SPAN, 1 << step.bit_length()))
