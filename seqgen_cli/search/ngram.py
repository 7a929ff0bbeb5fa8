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

from seqgen_cli.search.history import TokenHistory

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
        start = history.length - (self.n - 1)
        if self.keys is not None and self.n > 1 and start >= 0:
            gram = history.tokens[:, start : history.length]  # [N, n-1]
            self.keys[:, start] = (gram * self.powers).sum(-1)

    def __call__(self, history: TokenHistory, scores: torch.Tensor) -> torch.Tensor:
        """``scores``: [N, V]; banned entries set to -inf in place."""
        n, length = self.n, history.length
        windows = length - n + 1  # complete n-grams in the history
        if windows <= 0:
            return scores
        tokens = history.tokens
        if self.keys is not None:
            current = self.keys[:, windows : windows + 1]  # [N, 1] key of the last n-1 tokens
            matches = self.keys[:, :windows] == current  # [N, W]
        else:
            prefix = tokens[:, windows:length]  # [N, n-1]
            grams = tokens[:, : length - 1].unfold(1, n - 1, 1)[:, :windows]  # [N, W, n-1]
            matches = (grams == prefix[:, None, :]).all(-1)  # [N, W]
        banned = tokens[:, n - 1 : length]  # [N, W]: the token completing window j
        in_vocab = banned < self.vocab_size
        values = torch.full(matches.shape, float("inf"), dtype=scores.dtype, device=scores.device)
        values.masked_fill_(matches & in_vocab, float("-inf"))
        # amin with +inf leaves a score unchanged, with -inf bans it: order-free, so deterministic on GPU.
        return scores.scatter_reduce_(1, banned.clamp(max=self.vocab_size - 1), values, reduce="amin")
