"""Equivalence harness: seqgen's engine vs transformers ``generate()``, token for token, in float32.

Reusable for any backend: :func:`check_equivalence` takes a ``backend_factory(model) -> ModelBackend``.

Greedy must agree 100 %. Beam search must agree 100 % except where a *near-tie* explains a difference,
found one of two ways:

* at the end: both returned sequences are re-scored by teacher forcing under the same processors and length
  penalty, and their scores are within ``rtol`` (relative) of each other;
* during the search: transformers itself returns seqgen's sequence for that input once its log-probs carry
  noise of ``tie_noise`` (1e-5, the size of float32 rounding across a decoder's layers; seeds 0-4). A beam
  that loses or survives the top-K cut by less than that margin changes the rest of the search, so such
  a difference says nothing about the backend's arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.generator import strip_generated
from seqgen_cli.search import Batch, ModelBackend, generate, settings_for
from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.processors import LogitsPipeline
from seqgen_cli.search.settings import SearchSettings

# Settings of the equivalence suite (name -> generate() kwargs). max_new_tokens stays small for CPU.
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": dict(num_beams=1, max_new_tokens=24),
    "beam4_ngram3_lp2_minmax_es": dict(
        num_beams=4,
        no_repeat_ngram_size=3,
        length_penalty=2.0,
        min_new_tokens=4,
        max_new_tokens=20,
        early_stopping=True,
    ),
    "beam5_es_false": dict(num_beams=5, early_stopping=False, max_new_tokens=24),
    "beam5_es_never": dict(num_beams=5, early_stopping="never", max_new_tokens=24),
    "beam4_lp0.6": dict(num_beams=4, length_penalty=0.6, max_new_tokens=24),
    "beam4_nrs3": dict(num_beams=4, num_return_sequences=3, max_new_tokens=24),
    "beam4_rep1.2": dict(num_beams=4, repetition_penalty=1.2, max_new_tokens=24),
    # max_length/min_length count the prompt (decoder-only) or the decoder start token (encoder-decoder).
    "beam4_maxlen48_minlen44": dict(num_beams=4, max_length=48, min_length=44),
    # no length given: 20 new tokens; processors in greedy act on raw logits.
    "greedy_rep1.3_ngram2_default_len": dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
    "beam4_ngram3_renormalize": dict(
        num_beams=4, no_repeat_ngram_size=3, renormalize_logits=True, max_new_tokens=24
    ),
}

BackendFactory = Callable[[PreTrainedModel], ModelBackend]

# 2 shared CPU cores: intra-op threads only oversubscribe them (10x slower under load).
torch.set_num_threads(1)


@dataclass
class EquivalenceResult:
    total: int = 0  # returned sequences compared
    identical: int = 0
    near_ties: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # transformers' output lengths (is the test meaningful?)

    @property
    def agreement(self) -> float:
        return 100.0 * self.identical / max(self.total, 1)

    def summary(self) -> str:
        return (
            f"{self.identical}/{self.total} identical ({self.agreement:.1f} %), "
            f"{len(self.near_ties)} near-tie(s), {len(self.mismatches)} unexplained; "
            f"lengths {min(self.lengths, default=0)}..{max(self.lengths, default=0)} "
            f"(mean {sum(self.lengths) / max(len(self.lengths), 1):.1f})"
        )


def hf_generate(model: PreTrainedModel, batch: Batch, kwargs: dict[str, Any]):
    """transformers' output in seqgen's format: (sequences per input, sequence scores per input or None)."""
    out = model.generate(
        batch.input_ids,
        attention_mask=batch.attention_mask,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )
    start = 1 if model.config.is_encoder_decoder else batch.input_ids.shape[1]
    eos = kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    nrs = kwargs.get("num_return_sequences", 1)
    rows = [strip_generated(row[start:], eos) for row in out.sequences.tolist()]
    seqs = [rows[i * nrs : (i + 1) * nrs] for i in range(batch.input_ids.shape[0])]
    scores = None
    if getattr(out, "sequences_scores", None) is not None:
        flat = out.sequences_scores.tolist()
        scores = [flat[i * nrs : (i + 1) * nrs] for i in range(batch.input_ids.shape[0])]
    return seqs, scores


@torch.inference_mode()
def rescore(
    model: PreTrainedModel, batch: Batch, index: int, tokens: list[int], settings: SearchSettings
) -> float:
    """Teacher-forced beam score of ``tokens`` for input ``index``: processed log-probs, length-penalised."""
    ids, mask = batch.input_ids[index : index + 1], batch.attention_mask[index : index + 1]
    seq = torch.tensor([tokens], dtype=torch.long, device=ids.device)
    if model.config.is_encoder_decoder:
        prompt = torch.tensor([[settings.decoder_start]], device=ids.device)
        dec = torch.cat([prompt, seq], dim=1)
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[0]  # [T + 1, V]
        pad_lengths = None
    else:
        prompt = ids
        full = torch.cat([ids, seq], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(seq)], dim=1)
        pos = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
        logits = model(input_ids=full, attention_mask=full_mask, position_ids=pos).logits[
            0, ids.shape[1] - 1 :
        ]
        pad_lengths = (mask != 0).int().argmax(dim=1)
    history = TokenHistory(prompt, settings.max_length, pad_lengths)
    pipeline = LogitsPipeline(settings, history, logits.shape[-1], logits.device)
    total = 0.0
    for t, tok in enumerate(tokens):
        scores = pipeline(history, torch.log_softmax(logits[t : t + 1].float(), dim=-1))
        total += float(scores[0, tok])
        history.append(torch.tensor([tok], device=ids.device))
        pipeline.appended(history)
    return total / (len(tokens) ** settings.length_penalty)


class _LogProbNoise(LogitsProcessor):
    """Adds seeded Gaussian noise of size ``eps`` to the (log-prob) scores of every step."""

    def __init__(self, eps: float, seed: int) -> None:
        self.eps, self.gen = eps, torch.Generator().manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(scores.shape, generator=self.gen).to(scores.device, scores.dtype)
        return scores + self.eps * noise


def tie_sensitive(
    model: PreTrainedModel,
    batch: Batch,
    kwargs: dict[str, Any],
    wanted: dict[tuple[int, int], list[int]],
    eps: float,
    seeds: int = 5,
) -> dict[tuple[int, int], int]:
    """Which ``(input, rank) -> sequence`` transformers also returns under log-prob noise ``eps``: -> seed."""
    found: dict[tuple[int, int], int] = {}
    for seed in range(seeds):
        noisy = dict(kwargs, logits_processor=LogitsProcessorList([_LogProbNoise(eps, seed)]))
        seqs, _ = hf_generate(model, batch, noisy)
        for (b, i), tokens in wanted.items():
            if (b, i) not in found and seqs[b][i] == tokens:
                found[(b, i)] = seed
        if len(found) == len(wanted):
            break
    return found


def check_equivalence(
    model: PreTrainedModel,
    backend_factory: BackendFactory,
    batch: Batch,
    kwargs: dict[str, Any],
    *,
    rtol: float = 1e-5,
    tie_noise: float = 1e-5,
    keep_dtype: bool = False,
    engine: Callable[[ModelBackend, Batch, Any], Any] = generate,
) -> EquivalenceResult:
    """Run seqgen (via ``backend_factory(model)``) and ``model.generate()`` on ``batch``; compare tokens.

    The model runs in float32 unless ``keep_dtype``. ``engine(backend, batch, config)``: seqgen's entry point
    (default :func:`seqgen_cli.search.generate`; the refill engine in tests/test_slots.py).
    """
    model = (model if keep_dtype else model.float()).eval()
    config = resolve_generation_config(model.generation_config, None, kwargs)
    backend = backend_factory(model)
    ours = engine(backend, batch, config)
    theirs, their_scores = hf_generate(model, batch, kwargs)
    settings = settings_for(backend, batch, config)
    result = EquivalenceResult()
    unexplained: dict[tuple[int, int], tuple[list[int], str]] = {}
    for b, (mine, hf) in enumerate(zip(ours.sequences, theirs, strict=True)):
        for i, (a, h) in enumerate(zip(mine, hf, strict=True)):
            result.total += 1
            result.lengths.append(len(h))
            if a == h:
                result.identical += 1
                if ours.scores is not None and their_scores is not None:
                    sa, sh = ours.scores[b][i], their_scores[b][i]
                    if abs(sa - sh) > rtol * max(abs(sh), 1.0):
                        result.mismatches.append(f"input {b} #{i}: same tokens, scores {sa} vs {sh}")
                continue
            where = f"input {b} #{i}: seqgen {a} vs transformers {h}"
            if settings.mode != "beam":
                result.mismatches.append(where)
                continue
            sa, sh = rescore(model, batch, b, a, settings), rescore(model, batch, b, h, settings)
            if abs(sa - sh) <= rtol * max(abs(sa), abs(sh)):
                result.near_ties.append(f"{where} (scores {sa:.7g} vs {sh:.7g})")
            else:
                unexplained[(b, i)] = (a, f"{where} (scores {sa:.7g} vs {sh:.7g})")
    if unexplained:
        found = tie_sensitive(model, batch, kwargs, {k: a for k, (a, _) in unexplained.items()}, tie_noise)
        for key, (_, where) in unexplained.items():
            if key in found:
                result.near_ties.append(f"{where}: transformers gives it too under {tie_noise:g} noise")
            else:
                result.mismatches.append(where)
    return result


def tune_eos(
    model: PreTrainedModel, batch: Batch, mean_length: float = 8.0, max_new_tokens: int = 24
) -> PreTrainedModel:
    """Make a random model stop at varied lengths (random models otherwise never, or always, emit EOS).

    Adds a bias to the EOS logit (``final_logits_bias`` where the model has one, else a bias on an untied
    copy of the lm head), bisected so that greedy outputs average ``mean_length`` tokens.
    """
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    if hasattr(model, "final_logits_bias"):
        bias = model.final_logits_bias[0]
    else:
        old = model.get_output_embeddings()
        head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.zero_()
        model.set_output_embeddings(head)
        model.config.tie_word_embeddings = False
        bias = head.bias
    lo, hi = -20.0, 20.0
    with torch.inference_mode():
        for _ in range(14):
            mid = (lo + hi) / 2
            bias[eos] = mid
            seqs, _ = hf_generate(model, batch, dict(max_new_tokens=max_new_tokens))
            mean = sum(len(s[0]) for s in seqs) / len(seqs)
            lo, hi = (lo, mid) if mean < mean_length else (mid, hi)
        bias[eos] = (lo + hi) / 2
    return model


def main() -> None:
    """Print the agreement table: ``python -m tests.equivalence [--backend module:factory] [--families ..]``."""
    import argparse
    import importlib

    from tests.engine_models import FAMILIES, load, text_batch
    from tests.tiny_models import cached_build

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument(
        "--backend", default="seqgen_cli.models:get_backend", help="module:callable(model) -> ModelBackend"
    )
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS))
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    module, name = args.backend.split(":")
    factory = getattr(importlib.import_module(module), name)
    print(f"| family | {' | '.join(args.settings)} |")
    print(f"|---|{'---|' * len(args.settings)}")
    notes = []
    for family in args.families:
        loaded = load(cached_build(family))
        batch = text_batch(loaded, args.batch)
        cells = []
        for setting in args.settings:
            r = check_equivalence(loaded.model, factory, batch, SETTINGS[setting])
            cells.append(f"{r.agreement:.1f} %" + (f" ({len(r.near_ties)} tie)" if r.near_ties else ""))
            notes += [f"{family} {setting}: {x}" for x in r.near_ties + r.mismatches]
        print(f"| {family} | {' | '.join(cells)} |", flush=True)
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
