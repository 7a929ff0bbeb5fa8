"""Equivalence harness: seqgen's engine vs transformers ``generate()``, token for token, in float32.

Reusable for any backend: :func:`check_equivalence` takes a ``backend_factory(model) -> ModelBackend``.

Greedy must agree 100 %. Beam search must agree 100 % except where a *near-tie* explains a difference, as
``seqgen_cli.verify.compare`` (the package's ``--verify``) names them: re-scored sequences within ``rtol``, or
a sequence transformers itself returns under log-prob noise of ``tie_noise``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models.reference import hf_generate
from seqgen_cli.search import Batch, ModelBackend, generate
from seqgen_cli.search.refill import RefillStats, generate_refill
from seqgen_cli.verify import Agreement, compare, rescore

Engine = Callable[[ModelBackend, Batch, Any], Any]  # seqgen's entry point: (backend, batch, config) -> outputs

__all__ = ["SETTINGS", "check_equivalence", "hf_generate", "refill", "rescore", "tune_eos"]

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


# One tolerance per numerical cause, named once:
# - a step that sums attention over padded, masked positions (the static/captured step, the refill engine's span
#   bucket) adds in another order than generate()'s dynamic step: beam scores agree to ~1e-5 relative (1.3e-5
#   seen on Marian, 1.2e-5 on Pegasus, CPU-dependent), so scores and re-scored ties are held to 1e-4;
MASKED_SUM_RTOL = 1e-4
# - one log-prob per generated token, each rounded through the decoder's layers (a batch padded otherwise, another
#   kernel): a sequence's summed log-prob adds their rounding, held to this relative bound times its length
#   (seqgen_cli.verify's rtol: 1.2e-5 over 48 tokens on AVX-512);
TOKEN_SUM_RTOL = 1e-5
# - inductor's fused kernels reassociate the same sums: its logits against eager's, relative and absolute.
COMPILED_TOL = 1e-4
# - the same products summed in another order (oneDNN against MKL's GEMM) through a whole encoder: each product
#   rounds ~1e-6 relative, accumulated over the layers, its hidden states held relative and absolute.
SUMMATION_RTOL, SUMMATION_ATOL = 1e-4, 1e-5


def check_equivalence(
    model: PreTrainedModel,
    backend_factory: BackendFactory,
    batch: Batch,
    kwargs: dict[str, Any],
    *,
    rtol: float = 1e-5,
    tie_noise: float = 1e-5,
    keep_dtype: bool = False,
    engine: Engine = generate,
) -> Agreement:
    """Run seqgen (via ``backend_factory(model)``) and ``model.generate()`` on ``batch``; compare tokens.

    The model runs in float32 unless ``keep_dtype``. ``engine(backend, batch, config)``: seqgen's entry point
    (default :func:`seqgen_cli.search.generate`; the refill engine: :func:`refill`).
    """
    model = (model if keep_dtype else model.float()).eval()
    config = resolve_generation_config(model.generation_config, None, kwargs)
    ours = engine(backend_factory(model), batch, config)
    return compare(model, batch, kwargs, ours.sequences, ours.scores, rtol=rtol, tie_noise=tie_noise)


def refill(lanes: int, seed: int, min_free: int = 1, stats: RefillStats | None = None) -> Engine:
    """The refill engine (``search/refill.py``) as :func:`check_equivalence` calls an engine: inputs join in a
    shuffled order."""

    def engine(backend: ModelBackend, batch: Batch, config: Any) -> Any:
        order = list(range(batch.input_ids.shape[0]))
        random.Random(seed).shuffle(order)
        return generate_refill(backend, batch, config, lanes=lanes, order=order, min_free=min_free, stats=stats)

    return engine


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
            seqs = hf_generate(model, batch, dict(max_new_tokens=max_new_tokens)).sequences
            mean = sum(len(s[0]) for s in seqs) / len(seqs)
            lo, hi = (lo, mid) if mean < mean_length else (mid, hi)
        bias[eos] = (lo + hi) / 2
    return model


def main() -> None:
    """Print the agreement table: ``python -m tests.equivalence [--backend module:factory] [--families ..]``."""
    import argparse
    import importlib

    from tests.tiny_models import FAMILIES, cached_build, load, text_batch

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
