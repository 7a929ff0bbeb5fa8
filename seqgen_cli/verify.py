"""Agreement with transformers' ``generate()``: ``--verify`` on the user's device, and the equivalence suite.

:func:`compare` runs ``generate()`` on a batch and compares seqgen's outputs with it, token for token. A
difference counts as a *near-tie* when one of two things explains it:

* the two sequences, re-scored by teacher forcing under the same processors and length penalty
  (:func:`rescore`; greedy: up to the first differing token), score within ``rtol`` of each other;
* beam search: ``generate()`` itself returns seqgen's sequence once its log-probs carry noise of
  ``tie_noise`` (seeds 0-4). A beam that loses or survives the top-K cut by less than that margin changes the
  rest of the search, so such a difference says nothing about the backend's arithmetic.

:func:`verify` is ``--verify N``: the first N inputs through the Generator's own path (backend, capture,
device, dtype) and through ``generate()``, with tolerances scaled to the dtype (:func:`tolerance`). Sampling
draws differ from ``generate()``'s by design, so sampling settings are not compared. :func:`self_check` runs it
on a job's first records before the job writes anything.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from seqgen_cli.batching import Input, free_device_memory
from seqgen_cli.errors import SeqgenError, is_oom
from seqgen_cli.models.reference import Generation, hf_generate
from seqgen_cli.search import Batch
from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.processors import LogitsPipeline
from seqgen_cli.search.settings import SearchSettings, settings_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from seqgen_cli.generator import Generator

VERIFY_INPUTS = 8  # --verify's default on CUDA


@dataclass
class Agreement:
    """How seqgen's returned sequences compare with ``generate()``'s."""

    total: int = 0  # returned sequences compared
    identical: int = 0
    near_ties: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # differences no near-tie explains
    differing: list[str] = field(default_factory=list)  # the inputs of the mismatches (names, once each)
    lengths: list[int] = field(default_factory=list)  # generate()'s output lengths (is the check meaningful?)
    note: str | None = None  # why nothing was compared

    @property
    def agreement(self) -> float:
        """Token-identical share, in percent."""
        return 100.0 * self.identical / max(self.total, 1)

    def summary(self) -> str:
        return (
            f"{self.identical}/{self.total} identical ({self.agreement:.1f} %), "
            f"{len(self.near_ties)} near-tie(s), {len(self.mismatches)} unexplained; "
            f"lengths {min(self.lengths, default=0)}..{max(self.lengths, default=0)} "
            f"(mean {sum(self.lengths) / max(len(self.lengths), 1):.1f})"
        )

    def line(self) -> str:
        """For the closing line: ``verify 7/8 identical (1 near-tie)``, ``verify: <note>``."""
        if self.note is not None:
            return f"verify: {self.note}"
        notes = (
            [f"{len(self.near_ties)} near-tie{'s' * (len(self.near_ties) != 1)}"] if self.near_ties else []
        )
        if self.mismatches:
            notes.append(f"{len(self.mismatches)} differ")
        return f"verify {self.identical}/{self.total} identical" + (f" ({', '.join(notes)})" if notes else "")

    def as_dict(self) -> dict[str, Any]:
        """For ``--stats``."""
        return {**asdict(self), "share": round(self.agreement, 2)}

    def add(self, other: Agreement) -> None:
        """``other``'s comparisons (another batch of the same check) counted in this one."""
        self.total, self.identical = self.total + other.total, self.identical + other.identical
        self.near_ties += other.near_ties
        self.mismatches += other.mismatches
        self.differing = list(dict.fromkeys(self.differing + other.differing))
        self.lengths += other.lengths


def tolerance(dtype: torch.dtype) -> float:
    """Relative score difference (and log-prob noise) taken for a near-tie: 1e-5 in float32 (rounding across a
    decoder's layers), a few units of the last place in half precision."""
    return max(1e-5, 4 * torch.finfo(dtype).eps)


def resolved(model: PreTrainedModel, generation: Generation) -> GenerationConfig:
    """``generation`` as a config: keyword arguments over the model's own ``generation_config``."""
    from seqgen_cli.config import resolve_generation_config

    if isinstance(generation, GenerationConfig):
        return generation
    return resolve_generation_config(model.generation_config, None, generation)


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


def rescored(
    model: PreTrainedModel, batch: Batch, b: int, a: Sequence[int], h: Sequence[int], settings: SearchSettings
) -> tuple[float, float]:
    """The re-scores (:func:`rescore`) of two outputs of input ``b`` that differ: whole under beam search, else up
    to their first differing token (greedy: that token decides). Within the dtype's tolerance: a near-tie."""
    upto = len(a) if settings.mode == "beam" else first_difference(a, h) + 1
    return rescore(model, batch, b, list(a[:upto]), settings), rescore(model, batch, b, list(h[:upto]), settings)


class LogProbNoise(LogitsProcessor):
    """Adds seeded Gaussian noise of size ``eps`` to the (log-prob) scores of every step."""

    def __init__(self, eps: float, seed: int) -> None:
        self.eps, self.gen = eps, torch.Generator().manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(scores.shape, generator=self.gen).to(scores.device, scores.dtype)
        return scores + self.eps * noise


def tie_sensitive(
    model: PreTrainedModel,
    batch: Batch,
    generation: Generation,
    wanted: dict[tuple[int, int], list[int]],
    eps: float,
    seeds: int = 5,
    tokenizer: Any = None,
) -> dict[tuple[int, int], int]:
    """Which ``(input, rank) -> sequence`` ``generate()`` also returns under log-prob noise ``eps``: -> seed
    (``tokenizer``: for ``stop_strings``)."""
    found: dict[tuple[int, int], int] = {}
    for seed in range(seeds):
        noise = LogitsProcessorList([LogProbNoise(eps, seed)])
        seqs = hf_generate(model, batch, generation, logits_processor=noise, tokenizer=tokenizer).sequences
        for (b, i), tokens in wanted.items():
            if (b, i) not in found and seqs[b][i] == tokens:
                found[(b, i)] = seed
        if len(found) == len(wanted):
            break
    return found


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(
    model: PreTrainedModel,
    batch: Batch,
    generation: Generation,
    ours: list[list[list[int]]],
    our_scores: list[list[float]] | None = None,
    *,
    rtol: float = 1e-5,
    tie_noise: float = 1e-5,
    names: Sequence[str] | None = None,
    tokenizer: Any = None,
) -> Agreement:
    """Run ``generate()`` on ``batch`` and compare ``ours`` (per input, the returned sequences) with it.

    ``our_scores``: beam scores to check where the tokens agree; ``names``: what to call each input in the
    notes (default ``input <i>``); ``tokenizer``: generate()'s, for ``stop_strings``."""
    reference = hf_generate(model, batch, generation, tokenizer=tokenizer)
    theirs, their_scores = reference.sequences, reference.scores
    settings = settings_for(model.config, batch, resolved(model, generation))
    names = [f"input {b}" for b in range(len(ours))] if names is None else names
    result = Agreement()
    unexplained: dict[tuple[int, int], tuple[list[int], str]] = {}
    for b, (mine, hf) in enumerate(zip(ours, theirs, strict=True)):
        for i, (a, h) in enumerate(zip(mine, hf, strict=True)):
            result.total += 1
            result.lengths.append(len(h))
            if a == h:
                result.identical += 1
                if our_scores is not None and their_scores is not None:
                    sa, sh = our_scores[b][i], their_scores[b][i]
                    # one log-prob per token, each rounded through the decoder's layers (rtol): their
                    # rounding adds up over the sequence (measured 1.2e-5 over 48 tokens on AVX-512, not on AVX2)
                    if abs(sa - sh) > rtol * max(len(h), 1) * max(abs(sh), 1.0):
                        result.mismatches.append(f"{names[b]} #{i}: same tokens, scores {sa} vs {sh}")
                        result.differing.append(names[b])
                continue
            k = first_difference(a, h)
            where = f"{names[b]} #{i}: from token {k}: seqgen {a} vs transformers {h}"
            if settings.mode == "sample":
                result.mismatches.append(where)
                result.differing.append(names[b])
                continue
            sa, sh = rescored(model, batch, b, a, h, settings)
            where += f" (scores {sa:.7g} vs {sh:.7g})"
            if abs(sa - sh) <= rtol * max(abs(sa), abs(sh)):
                result.near_ties.append(where)
            elif settings.mode == "beam":
                unexplained[(b, i)] = (a, where)
            else:
                result.mismatches.append(where)
                result.differing.append(names[b])
    if unexplained:
        found = tie_sensitive(
            model, batch, generation, {k: a for k, (a, _) in unexplained.items()}, tie_noise, tokenizer=tokenizer
        )
        for key, (_, where) in unexplained.items():
            if key in found:
                result.near_ties.append(f"{where}: transformers gives it too under {tie_noise:g} noise")
            else:
                result.mismatches.append(where)
                result.differing.append(names[key[0]])
    result.differing = list(dict.fromkeys(result.differing))
    return result


def default_inputs(device: torch.device) -> int:
    """``--verify``'s default: :data:`VERIFY_INPUTS` on CUDA, none elsewhere (the CPU float32 path is the one
    the equivalence suite checks)."""
    return VERIFY_INPUTS if device.type == "cuda" else 0


def batches_as_run(gen: Generator, ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """Positions of ``ids`` in the batches :func:`verify` compares: one batch, or, where the model's outputs
    depend on the padding and the lengths beside them (``Generator.exact_widths``), one per length, as the run
    batches them (an input among inputs of other lengths would get other tokens than it gets in the run)."""
    if not gen.exact_widths:
        return [list(range(len(ids)))]
    by_length: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
        by_length.setdefault(len(x), []).append(i)
    return list(by_length.values())


def beyond_ties(
    gen: Generator, ids: Sequence[Sequence[int]], ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]
) -> list[int]:
    """The inputs whose output ``ours[i]`` (another system's: token ids, -1 for a token outside the tokenizer's
    vocabulary) differs from ``generate()``'s ``theirs[i]`` beyond a near-tie: each re-scored alone through
    transformers' model (:func:`rescore`; greedy up to the first differing token), further apart than the
    dtype's :func:`tolerance`."""
    model, tol, out = gen.loaded.reference, tolerance(gen.loaded.dtype), []
    for i, (a, h) in enumerate(zip(ours, theirs, strict=True)):
        if list(a) == list(h):
            continue
        if min(a, default=0) < 0:  # a token transformers' tokenizer does not have
            out.append(i)
            continue
        batch = gen.pad([ids[i]])
        with torch.inference_mode():
            sa, sh = rescored(model, batch, 0, a, h, settings_for(model.config, batch, gen.config))
        if abs(sa - sh) > tol * max(abs(sa), abs(sh)):
            out.append(i)
    return out


def verify(
    gen: Generator,
    ids: Sequence[Sequence[int]],
    names: Sequence[str] | None = None,
    breaks: Sequence[Sequence[int]] | None = None,
) -> Agreement:
    """``ids`` (a batch of token ids, or its batches as the run cuts them: :func:`batches_as_run`) through the
    Generator's own path (``breaks``: each prompt's, as the run has them) and through ``generate()`` on the same
    device and dtype; near-ties within the dtype's :func:`tolerance`."""
    if gen.backend != "fast":
        return Agreement(note="the backend is generate() itself")
    if gen.loaded.int8:
        return Agreement(note="int8 is not exact")
    if not ids:
        return Agreement(note="no inputs")
    batch = gen.pad(ids)
    if settings_for(gen.model.config, batch, gen.config).mode == "sample":
        return Agreement(note="sampling draws differ from generate()'s")
    if gen.grammars.used:  # --backend hf runs the same grammar; tests/search/test_grammar.py holds the two equal
        return Agreement(note="structured outputs are not checked here")
    tol = tolerance(gen.loaded.dtype)
    names = [f"input {i}" for i in range(len(ids))] if names is None else names
    try:
        agreement = Agreement()
        for group in batches_as_run(gen, ids):
            part = [ids[i] for i in group]
            ours = gen.generate_output(part, breaks=[breaks[i] for i in group] if breaks else ()).sequences
            with torch.inference_mode():
                agreement.add(
                    compare(
                        gen.loaded.reference,
                        gen.pad(part),
                        gen.config,
                        ours,
                        rtol=tol,
                        tie_noise=tol,
                        names=[names[i] for i in group],
                        tokenizer=gen.tokenizer,
                    )
                )
        return agreement
    except Exception as err:  # noqa: BLE001 - out of memory: reported, the run goes on (and splits batches)
        if not is_oom(err):
            raise
    free_device_memory()
    return Agreement(note=f"out of memory checking {len(ids)} inputs")


class Record(Input, Protocol):
    """What :func:`self_check` reads of an input as read (a pipeline record): an :class:`~seqgen_cli.batching.Input`
    and why it is bad (``None``: it is not)."""

    @property
    def error(self) -> str | None: ...


R = TypeVar("R", bound=Record)


def self_check(
    gen: Generator, records: Iterator[R], inputs: int | None = None, strict: bool = False
) -> tuple[Iterator[R], dict[str, Any] | None]:
    """``--verify N`` (``inputs``; None: :func:`default_inputs`): the first N records through seqgen and through
    ``generate()`` (:func:`verify`); returns the records, those read ahead put back, and the report for
    ``--stats`` (``None``: not checked). ``strict`` (``--verify strict``) raises when they differ beyond
    near-ties, before anything is written."""
    n = default_inputs(gen.loaded.device) if inputs is None else inputs
    if n <= 0:
        return records, None
    head: list[R] = []
    try:
        for record in records:
            head.append(record)
            if len(head) == n:
                break
    except Exception as err:  # noqa: BLE001 - a bad line: check what came before it; the run raises there
        records = _replayed(head, err)
    else:
        records = itertools.chain(head, records)
    usable = [r for r in head if r.error is None and r.text.strip()]
    t0 = time.perf_counter()
    encoded = gen.encode([r.text for r in usable], [getattr(r, "fields", None) for r in usable]) if usable else []
    usable = [r for r, e in zip(usable, encoded, strict=True) if e.error is None]  # the run names the others
    ids = [e.ids for e in encoded if e.error is None]
    breaks = [e.breaks for e in encoded if e.error is None]
    agreement = verify(gen, ids, names=[r.where for r in usable], breaks=breaks)
    if strict and agreement.mismatches:
        where = ", ".join(agreement.differing[:3]) + (", ..." if len(agreement.differing) > 3 else "")
        raise SeqgenError(
            f"--verify strict: seqgen and generate() differ beyond near-ties on {len(agreement.differing)} of "
            f"{len(usable)} inputs ({where}); nothing written"
        )
    return records, {**agreement.as_dict(), "line": agreement.line(), "seconds": time.perf_counter() - t0}


def _replayed(head: list[R], err: Exception) -> Iterator[R]:
    yield from head
    raise err
