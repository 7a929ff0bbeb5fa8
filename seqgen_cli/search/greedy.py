"""Greedy search, and the token-by-token loop it shares with sampling (``sampling.py``).

Mirrors transformers' ``_sample``: processors on float32 logits, pick one token per row, a row stops at
EOS (later tokens are pad and discarded), an input stops when all its rows did. Inputs whose rows all
stopped leave the batch at the next host check (see ``rows.default_sync_every``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from seqgen_cli.search.output import SearchOutput
from seqgen_cli.search.protocol import Batch, ModelBackend
from seqgen_cli.search.rows import default_sync_every, start_rows
from seqgen_cli.search.settings import SearchSettings

Picker = Callable[[torch.Tensor], torch.Tensor]  # processed scores [N, V] -> tokens [N]


def token_search(
    backend: ModelBackend,
    batch: Batch,
    settings: SearchSettings,
    pick: Picker,
    rows_per_input: int,
    sync_every: int | None = None,
) -> SearchOutput:
    """Run one token per row per step until every row hit EOS or ``max_length``."""
    s, r = settings, rows_per_input
    device = batch.input_ids.device
    sync_every = sync_every or default_sync_every(device)
    # Host data goes to the device before the first step is queued (a copy after it would wait for it).
    eos = torch.tensor(s.eos, dtype=torch.long, device=device) if s.eos else None
    rows, logits = start_rows(backend, batch, s, r)
    history = rows.history
    total = s.max_new_tokens
    pad = s.pad if s.pad is not None else 0
    n = logits.shape[0]
    finished = torch.zeros(n, dtype=torch.bool, device=device)  # [N]
    lengths = torch.full((n,), total, dtype=torch.long, device=device)  # [N] generated length (EOS included)
    results: list[list[list[int]]] = [[] for _ in range(batch.input_ids.shape[0])]

    def collect(idx: torch.Tensor, inputs: list[int]) -> None:
        """Copy the rows of active inputs ``idx`` ([D] int64; batch indices ``inputs``) to the host results:
        only after a host check or the loop (``Rows.check``, ``Rows.remaining``)."""
        row_ids = rows.row_index(idx)  # [D * R]
        tokens = history.generated.index_select(0, row_ids).tolist()
        lens = lengths.index_select(0, row_ids).tolist()
        for j, b in enumerate(inputs):
            results[b] = [tokens[j * r + k][: lens[j * r + k]] for k in range(r)]

    for t in range(total):
        scores = rows.pipeline(history, logits.float())  # [N, V] float32 (transformers casts too)
        tokens = pick(scores)  # [N]
        tokens = torch.where(finished, pad, tokens)
        history.append(tokens)
        rows.pipeline.appended(history)
        if eos is not None:
            hit = torch.isin(tokens, eos) & ~finished
            lengths = torch.where(hit, t + 1, lengths)
            finished = finished | hit
        if t == total - 1:
            break
        if eos is not None and (t + 1) % sync_every == 0:
            done = finished.view(-1, r).all(dim=1)  # [B_active]
            leaving = rows.check(done)
            if leaving is not None:
                if leaving.all_done:
                    break
                collect(leaving.done, leaving.inputs)
                kept_rows = leaving.kept_rows  # [B' * R]
                finished, lengths, tokens = finished[kept_rows], lengths[kept_rows], tokens[kept_rows]
                rows.keep_inputs(leaving)
        logits = backend.step(rows.state, tokens)  # [N, V]

    collect(*rows.remaining())
    return SearchOutput(sequences=results)


def greedy_search(
    backend: ModelBackend, batch: Batch, settings: SearchSettings, sync_every: int | None = None
) -> SearchOutput:
    """Arg-max decoding (``num_beams=1``, no sampling)."""
    return token_search(backend, batch, settings, lambda scores: scores.argmax(dim=-1), 1, sync_every)
