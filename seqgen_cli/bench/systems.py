"""The systems decode mode times: seqgen's ``Generator``, plain transformers ``generate()`` on the same model
object, and CTranslate2 on the converted model. Each turns a batch of token-id lists into the first
output's generated ids per input (EOS kept)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from seqgen_cli.bench import ct2
from seqgen_cli.bench.cells import INT8_REFERENCE_NOTE, dtype_name
from seqgen_cli.errors import SeqgenError
from seqgen_cli.models.reference import strip_generated

if TYPE_CHECKING:
    from seqgen_cli.generator import Generator


class System:
    """A way to generate. ``prepare`` (untimed) converts a batch of token ids into the system's own
    input; ``run`` (timed) generates for it."""

    name = ""
    backend = ""
    measured = True  # False: this system's memory is not measured (CTranslate2 on a GPU)
    notes: Sequence[str] = ()

    def prepare(self, batch: Sequence[Sequence[int]]) -> Any:
        return batch

    def run(self, prepared: Any) -> list[list[int]]:
        raise NotImplementedError


class SeqgenSystem(System):
    """seqgen's ``Generator`` (best backend available: ``fast`` when it can, else ``hf``)."""

    name = "seqgen"

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.backend = gen.backend + (" int8" if gen.loaded.int8 else "")
        self.notes = [] if gen.backend == "fast" else ["seqgen's engine unavailable: backend hf"]

    def run(self, prepared: Sequence[Sequence[int]]) -> list[list[int]]:
        return [seqs[0] for seqs in self.gen.generate_ids(prepared)]


class HFSystem(System):
    """Plain transformers ``generate()`` on the Generator's model, with a copy of its resolved settings; for
    an int8 Generator on ``reference``, the float32 model (the agreement reference)."""

    name = "hf"
    backend = "transformers"

    def __init__(self, gen: Generator, reference: torch.nn.Module | None = None) -> None:
        self.model = reference if reference is not None else gen.loaded.reference
        self.tokenizer = gen.tokenizer
        if reference is not None:
            self.backend, self.notes = "transformers float32", [INT8_REFERENCE_NOTE]
        self.seq2seq, self.device = gen.is_encoder_decoder, gen.loaded.device
        self.config = copy.deepcopy(gen.config)
        self.config.num_return_sequences = 1

    @torch.inference_mode()
    def run(self, prepared: Sequence[Sequence[int]]) -> list[list[int]]:
        ids = {"input_ids": [list(x) for x in prepared]}
        side = "right" if self.seq2seq else "left"
        enc = self.tokenizer.pad(ids, padding_side=side, return_tensors="pt").to(self.device)
        out = self.model.generate(**enc, generation_config=self.config)  # (batch, prompt + new)
        start = 1 if self.seq2seq else enc["input_ids"].shape[1]
        return [strip_generated(row, self.config.eos_token_id) for row in out[:, start:].tolist()]


class Ct2System(System):
    """CTranslate2 ``Translator`` (encoder-decoder) or ``Generator`` (decoder-only): the checkpoint converted
    (or its cached conversion reused) and loaded once on the Generator's device and dtype (a ``SeqgenError``
    when CTranslate2 has no such compute type there); :meth:`use` sets each beam count's settings."""

    name = "ct2"

    def __init__(
        self, model: str, cache: str | None, gen: Generator, threads: int | None, log: Callable[[str], None]
    ) -> None:
        ctranslate2 = ct2.require_ct2()
        device, dtype = gen.loaded.device, dtype_name(gen)
        ct2_device = "cuda" if device.type == "cuda" else "cpu"
        supported = ctranslate2.get_supported_compute_types(ct2_device)
        if dtype not in supported:
            raise SeqgenError(
                f"CTranslate2 has no {dtype} on {ct2_device} (it has {', '.join(sorted(supported))})"
            )
        start = time.perf_counter()
        self.path = ct2.convert(model, Path(cache) if cache else None)
        log(f"ct2 model at {self.path} ({time.perf_counter() - start:.1f}s)")
        cls = ctranslate2.Translator if gen.is_encoder_decoder else ctranslate2.Generator
        kwargs: dict[str, Any] = {"device": ct2_device, "compute_type": dtype}
        if ct2_device == "cpu":
            kwargs["intra_threads"] = threads or torch.get_num_threads()
        elif device.index is not None:
            kwargs["device_index"] = device.index
        self.translator = cls(str(self.path), **kwargs)
        self.vocab = ct2.vocabulary(self.path)
        self.index = {t: i for i, t in enumerate(self.vocab)}
        self.tokenizer, self.seq2seq = gen.tokenizer, gen.is_encoder_decoder
        self.backend = f"ctranslate2 {ctranslate2.__version__}" + (" int8" if dtype == "int8" else "")
        self.measured = ct2_device == "cpu"

    def use(self, gen: Generator) -> ct2.Ct2Plan:
        """Generate with ``gen``'s resolved settings from now on; returns their plan."""
        self.plan = ct2.plan_for(gen, self.path, self.vocab)
        self.notes = list(self.plan.notes)
        return self.plan

    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[str]]:
        """Token ids to the token strings CTranslate2 takes."""
        return [self.tokenizer.convert_ids_to_tokens(list(x)) for x in batch]

    def run(self, prepared: list[list[str]]) -> list[list[int]]:
        p = self.plan
        if self.seq2seq:
            prefix = [p.prefix] * len(prepared) if p.prefix else None
            results = self.translator.translate_batch(prepared, target_prefix=prefix, **p.options)
            hyps = [list(r.hypotheses[0]) for r in results]
        else:
            hyps = [list(r.sequences[0]) for r in self.translator.generate_batch(prepared, **p.options)]
        out = []
        for hyp in hyps:
            if p.append_eos and not (hyp and hyp[-1] in p.eos):
                hyp.append(p.append_eos)
            out.append([self.index.get(t, -1) for t in hyp])
        return out
