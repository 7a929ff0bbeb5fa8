"""The grammar's mask (structured outputs, ``grammars.py``): a logits processor over one matcher per row.

Each row's matcher (llguidance's parser state) says which tokens may come next; :class:`GrammarMask` writes every
row's allowed tokens into one bitmask on the host (llguidance fills the rows in parallel), copies it to the device
once per step and sets the other tokens to -inf there, after transformers' own processors and before the warpers
(where ``generate()`` runs a ``logits_processor`` it is given). A row's matcher follows the row: beam reordering
copies a parent's state to each of its children (:meth:`select`), and leaving inputs drop theirs.

The matchers advance on the host: the step's tokens are read once per step (a constrained run syncs every step,
which an unconstrained one does not), and only when the next step's mask is needed, so on a GPU the model's next
step is already queued. A row that has ended (its EOS taken) or whose matcher failed (a token the grammar refused: a
row whose scores were all -inf) is not masked: ``generate()``'s processor does the same, and such a row's tokens are
padding or out of the running. A row whose grammar is complete is masked to EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from seqgen_cli.grammars import Grammar

NEG_INF = float("-inf")


BatchGrammar = Grammar | Sequence[Grammar | None]  # the batch's grammar, or each input's (None: unconstrained)


class GrammarMask:
    """The grammar's processor for the ``n`` rows of one search (the dynamic layout: ``LogitsPipeline``); ``grammar``:
    every row's, or each input's (its rows: ``n / len(grammar)`` consecutive ones)."""

    def __init__(self, grammar: BatchGrammar, n: int) -> None:
        from llguidance import LLExecutor

        per_input = [grammar] if isinstance(grammar, Grammar) else list(grammar)
        rows = [g for g in per_input for _ in range(n // len(per_input))]  # [N]
        self.matchers: list[Any] = [None if g is None else g.matcher() for g in rows]
        self.ended = [g is None for g in rows]  # the row took an EOS token (later tokens: padding), or has no grammar
        known = [g for g in per_input if g is not None]
        self.eos = set(known[0].eos) if known else set()
        self.executor = LLExecutor()
        self.words = (max((g.vocab for g in known), default=0) + 31) // 32  # int32 words per row of the bitmask
        self.pending = False  # the history has a column the matchers have not consumed
        self.forced = False  # the pending column is a forced token (a forced BOS), which no matcher reads
        self.bits = torch.arange(32, dtype=torch.int32)  # [32]: a word's bit positions

    def select(self, rows: Tensor) -> None:
        """Row ``i`` continues old row ``rows[i]`` ([N'] int64): the first child takes its parent's matcher, the
        others a copy (taken before any of them consumes a token)."""
        taken: set[int] = set()
        picked, ended = [], []
        for r in rows.tolist():
            m = self.matchers[r]
            picked.append(m.deep_copy() if r in taken and m is not None else m)
            ended.append(self.ended[r])
            taken.add(r)
        self.matchers, self.ended = picked, ended

    def appended(self) -> None:
        self.pending = True

    def _live(self) -> list[int]:
        return [i for i, m in enumerate(self.matchers) if not (self.ended[i] or m.is_error())]

    def __call__(self, tokens: Tensor, scores: Tensor, forced: bool = False) -> Tensor:
        """``tokens``: the history [N, length] (its last column: the tokens to consume first, if any are pending);
        ``scores`` [N, V] -> the same with every token the row's grammar refuses at -inf (in place). ``forced``: a
        processor forced this step's token (``forced_bos_token_id``, ``forced_eos_token_id``): no mask, and the
        token is not the output's text."""
        if self.pending and not self.forced:
            last = tokens[:, -1].tolist()  # the step's one host sync
            for i in self._live():
                self.matchers[i].consume_token(last[i])
                self.ended[i] = last[i] in self.eos
        self.pending, self.forced = False, forced
        live = [] if forced else self._live()
        if not live:
            return scores
        from llguidance.torch import fill_next_token_bitmask_par

        mask = torch.full((len(live), self.words), -1, dtype=torch.int32)  # [M, W]: 1 bits allowed
        fill_next_token_bitmask_par(self.executor, [(self.matchers[i], j) for j, i in enumerate(live)], mask)
        if self.bits.device != scores.device:  # once: the step's only other copy is the mask itself
            self.bits = self.bits.to(scores.device)
        allowed = (mask.to(scores.device)[:, :, None] >> self.bits) & 1  # [M, W, 32]
        allowed = allowed.view(len(live), -1)[:, : scores.shape[1]].bool()  # [M, V]
        if len(live) == len(self.matchers):  # every row masked: in place
            return scores.masked_fill_(~allowed, NEG_INF)
        rows = torch.tensor(live, dtype=torch.long, device=scores.device)  # [M]
        return scores.index_put_((rows,), scores.index_select(0, rows).masked_fill_(~allowed, NEG_INF))

