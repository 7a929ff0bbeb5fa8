"""Batch independence, model side: an input's logits, bit for bit, whatever inputs share its batch or leave it
(tests/models/test_determinism.py for the fast families, tests/models/test_families.py for the described ones)."""

from __future__ import annotations

import random

import torch

from seqgen_cli.generator import Generator
from seqgen_cli.shapes import input_width
from tests.tiny_models import sample_texts


def logits_of(
    gen: Generator, batch: list[list[int]], at: int, steps: list[int], rows: int, leave_at: int | None
):
    """Input ``at``'s logits [steps, rows, V] from start() and teacher-forced step()s (the same token for every
    row); ``leave_at``: every other input leaves after that step."""
    backend = gen.model_backend()
    state, first = backend.start(gen.pad(batch), rows, len(steps) + 1)
    out = [] if first is None else [first[at : at + 1].expand(rows, -1)]
    inputs = len(batch)
    token = gen.config.decoder_start_token_id if backend.is_encoder_decoder else steps[0]
    for t, nxt in enumerate(steps):
        logits = backend.step(state, torch.full((inputs * rows,), token))  # [inputs * rows, V]
        out.append(logits[at * rows : (at + 1) * rows].clone())
        if t == leave_at and inputs > 1:
            backend.keep(state, torch.tensor([at]), torch.arange(at * rows, (at + 1) * rows))
            inputs, at = 1, 0
        token = nxt
    return torch.stack(out)


def check_neighbours(gen: Generator) -> None:
    """One input's logits alone, and first or last among 1-4 inputs of its width bucket (of other lengths), with
    them throughout or leaving after step 2: the same bits, for 1 and 3 rows per input. Encoder-decoder models,
    whose batches mix widths (``Batch.widths``), also among inputs of other widths: narrower, and wider by
    several cross-attention chunks (``shapes.CROSS_CHUNK``), and both."""
    ids = [e.ids for e in gen.encode(sample_texts(100, seed=11))]
    widths = [input_width(len(s)) for s in ids]
    bucket = max((w for w in widths if w > 8), key=widths.count)  # narrower buckets exist
    x, *same_bucket = [s for s, w in zip(ids, widths, strict=True) if w == bucket]
    assert len(same_bucket) >= 4 and len({len(s) for s in same_bucket}) > 1, "neighbours of other lengths"
    groups = [same_bucket]
    if gen.is_encoder_decoder:
        narrow = [s[: 1 + i % (bucket - 8)] for i, s in enumerate(ids[:8])]  # narrower buckets
        # cut from all the inputs end to end: wide whatever the texts (../shared's or the built-in ones) and
        # however short the model's source limit truncates each of them
        stream = [t for s in ids for t in s]
        wide = [stream[101 * i : 101 * i + 200 + 37 * i] for i in range(8)]
        wide = [s for s in wide if input_width(len(s)) > 128]  # other chunks than x's
        assert len(narrow) >= 4 and len(wide) >= 4 and input_width(len(x)) <= 64
        groups += [narrow, wide, [narrow[0], wide[0], narrow[1], wide[1]]]
    rng = random.Random(0)
    steps = [rng.randrange(4, gen.model_backend().vocab_size) for _ in range(6)]
    for rows in (1, 3):
        alone = logits_of(gen, [x], 0, steps, rows, None)
        for g, neighbours in enumerate(groups):
            for k in (1, 2, 4):
                for at in (0, k):
                    batch = [*neighbours[:at], x, *neighbours[at:k]]
                    for leave_at in (None, 2):
                        got = logits_of(gen, batch, at, steps, rows, leave_at)
                        assert torch.equal(got, alone), (
                            f"group {g}: {k} neighbours, at {at}, leave {leave_at}, R={rows}"
                        )
