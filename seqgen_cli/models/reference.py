"""transformers' own ``generate()`` in seqgen's output format: the reference every fast path is held to
(``--backend hf``, ``--verify``, the equivalence tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from seqgen_cli.search.protocol import Batch, SearchOutput

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Generation = GenerationConfig | dict[str, Any]  # a resolved config, or generate() keyword arguments


@torch.inference_mode()
def hf_generate(
    model: PreTrainedModel, batch: Batch, generation: Generation, *, scores: bool = True, **extra: Any
) -> SearchOutput:
    """``model.generate()`` on ``batch``: per input its ``num_return_sequences`` generated token lists (no
    prompt, no decoder start token, cut after EOS) and, with ``scores``, their scores: beam search's
    ``sequences_scores``, else each output's summed log-probs, and each token's (``compute_transition_scores``:
    normalised for greedy search and sampling, along ``beam_indices`` for beam search)."""
    kwargs = dict(generation) if isinstance(generation, dict) else {"generation_config": generation}
    out = model.generate(
        batch.input_ids, attention_mask=batch.attention_mask, return_dict_in_generate=True,
        output_scores=scores, **kwargs, **extra,
    )  # fmt: skip
    given = generation if isinstance(generation, GenerationConfig) else model.generation_config
    eos = (
        generation.get("eos_token_id", given.eos_token_id)
        if isinstance(generation, dict)
        else given.eos_token_id
    )
    start = 1 if model.config.is_encoder_decoder else batch.input_ids.shape[1]
    b = batch.input_ids.shape[0]
    n = out.sequences.shape[0] // b
    rows = [strip_generated(row[start:], eos) for row in out.sequences.tolist()]
    seqs = [rows[i * n : (i + 1) * n] for i in range(b)]
    if not scores or not out.scores:
        return SearchOutput(seqs)
    beams = getattr(out, "beam_indices", None)
    # [B * n, T]: each generated token's processed log-prob (greedy, sampling: the scores log-softmaxed)
    steps = model.compute_transition_scores(out.sequences, out.scores, beams, normalize_logits=beams is None)
    per_token = [step[: len(row)].tolist() for step, row in zip(steps, rows, strict=True)]
    flat = getattr(out, "sequences_scores", None)
    if flat is None:  # greedy, sampling: the tokens' log-probs summed
        flat = [float(step[: len(row)].sum()) for step, row in zip(steps, rows, strict=True)]
    else:
        flat = flat.tolist()
    return SearchOutput(
        seqs, [flat[i * n : (i + 1) * n] for i in range(b)], [per_token[i * n : (i + 1) * n] for i in range(b)]
    )


def strip_generated(tokens: list[int], eos: int | list[int] | None) -> list[int]:
    """Cut a padded output row after its first end-of-sequence token (kept)."""
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1]
    return tokens
