"""transformers' own ``generate()`` in seqgen's output format: the reference every fast path is held to
(``--backend hf``, ``--verify``, the equivalence tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from seqgen_cli.grammars import Grammar
from seqgen_cli.search.protocol import Batch, SearchOutput, TokenLogprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Generation = GenerationConfig | dict[str, Any]  # a resolved config, or generate() keyword arguments


@torch.inference_mode()
def hf_generate(
    model: PreTrainedModel,
    batch: Batch,
    generation: Generation,
    *,
    scores: bool = True,
    grammar: Grammar | Sequence[Grammar | None] | None = None,
    **extra: Any,
) -> SearchOutput:
    """``model.generate()`` on ``batch``: per input its ``num_return_sequences`` generated token lists (no
    prompt, no decoder start token, cut after EOS) and, with ``scores``, their scores: beam search's
    ``sequences_scores``, else each output's summed log-probs, and each token's (``compute_transition_scores``:
    normalised for greedy search and sampling, along ``beam_indices`` for beam search). ``grammar``: structured
    outputs, through :func:`grammar_processor`."""
    kwargs = dict(generation) if isinstance(generation, dict) else {"generation_config": generation}
    start = 1 if model.config.is_encoder_decoder else batch.input_ids.shape[1]  # the first generated column
    best = getattr(generation, "logprobs", None) if isinstance(generation, GenerationConfig) else None
    if grammar is not None:
        extra["logits_processor"] = [*extra.get("logits_processor", []), grammar_processor(grammar, start)]
    given = generation if isinstance(generation, GenerationConfig) else model.generation_config
    # a stop string ends a beam hypothesis without EOS, and its padding may be the EOS id: its length is read from
    # its beam indices (-1 past its end), which generate() returns with the scores only
    def setting(key: str) -> Any:  # a dict's setting, else the model's
        return generation.get(key, getattr(given, key)) if isinstance(generation, dict) else getattr(given, key)

    stops = bool(setting("stop_strings")) and (setting("num_beams") or 1) > 1  # beam search's only
    out = model.generate(
        batch.input_ids,
        attention_mask=batch.attention_mask,
        return_dict_in_generate=True,
        output_scores=scores or stops,
        output_logits=best is not None,
        **kwargs,
        **extra,
    )
    eos = setting("eos_token_id")
    b = batch.input_ids.shape[0]
    n = out.sequences.shape[0] // b
    rows = [strip_generated(row[start:], eos) for row in out.sequences.tolist()]
    beams = getattr(out, "beam_indices", None)
    if stops and beams is not None:
        rows = [row[:n] for row, n in zip(rows, (beams >= 0).sum(dim=1).tolist(), strict=True)]
    seqs = [rows[i * n : (i + 1) * n] for i in range(b)]
    logprobs = None if best is None else raw_logprobs(out, rows, best, b)
    if not scores or not out.scores:
        return SearchOutput(seqs, logprobs=logprobs)
    # [B * n, T]: each generated token's processed log-prob (greedy, sampling: the scores log-softmaxed)
    steps = model.compute_transition_scores(out.sequences, out.scores, beams, normalize_logits=beams is None)
    per_token = [step[: len(row)].tolist() for step, row in zip(steps, rows, strict=True)]
    flat = getattr(out, "sequences_scores", None)
    if flat is None:  # greedy, sampling: the tokens' log-probs summed
        flat = [float(step[: len(row)].sum()) for step, row in zip(steps, rows, strict=True)]
    else:
        flat = flat.tolist()
    return SearchOutput(
        seqs,
        [flat[i * n : (i + 1) * n] for i in range(b)],
        [per_token[i * n : (i + 1) * n] for i in range(b)],
        logprobs,
    )


def raw_logprobs(out: Any, rows: list[list[int]], best: int, b: int) -> list[list[list[TokenLogprobs]]]:
    """``--logprobs``: each generated token's raw log-prob (``output_logits``' log-softmax) and the step's ``best``
    (id, log-prob), per input (``b``) and output: at each step, the logits' row the output's token came from (greedy
    search, sampling: row ``i``; beam search: its ``beam_indices``)."""
    beams = getattr(out, "beam_indices", None)
    per_row: list[list[TokenLogprobs]] = [[] for _ in rows]
    for t, logits in enumerate(out.logits):
        step = logits.float().log_softmax(dim=-1)  # [N, V]
        values, ids = torch.topk(step, best, dim=-1) if best else (None, None)
        for i, row in enumerate(rows):
            if t < len(row):
                r = i if beams is None else int(beams[i, t])
                top = [] if ids is None else list(zip(ids[r].tolist(), values[r].tolist(), strict=True))
                per_row[i].append((float(step[r, row[t]]), top))
    n = len(rows) // b
    return [per_row[i * n : (i + 1) * n] for i in range(b)]


def strip_generated(tokens: list[int], eos: int | list[int] | None) -> list[int]:
    """Cut a padded output row after its first end-of-sequence token (kept)."""
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1]
    return tokens


def grammar_processor(grammar: Grammar | Sequence[Grammar | None], start: int) -> Any:
    """``generate()``'s ``logits_processor`` for structured outputs (``--backend hf``, and the reference the fast
    engine's ``search/grammar.py`` is held to; ``grammar``: every row's, or each input's): each row's generated tokens
    (its ``input_ids`` from column ``start``) replayed through a matcher, kept by the token prefix it has read (so
    reordered beams find theirs),
    and every token the grammar refuses set to -inf. A row that has ended (an EOS) or whose matcher failed is not
    masked, nor a step whose token a processor before this one forced (every row's scores -inf but at one token:
    ``forced_bos_token_id``, ``forced_eos_token_id``); a forced token is not read as the output's text."""
    from transformers import LogitsProcessor

    class GrammarProcessor(LogitsProcessor):
        def __init__(self) -> None:
            self.grammars = [grammar] if isinstance(grammar, Grammar) else list(grammar)
            # (input, prefix) -> its matcher
            self.seen: dict[tuple[int, tuple[int, ...]], Any] = {
                (b, ()): g.matcher() for b, g in enumerate(self.grammars) if g is not None
            }
            self.forced: set[int] = set()  # the steps whose token was forced

        def matcher(self, b: int, prefix: tuple[int, ...]) -> Any:
            known = len(prefix)
            while (b, prefix[:known]) not in self.seen:  # the longest prefix read before
                known -= 1
            for n in range(known + 1, len(prefix) + 1):  # each longer one from its parent's copy
                m = self.seen[b, prefix[: n - 1]].deep_copy()
                if n - 1 not in self.forced and not (m.is_stopped() or m.is_error()):
                    m.consume_token(prefix[n - 1])
                self.seen[b, prefix[:n]] = m
            return self.seen[b, prefix]

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if bool((torch.isfinite(scores).sum(dim=1) == 1).all()):  # a forced token
                self.forced.add(input_ids.shape[1] - start)
                return scores
            per = input_ids.shape[0] // len(self.grammars)  # rows of an input
            for i, row in enumerate(input_ids[:, start:].tolist()):
                g = self.grammars[0 if len(self.grammars) == 1 else i // per]
                if g is None or any(t in g.eos for t in row):  # no grammar, or ended: padding follows
                    continue
                m = self.matcher(i // per, tuple(row))
                if m.is_error():
                    continue
                bits = torch.frombuffer(
                    bytearray(m.compute_bitmask()), dtype=torch.uint8
                )  # [W * 4], little-endian
                allowed = (
                    ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1).bool()
                )  # [W * 32]
                refused = ~allowed[: scores.shape[1]].to(scores.device)
                scores[i] = scores[i].masked_fill(refused, float("-inf"))
            return scores

    return GrammarProcessor()
