"""``no_repeat_ngram_size``: incremental, vectorised, sync-free n-gram blocking.

transformers re-derives every n-gram from ``input_ids`` at every step (``O(L * n)`` per row). Here each
``(n-1)``-gram of the history is packed into one int64 key when it completes (``O(n)`` per row per step), so a
step costs one int64 comparison per position plus a scatter -- no host sync, no per-hypothesis Python loop, any
length. The key table is per row and follows beam reordering / dropped inputs via :meth:`select`.

Packing ``key = sum_k tok_k * V**(n-2-k)`` is exact (injective) while ``V**(n-1) < 2**63``
(e.g. V=250k up to n=4); beyond that the blocker falls back to comparing the ``n-1`` columns directly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqgen_cli.search.history import History, Step, TokenHistory, columns, filled, put_column, unless

_INT64_LIMIT = 2**63


class NGramBlocker:
    """Bans every token that would complete an n-gram already present in the row's history."""

    def __init__(self, n: int, vocab_size: int, history: TokenHistory) -> None:
        self.n = n
        self.vocab_size = vocab_size
        # V >= 2: V**(n-1) >= 2**(n-1), so from n = 64 on nothing packs; said first, no huge power computed.
        self.packed = n - 1 < 63 and vocab_size ** (n - 1) < _INT64_LIMIT
        # Packed keys only: beyond packing, V**(n-2) itself overflows int64 (n >= 7 for a 50k vocabulary).
        self.powers: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None
        if not self.packed:
            return
        tokens = history.tokens  # [N, cap]
        device = tokens.device
        # powers[k] = V**(n-2-k): [n-1] int64
        self.powers = torch.tensor(
            [vocab_size ** (n - 2 - k) for k in range(n - 1)], dtype=torch.long, device=device
        )
        # keys[:, j] = packed (n-1)-gram starting at column j; columns [0, length - n + 2) are valid.
        self.keys = torch.zeros((tokens.shape[0], tokens.shape[1] + 1), dtype=torch.long, device=device)
        if n > 1 and history.length >= n - 1:
            grams = history.filled.unfold(1, n - 1, 1)  # [N, length - n + 2, n - 1]
            self.keys[:, : grams.shape[1]] = (grams * self.powers).sum(-1)

    def select(self, rows: torch.Tensor) -> None:
        """Follow the history's row selection (beam reorder / dropped inputs)."""
        if self.keys is not None:
            self.keys = self.keys.index_select(0, rows)

    def appended(self, history: TokenHistory) -> None:
        """The history just grew by one column: one more (n-1)-gram may be complete (O(n) per row)."""
        if self.keys is not None and self.powers is not None and self.n > 1:
            append_key(self.n, self.powers, history.tokens, self.keys, history.length, history.cols)

    def __call__(self, history: TokenHistory, scores: torch.Tensor) -> torch.Tensor:
        """``scores``: [N, V]; banned entries set to -inf in place."""
        return ngram_ban(self.n, self.vocab_size, history, self.keys, history.length, scores)


def append_key(n: int, powers: Tensor, tokens: Tensor, keys: Tensor, length: Step, cols: Tensor) -> Tensor:
    """The keys after the history grew to ``length`` columns: the key of the (n-1)-gram ending with the new token
    (``tokens`` [N, C]) at its start column of ``keys`` [N, C + 1] (in place at a host ``length``; a new buffer at
    a device one)."""
    start = length - (n - 1)
    ready = start >= 0  # [] the gram is complete
    if ready is False:
        return keys
    key = (columns(tokens, start, n - 1, cols) * powers).sum(-1)  # [N]
    return put_column(keys, start, key, cols, ready)


def ngram_ban(
    n: int,
    vocab: int,
    h: History,
    keys: Tensor | None,
    length: Step,
    scores: Tensor,
    skip: Tensor | None = None,
) -> Tensor:
    """Bans, in place, every token of ``scores`` [N, V] that would complete an n-gram already in the row's
    ``length`` columns of ``h`` (none where ``skip``, a 0-d bool): by the packed ``keys`` or by comparing columns.

    At a host length the windows are the complete ones; at a device length every window that fits the buffer,
    those at or past ``length - n + 1`` masked."""
    windows = length - n + 1  # complete n-grams in the history
    if isinstance(windows, int) and windows <= 0:
        return scores
    tokens = filled(h.tokens, length)  # [N, length]
    width = tokens.shape[1] - n + 1  # window starts read: the complete ones (host), all that fit (device)
    if keys is not None:
        current = columns(keys, windows, 1, h.cols)  # [N, 1] key of the last n-1 tokens
        matches = keys[:, :width] == current  # [N, W]
    else:
        prefix = columns(h.tokens, windows, n - 1, h.cols)  # [N, n-1]
        grams = tokens[:, :-1].unfold(1, n - 1, 1)[:, :width]  # [N, W, n-1]
        matches = (grams == prefix[:, None, :]).all(-1)  # [N, W]
    banned = tokens[:, n - 1 :]  # [N, W]: the token completing window j
    ban = matches & (banned < vocab)
    if not isinstance(windows, int):
        ban = ban & (h.cols[:width] < windows)
    values = torch.where(unless(ban, skip), float("-inf"), float("inf")).to(scores.dtype)
    # amin with +inf leaves a score unchanged, with -inf bans it: order-free, so deterministic on GPU.
    return scores.scatter_reduce_(1, banned.clamp(max=vocab - 1), values, reduce="amin")
