"""The systems decode mode times, all on the same tokenised batches: seqgen's ``Generator``, plain
transformers ``generate()`` on the same model object, and CTranslate2 on the converted model.

Each turns a batch of token-id lists into the first output's generated ids per input (EOS kept).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from seqgen_cli.bench import ct2
from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import strip_generated

if TYPE_CHECKING:
    from seqgen_cli.generator import Generator


class System:
    """A way to generate. ``prepare`` (untimed) converts a batch of token ids into the system's own
    input; ``run`` (timed) generates for it."""

    name = ""
    backend = ""
    mem_kind = "rss"  # "n/a": this system's memory is not measured (CTranslate2 on a GPU)
    notes: list[str]

    def prepare(self, batch: Sequence[Sequence[int]]) -> Any:
        return batch

    def run(self, prepared: Any) -> list[list[int]]:
        raise NotImplementedError


class SeqgenSystem(System):
    """seqgen's ``Generator`` (best backend available: ``fast`` when it can, else ``hf``)."""

    name = "seqgen"

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.backend = gen.backend
        self.notes = [] if gen.backend == "fast" else ["seqgen's engine unavailable: backend hf"]

    def run(self, prepared: Sequence[Sequence[int]]) -> list[list[int]]:
        return [seqs[0] for seqs in self.gen.generate_ids(prepared)]


class HFSystem(System):
    """Plain transformers ``generate()`` on the Generator's model, with a copy of its resolved settings."""

    name = "hf"
    backend = "transformers"

    def __init__(self, gen: Generator) -> None:
        self.model, self.tokenizer = gen.model, gen.tokenizer
        self.seq2seq, self.device = gen.is_encoder_decoder, gen.loaded.device
        self.config = copy.deepcopy(gen.config)
        self.config.num_return_sequences = 1
        self.notes = []

    @torch.inference_mode()
    def run(self, prepared: Sequence[Sequence[int]]) -> list[list[int]]:
        side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "right" if self.seq2seq else "left"
        try:
            enc = self.tokenizer.pad({"input_ids": [list(x) for x in prepared]}, return_tensors="pt")
        finally:
            self.tokenizer.padding_side = side
        enc = enc.to(self.device)
        out = self.model.generate(**enc, generation_config=self.config)  # (batch, prompt + new)
        start = 1 if self.seq2seq else enc["input_ids"].shape[1]
        return [strip_generated(row, self.config.eos_token_id) for row in out[:, start:].tolist()]


@dataclass
class Ct2Model:
    """A converted model loaded once: the engine (``Translator`` or ``Generator``), its folder and vocabulary."""

    engine: Any
    path: Path
    vocab: list[str]


def load_ct2_model(
    model: str, cache: str | None, gen: Generator, threads: int | None, log: Callable[[str], None]
) -> Ct2Model:
    """Convert (or reuse the cached conversion of) ``model`` and load it on the Generator's device."""
    ctranslate2 = ct2.require_ct2()
    device = gen.loaded.device
    ct2_device = "cuda" if device.type == "cuda" else "cpu"
    start = time.perf_counter()
    path = ct2.convert(model, Path(cache) if cache else None)
    log(f"ct2 model at {path} ({time.perf_counter() - start:.1f}s)")
    cls = ctranslate2.Translator if gen.is_encoder_decoder else ctranslate2.Generator
    kwargs: dict[str, Any] = {"device": ct2_device, "compute_type": _dtype(gen)}
    if ct2_device == "cpu":
        kwargs["intra_threads"] = threads or torch.get_num_threads()
    elif device.index is not None:
        kwargs["device_index"] = device.index
    return Ct2Model(cls(str(path), **kwargs), path, ct2.vocabulary(path))


def check_compute_type(gen: Generator) -> None:
    """A ``SeqgenError`` when CTranslate2 has no compute type matching the Generator's dtype and device."""
    ctranslate2 = ct2.require_ct2()
    dtype = _dtype(gen)
    ct2_device = "cuda" if gen.loaded.device.type == "cuda" else "cpu"
    supported = ctranslate2.get_supported_compute_types(ct2_device)
    if dtype not in supported:
        raise SeqgenError(
            f"CTranslate2 has no {dtype} on {ct2_device} (it has {', '.join(sorted(supported))})"
        )


def _dtype(gen: Generator) -> str:
    return str(gen.loaded.dtype).replace("torch.", "")


class Ct2System(System):
    """CTranslate2 ``Translator`` (encoder-decoder) or ``Generator`` (decoder-only) on the converted model."""

    name = "ct2"

    def __init__(self, model: Ct2Model, plan: ct2.Ct2Plan, tokenizer: Any, seq2seq: bool) -> None:
        import ctranslate2

        self.engine, self.plan, self.tokenizer, self.seq2seq = model.engine, plan, tokenizer, seq2seq
        self.index = {t: i for i, t in enumerate(model.vocab)}
        self.backend = f"ctranslate2 {ctranslate2.__version__}"
        self.notes = list(plan.notes)
        self.mem_kind = "rss" if self.engine.device == "cpu" else "n/a"

    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[str]]:
        """Token ids to the token strings CTranslate2 takes."""
        return [self.tokenizer.convert_ids_to_tokens(list(x)) for x in batch]

    def run(self, prepared: list[list[str]]) -> list[list[int]]:
        p = self.plan
        if self.seq2seq:
            prefix = [p.prefix] * len(prepared) if p.prefix else None
            results = self.engine.translate_batch(prepared, target_prefix=prefix, **p.options)
            hyps = [list(r.hypotheses[0]) for r in results]
        else:
            hyps = [list(r.sequences[0]) for r in self.engine.generate_batch(prepared, **p.options)]
        out = []
        for hyp in hyps:
            if p.append_eos and not (hyp and hyp[-1] in p.eos):
                hyp.append(p.append_eos)
            out.append([self.index.get(t, -1) for t in hyp])
        return out
