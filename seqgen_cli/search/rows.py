"""The running rows shared by every search loop: backend state, token history and processors.

Rows are input-major (``row = b * R + k``, see ``protocol.py``). Inputs that finish leave together with
all their rows: :meth:`Rows.keep` applies one selection to the backend, the history and the stateful
processors.

Host synchronisation. A decode step (processors, search update, reorder, model step) only queues device
work: step counters are host integers, conditions on them are host branches, masks are tensors. The loop
reads the device at two places only, both here: :meth:`Rows.check`, every ``sync_every`` steps ("which
inputs are done?", one transfer), and :meth:`Rows.remaining` after the loop; the collection of finished
results follows each. ``tests/search/test_host_sync.py`` runs the engine under a dispatch mode that records every
synchronising op and holds the loops to this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from seqgen_cli.search.grammar import BatchGrammar
from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.processors import LogitsPipeline
from seqgen_cli.search.protocol import Batch, ModelBackend
from seqgen_cli.search.settings import SearchSettings


def default_sync_every(device: torch.device) -> int:
    """Steps between "which inputs are done?" host checks.

    On CPU a sync is free, so check every step (finished inputs leave at once). On GPU a check drains the
    launch queue, so check every 4 steps: in between, finished inputs keep running with frozen results,
    which wastes at most 3 steps of their rows.
    """
    return 1 if device.type == "cpu" else 4


class Leaving(NamedTuple):
    """What a host check found: the active inputs that are done and those that keep running (none left:
    :attr:`all_done`)."""

    done: torch.Tensor  # [D] int64: positions of the done inputs among the active ones, ascending
    inputs: list[int]  # [D] their original batch indices
    keep: torch.Tensor  # [B'] int64: positions of the inputs that keep running, ascending
    kept_rows: torch.Tensor  # [B' * R] int64: their rows (computed once, for the search and the backend)

    @property
    def all_done(self) -> bool:
        return self.keep.shape[0] == 0  # a host-side shape: no sync


@dataclass
class Rows:
    backend: ModelBackend
    state: Any
    history: TokenHistory
    pipeline: LogitsPipeline
    rows_per_input: int
    inputs: list[int]  # original batch index of each active input
    tokens: torch.Tensor | None = None  # [N] the next step's input tokens (the search's last choice)

    def row_index(self, inputs: torch.Tensor) -> torch.Tensor:
        """Rows of the given active inputs: [B'] -> [B' * R] int64."""
        r = self.rows_per_input
        return (inputs[:, None] * r + torch.arange(r, device=inputs.device)).reshape(-1)

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam reordering within inputs: new row ``i`` continues old row ``rows[i]``."""
        self.history.select(rows)
        self.pipeline.select(rows)
        self.backend.reorder(self.state, rows)

    def check(self, done: torch.Tensor) -> Leaving | None:
        """The periodic "which inputs are done?" check: the decode loop's one device->host sync.

        ``done``: [B_active] bool. Returns ``None`` when no input is done, else the :class:`Leaving` split
        (one transfer of ``done`` to the host; the index tensors are built there).
        """
        flags = done.tolist()
        if not any(flags):
            return None
        device = done.device
        done_pos = [i for i, f in enumerate(flags) if f]
        keep = torch.tensor([i for i, f in enumerate(flags) if not f], dtype=torch.long, device=device)
        return Leaving(
            torch.tensor(done_pos, dtype=torch.long, device=device),
            [self.inputs[i] for i in done_pos],
            keep,
            self.row_index(keep),
        )

    def remaining(self) -> tuple[torch.Tensor, list[int]]:
        """The inputs still active when the loop ends, for the final collection: ([B] int64 positions,
        their original batch indices)."""
        return torch.arange(len(self.inputs), device=self.history.tokens.device), list(self.inputs)

    def keep(self, leaving: Leaving) -> None:
        """Finished inputs leave: keep active inputs ``leaving.keep`` ([B'] int64, ascending, on device).

        Their rows (``leaving.kept_rows``, computed once by :meth:`check`) select the history, the processors
        and the backend's per-row state.
        """
        keep, rows = leaving.keep, leaving.kept_rows  # [B'], [B' * R]
        if self.tokens is not None:
            self.tokens = self.tokens[rows]  # [B' * R]
        self.history.select(rows)
        self.pipeline.select(rows)
        self.backend.keep(self.state, keep, rows)
        gone = set(leaving.inputs)
        self.inputs = [b for b in self.inputs if b not in gone]


def start_history(
    backend: ModelBackend, batch: Batch, settings: SearchSettings, rows_per_input: int
) -> TokenHistory:
    """The token history of ``batch``'s ``B * R`` rows: the decoder start token (encoder-decoder) or the left-padded
    prompt (decoder-only)."""
    r, device = rows_per_input, batch.input_ids.device
    if backend.is_encoder_decoder:
        bsz = batch.input_ids.shape[0]
        prompt = torch.full((bsz * r, 1), settings.decoder_start, dtype=torch.long, device=device)  # [N, 1]
        return TokenHistory(prompt, settings.max_length)
    prompt = batch.input_ids.repeat_interleave(r, dim=0)  # [N, S] left-padded
    # RepetitionPenaltyLogitsProcessor ignores the left padding (first non-zero mask position).
    pad_lengths = (batch.attention_mask != 0).int().argmax(dim=1).repeat_interleave(r, dim=0)  # [N]
    return TokenHistory(prompt, settings.max_length, pad_lengths)


def start_rows(
    backend: ModelBackend,
    batch: Batch,
    settings: SearchSettings,
    rows_per_input: int,
    grammar: BatchGrammar | None = None,
) -> tuple[Rows, torch.Tensor]:
    """Start the backend and the history for ``B * R`` rows; returns the rows and the first logits [N, V]: the
    prefill's (decoder-only) or the decoder start token's step (encoder-decoder). ``grammar``: each row's output
    held to it, or to its input's (``search/grammar.py``)."""
    r = rows_per_input
    bsz = batch.input_ids.shape[0]
    device = batch.input_ids.device
    state, first = backend.start(batch, rows_per_input=r, max_new_tokens=settings.max_new_tokens)
    history = start_history(backend, batch, settings, r)
    pipeline = LogitsPipeline(settings, history, backend.vocab_size, device, grammar)
    rows = Rows(backend, state, history, pipeline, r, list(range(bsz)))
    if first is None:
        return rows, backend.step(state, history.filled[:, -1])  # [N, V]: the decoder start token
    return rows, first.repeat_interleave(r, dim=0) if r > 1 else first  # [B, V] -> [N, V]
