"""The Python API: ``Generator`` turns texts (or token ids) into generated texts (or token ids).

    gen = Generator("path/to/checkpoint", preset="cnndm-bart")
    outputs = gen.generate(["first article ...", "second article ..."])   # list[list[str]]

Three layers, as CTranslate2's ``translate_batch`` / ``translate_iterable`` / ``translate_file``:
``generate_ids(batch)`` runs one batch of token ids; ``generate_iterable(texts)`` streams any number of
texts through length-sorted, token-budget batches (``seqgen_cli.batching``) with out-of-memory splitting;
the file pipeline (``seqgen_cli.pipeline``) adds reader and writer threads, input order and resume on top.
Both run their batches through ``generate_batches``, the one generate loop.

Backends: ``hf`` is plain transformers ``generate()`` (the reference); ``fast`` is seqgen's own
decoding engine over the model (per-family fast decoders where they exist, a generic one otherwise);
``auto`` picks ``fast`` when the settings are ones the engine supports, else ``hf``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from seqgen_cli import startup
from seqgen_cli.batching import (
    DEFAULT_BATCH_SIZE,
    Batcher,
    Chunk,
    Encoded,
    Generated,
    InOrder,
    Item,
    ItemBatch,
    Result,
    Scored,
    default_window,
    generate_split,
    pad_ids,
    text_chunks,
)
from seqgen_cli.budget import DeviceBudget, out_of_memory
from seqgen_cli.config import (
    Preset,
    all_stops,
    check_checkpoint,
    check_flags,
    default_length,
    load_preset,
    settings_for_model,
)
from seqgen_cli.errors import SeqgenError
from seqgen_cli.grammars import Grammars, GrammarSpec
from seqgen_cli.languages import check_target, resolve_target_prefix
from seqgen_cli.loading import Loaded, load, source_limit
from seqgen_cli.memory import batch_bytes
from seqgen_cli.prompts import Prompter, PromptSettings, stop_check
from seqgen_cli.search import choose_backend
from seqgen_cli.search import settings as search_settings
from seqgen_cli.search.protocol import Batch, RefillBackend, SearchOutput
from seqgen_cli.search.refill import RefillStats
from seqgen_cli.shapes import input_width

BACKENDS = ("auto", "fast", "hf")

# a batch's inputs -> (those whose outputs the caller has: not generated; the rest)
Known = Callable[[list[Item]], tuple[list[Item], list[Item]]]


@dataclass
class BatchResults:
    """One batch through :meth:`Generator.generate_batches`."""

    batch: ItemBatch
    results: list[Result]  # of the inputs generated, in the batch's order (an error: failed alone)
    known: list[Item]  # the inputs ``known`` answered: not generated
    seconds: float  # spent generating


class Generator:
    """A loaded model with resolved generation settings."""

    def __init__(
        self,
        model: str,
        *,
        backend: str = "auto",
        device: str | None = None,
        dtype: str | None = None,
        preset: str | Preset | None = None,
        prefix: str | None = None,
        max_source_length: int | None = None,
        seed: int | None = None,
        capture: bool | None = None,
        refill: bool = False, lanes: int = 32, lane_tokens: int | None = None,  # fmt: skip
        target_lang: str | None = None,
        prompt: PromptSettings | None = None,
        stop: Sequence[str] = (),
        scores: bool = False,
        grammar: GrammarSpec | None = None,
        **generation: Any,
    ) -> None:
        """``capture``: on CUDA, the fast backends' decode step as CUDA graphs (``models/capture.py``), each shape
        compiled once its eager steps pay for it (``None``), at once (``True``) or never (``False``; ``step_path``).
        ``refill``: run the fast engine over ``lanes`` fixed input lanes that finished inputs hand to waiting ones,
        at most ``lane_tokens`` padded source tokens x rows over them (``search/refill.py``; the fast backends'
        families, float32/half: elsewhere batches run as without it). ``target_lang``: a tokenizer's language code
        or language (``de_DE``, ``deu_Latn``, ``de``): ``forced_bos_token_id``, OPUS-MT's ``>>deu<<`` before each input.
        ``prompt``: how an input becomes its prompt (``prompts.py``); ``stop``: stop strings beside the checkpoint's.
        ``scores``: each output's :class:`~.batching.Scored` (``output_scores``: greedy and sampling gather them).
        ``grammar``: every output a match of it (structured outputs, ``grammars.py``)."""
        if backend not in BACKENDS:
            raise SeqgenError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
        self.preset = load_preset(preset) if isinstance(preset, str) else preset
        flags = check_flags(generation)  # the settings given, checked before the (slow) model load
        check_target(target_lang, flags)  # before the model loads
        self.target_lang = target_lang
        check_checkpoint(model, self.preset, flags, stop)  # its generation_config.json, before the weights are read
        self.loaded: Loaded = load(model, device, dtype, own=backend != "hf")  # own: the fast engine's tree
        self.tokenizer, self.model = self.loaded.tokenizer, self.loaded.model
        self.is_encoder_decoder = self.loaded.is_encoder_decoder
        lang_prefix = resolve_target_prefix(self.tokenizer, target_lang)  # OPUS-MT: >>code<< tokens, no forced BOS
        self.config = settings_for_model(self.model, self.tokenizer, self.preset, flags, None if lang_prefix else target_lang)
        self.config.stop_strings = all_stops(self.config.stop_strings, stop)  # the checkpoint's, then --stop's
        self.config.output_scores = scores or "logprobs" in flags  # not the checkpoint's: the output is the caller's
        self.stop_check = stop_check(self.tokenizer, self.config.stop_strings)  # once: its tables take a while
        self.grammars = Grammars(grammar, self.tokenizer, self.model, self.config)  # the run's, each JSONL schema's
        self.grammar = self.grammars.run
        self.prompt = prompt_settings(prompt, prefix, self.preset, lang_prefix)
        self.prefix = self.prompt.prefix
        self.prompter = Prompter(self.prompt, self.tokenizer)  # a chat template that cannot render fails here
        self.max_source_length = self._source_limit(max_source_length or getattr(self.preset, "max_source_length", None))
        self.default_length = default_length(self.config)  # transformers' 20 new tokens, set by nobody
        self.seed = seed
        if seed is not None:
            torch.manual_seed(seed)
        from seqgen_cli.models import engine_refusal, length_dependent_rope

        refused = engine_refusal(self.model.config)  # a model no engine of seqgen's runs (generate() does)
        self.backend, self.fallback = choose_backend(backend, self.config, refused)  # fallback: why auto: hf
        # outputs that depend on the padding and the neighbours' lengths (generate()'s too): run unpadded (width)
        self.exact_widths = length_dependent_rope(self.model.config)
        if self.backend != "fast":  # generate() runs transformers' model
            self.model = self.loaded.use_reference()
        self.capture, self.lanes, self.lane_tokens = capture, lanes, lane_tokens  # refill: lanes, tokens x rows
        self.refill_stats = RefillStats()
        self._model_backend = None  # the engine's model backend, built on first use (int8: now)
        self._step_path = ""  # how the engine runs its decode step (see step_path)
        self.budget = DeviceBudget.read(self.loaded.device)  # what batches and the kept states are held to
        self._sizing: Any = None  # generate()'s caches as the generic backend counts them (hf backend)
        if self.loaded.int8:  # --dtype int8: the int8 fast backend, or transformers' model quantized in place
            from seqgen_cli.models import to_int8

            if (int8_backend := to_int8(self.model, fast=self.backend == "fast", head=self.prompter.head())) is not None:
                self._engine(int8_backend)
        # --refill where the engine has lanes (a fast family's RefillBackend; a CapturedBackend wraps only those)
        fast = self.backend == "fast" and not self.loaded.int8
        self.refill = refill and fast and isinstance(self._engine(), RefillBackend)
        self.input_rows = input_rows(self.model)  # an input id past them is a bad input (encode)

    # -- settings ---------------------------------------------------------------------------------

    def _source_limit(self, requested: int | None) -> int | None:
        """The longest input the model takes (:func:`~seqgen_cli.loading.source_limit`)."""
        new_tokens = 0 if self.is_encoder_decoder else self.new_token_limits()[0]
        return source_limit(self.model.config, self.tokenizer, requested, new_tokens)

    @property
    def num_return_sequences(self) -> int:
        """Outputs per input."""
        return search_settings.num_return_sequences(self.config)

    @property
    def buckets(self) -> bool:
        """One width bucket per batch (:meth:`width`), unless inputs run at their own widths: refill and the fast
        encoder-decoder decoders (``models.own_widths``; the generic backend pads to the widest, as generate())."""
        from seqgen_cli.models import own_widths

        if self.exact_widths or self.refill:
            return bool(self.exact_widths)
        return not (self.backend == "fast" and own_widths(self._engine()))

    def width(self, length: int) -> int:
        """An input's batching width: its bucket's (:func:`~seqgen_cli.shapes.input_width`), or its own length where
        outputs depend on the padding and the neighbours' lengths (``exact_widths``): each one ``generate()``'s alone."""
        return length if self.exact_widths else input_width(length)

    @property
    def rows_per_input(self) -> int:
        """Rows the model runs per input: beams, or returned sequences when more (sampling)."""
        return search_settings.rows_per_input(self.config)

    def new_token_limits(self, prompt_len: int = 0) -> tuple[int, int]:
        """Most and fewest new tokens for a prompt of ``prompt_len`` tokens (ignored for encoder-decoder models)."""
        return search_settings.new_token_limits(self.config, self.is_encoder_decoder, prompt_len)

    def _engine(self, backend: Any = None) -> Any:
        """The engine's model backend (built on first use, or ``backend``), behind the capture path."""
        from seqgen_cli.models import get_backend
        from seqgen_cli.models.capture import CapturedBackend, capture

        if self._model_backend is None:
            with startup.stage("fast backend"):  # head: what every prompt begins with, computed once
                backend = get_backend(self.model, head=self.prompter.head()) if backend is None else backend
            self._model_backend, self._step_path = capture(backend, self.loaded.device, self.capture)
            if isinstance(self._model_backend, CapturedBackend):  # its kept states, held against this budget
                self._model_backend.pool.budget = self.budget
        return self._model_backend

    @property
    def step_path(self) -> str:
        """How decode steps run: ``captured`` (CUDA graphs), ``eager (<reason>)``; ``generate()`` (hf backend)."""
        from seqgen_cli.models.capture import CapturedBackend

        if self.backend != "fast":
            return "generate()"
        engine = self._engine()
        return engine.path if isinstance(engine, CapturedBackend) else self._step_path  # path: may fall back

    @property
    def memory_budget(self) -> int | None:  # bytes a batch may hold (README): budget.limit; None: no limit
        return self.budget.limit

    @memory_budget.setter
    def memory_budget(self, limit: int | None) -> None:
        self.budget.limit = limit

    def batch_bytes(self, inputs: int, width: int) -> int | None:
        """Device memory a batch of ``inputs`` inputs padded to ``width`` tokens holds while it decodes
        (:func:`~.memory.batch_bytes`; ``generate()``'s as the generic backend counts it); ``None``: cannot say."""
        from seqgen_cli.models.generic import GenericBackend

        if self.backend == "fast":
            backend = self._engine()
        elif not isinstance(backend := self._sizing, GenericBackend):
            backend = self._sizing = GenericBackend(self.model)
        new_tokens = self.new_token_limits(width)[0]
        return batch_bytes(backend, self.model, self.config, inputs, width, self.rows_per_input, new_tokens)

    def out_of_memory(self, tokens: int) -> str:
        """Why one input of ``tokens`` tokens ran out of memory alone (:func:`~.budget.out_of_memory`)."""
        width = input_width(tokens, self._source_limit(None))
        return out_of_memory(self.batch_bytes(1, width), self.new_token_limits(width)[0], self.loaded.device)

    # -- tokens -----------------------------------------------------------------------------------
    def encode(self, texts: Sequence[str], fields: Sequence[Any] | None = None) -> list[Encoded]:
        """Each input's prompt tokens (``prompts.Prompter``: prefix, template, chat template; ``fields``: each one's
        JSONL object), at most ``max_source_length``; ``error``: why an input has none (a bad input)."""
        fields = fields or [None] * len(texts)
        prompted = self.prompter.encode(texts, fields, self.max_source_length)
        rows, config = self.input_rows, self.model.config
        encoded = [
            Encoded(p.ids, p.truncated, p.error or unknown_token(self.tokenizer, config, rows, p.ids)) for p in prompted
        ]
        return [input_grammar(self.grammars, f, e) for e, f in zip(encoded, fields, strict=True)]

    def decode(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        """Token ids to text, special tokens removed."""
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=True)

    def pad(self, batch: Sequence[Sequence[int]]) -> Batch:
        """[B, S] ids and mask (:func:`~.batching.pad_ids`) at the widest input's width; ``widths``: each one's."""
        limit = self._source_limit(None)
        widths = tuple(len(ids) if self.exact_widths else input_width(len(ids), limit) for ids in batch)
        left, device = not self.is_encoder_decoder, self.loaded.device
        return Batch(*pad_ids(batch, max(widths), self.tokenizer.pad_token_id, left, device), widths)

    def device_stats(self) -> dict[str, Any]:
        """Where and how the model runs (``--stats``, closing line): :func:`device_stats`."""
        return device_stats(self)

    # -- generation -------------------------------------------------------------------------------
    def generate_ids(
        self, batch: Sequence[Sequence[int]], indices: Sequence[int] | None = None
    ) -> list[list[list[int]]]:
        """Per input of one batch of token ids, ``num_return_sequences`` lists of generated ids (no prompt, no decoder
        start token, no padding), best first. ``indices``: each input's index in the run, seeding its sampling stream
        with ``seed`` (default: its position), so a sampled output does not depend on its batch."""
        return self.generate_output(batch, indices).sequences

    @torch.inference_mode()
    def generate_output(
        self, batch: Sequence[Sequence[int]], indices: Sequence[int] | None = None, grammars: Sequence[Any] = ()
    ) -> Generated:
        """:meth:`generate_ids`' sequences, with their scores where the generator gives them (``scores``);
        ``grammars``: each input's (its JSONL schema's; default: the run's)."""
        if not batch:
            return Generated([])
        if any(len(ids) == 0 for ids in batch):
            raise SeqgenError("cannot generate from an empty token sequence")
        from seqgen_cli.models.reference import hf_generate
        from seqgen_cli.search import generate
        from seqgen_cli.search.refill import generate_refill

        padded, want = self.pad(batch), bool(self.config.output_scores)
        own = list(grammars) if any(g is not None and g is not self.grammar for g in grammars) else None
        guides = {"stop": self.stop_check, "grammar": self.grammar if own is None else own}  # stop strings, grammars
        if self.backend != "fast":  # generate()'s ValueError for a max_length the prompt fills, as one line
            search_settings.check_room(self.config, self.is_encoder_decoder, padded.input_ids.shape[1])
            out = hf_generate(
                self.model, padded, self.config, scores=want, tokenizer=self.tokenizer, grammar=guides["grammar"]
            )
        elif self.refill:  # the lanes: a prompt's limits count from its own width (captured: lane steps replay graphs)
            out = generate_refill(
                self._engine(), padded, self.config, lanes=self.lanes, seed=self.seed, indices=indices,
                stats=self.refill_stats, widths=padded.widths, lane_tokens=self.lane_tokens, **guides,
            )  # fmt: skip
        else:
            out = generate(self._engine(), padded, self.config, seed=self.seed, indices=indices, **guides)
        return Generated(out.sequences, scored(self.config, out) if want else None)

    def generate_iterable(
        self,
        texts: Iterable[str],
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        batch_tokens: int | None = None,
        sort_window: int | None = None,
        early: bool = True,
    ) -> Iterator[list[str]]:
        """Per input, ``num_return_sequences`` strings (best first), in input order, streaming (``early``: the
        first after one batch, see :meth:`batcher`): ``sort_window`` texts read ahead (default
        :func:`~seqgen_cli.batching.default_window`), sorted by length, cut into batches of ``batch_size`` inputs and
        ``batch_tokens`` padded tokens x rows; a batch out of memory is split. An empty text gives empty strings; an
        input that cannot run even alone raises ``SeqgenError``."""
        order: InOrder[list[str]] = InOrder()
        empty = [""] * self.num_return_sequences

        def passthrough(items: list[Item]) -> None:
            bad = next((it for it in items if it.error is not None), None)
            if bad is not None:  # tokens the model cannot take (encode): an input that cannot run
                raise SeqgenError(bad.error)
            order.add_all((it.index, empty) for it in items)

        chunks = text_chunks(texts, self.encode)
        batcher = self.batcher(chunks, passthrough, batch_size, batch_tokens, sort_window, early)
        for done in self.generate_batches(batcher):
            for result in done.results:
                if result.error is not None:
                    raise SeqgenError(result.error)
                order.add(result.item.index, self.decode(result.sequences))
            yield from order.ready()
        yield from order.ready()  # empty inputs after the last batch

    def generate_batches(
        self, batches: Iterable[ItemBatch], known: Known | None = None
    ) -> Iterator[BatchResults]:
        """The one generate loop (:meth:`generate_iterable`, the file pipeline): per batch of ``batches`` (from
        :meth:`batcher`), the results of its inputs as they finish, in the batch's order (the callers put them back
        in input order); a batch that runs out of memory is split (:func:`~.batching.generate_split`), an input that
        fails alone is a result with an ``error``. ``known``: a batch's inputs -> (those whose outputs the caller
        has, not generated: a resumed run's journal; the rest). The next batch is read only when one is taken."""
        for batch in batches:
            done, todo = known(batch.items) if known is not None else ([], batch.items)
            startup.mark("first batch")  # the first decode step follows (--stats startup)
            t0 = time.perf_counter()
            results = generate_split(self, todo) if todo else []
            self.budget.after(todo)  # read again after a new shape, or what it set up
            yield BatchResults(batch, results, done, time.perf_counter() - t0)

    def batcher(
        self, chunks: Iterable[Chunk], passthrough: Callable[[list[Item]], None], batch_size: int = DEFAULT_BATCH_SIZE,
        batch_tokens: int | None = None, sort_window: int | None = None, early: bool = False,
    ) -> Batcher:  # fmt: skip
        """The one batching path (``generate_iterable``, the pipeline, the benchmarks): :class:`~.batching.Batcher`
        with this generator's rows, memory budget and refill (a batch is then a whole window, run over the lanes);
        ``early``: windows grow from one batch (docs/EXPERIMENTS.md, "Time to the first lines")."""
        if self.refill:
            window = default_window(self.lanes) if sort_window is None or sort_window <= 1 else sort_window
            batch_size, batch_tokens = max(self.lanes, window), None
        return Batcher(
            chunks, passthrough, batch_size=batch_size, batch_tokens=batch_tokens, rows=self.rows_per_input,
            window=sort_window, memory=self.budget.memory_limit(self.batch_bytes), buckets=self.buckets, grow=early,
            width=self.width,
        )  # fmt: skip

    def generate(self, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE) -> list[list[str]]:
        """Generate for texts: per input, ``num_return_sequences`` strings, best first."""
        return list(self.generate_iterable(texts, batch_size=batch_size, early=False))


def device_stats(gen: Generator) -> dict[str, Any]:
    """Where and how ``gen``'s model runs: device, dtype, engine, step path, capture and GPU figures, refill lanes."""
    from seqgen_cli.models import engine_stats
    from seqgen_cli.models.capture import CapturedBackend

    engine = engine_stats(gen._engine()) if gen.backend == "fast" else {"engine": "generate()"}  # generic: why
    out: dict[str, Any] = {**gen.loaded.describe(), **engine, "step_path": gen.step_path}
    if isinstance(gen._model_backend, CapturedBackend):
        out.update(gen._model_backend.stats())
    if gen.refill:
        out["refill"] = {"lanes": gen.lanes, **gen.refill_stats.report()}
    return out | gen.loaded.gpu_memory()


def input_grammar(grammars: Grammars, fields: Any, encoded: Encoded) -> Encoded:
    """``encoded`` with its input's grammar (``fields``: its JSONL object), or the schema's error (a bad input)."""
    if encoded.error is not None:
        return encoded
    try:
        return replace(encoded, grammar=grammars.of(fields))
    except SeqgenError as err:
        return replace(encoded, error=str(err))


def prompt_settings(
    prompt: PromptSettings | None, prefix: str | None, preset: Preset | None, lang_prefix: str
) -> PromptSettings:
    """The run's prompt settings: ``--prefix``, else the preset's, after OPUS-MT's ``>>code<<`` (``lang_prefix``)."""
    prompt = prompt or PromptSettings()
    if prompt.prefix is None:
        prompt = replace(prompt, prefix=prefix if prefix is not None else getattr(preset, "prefix", None))
    return replace(prompt, prefix=lang_prefix + (prompt.prefix or "")) if lang_prefix else prompt


def scored(config: Any, out: SearchOutput) -> list[list[Scored]]:
    """Each output's :class:`~.batching.Scored` from the search's scores: beam search's are ``generate()``'s
    ``sequences_scores``, the summed log-probs divided by the output's length ``** length_penalty`` (EOS counted, as
    transformers counts it), the others' the sums themselves."""
    if out.scores is None:
        raise SeqgenError("this run gives no scores")
    beam = search_settings.resolve_mode(config) == "beam"
    penalty = float(search_settings.setting(config, "length_penalty"))
    tokens = out.token_scores or [[None] * len(seqs) for seqs in out.sequences]
    raw = out.logprobs or [[None] * len(seqs) for seqs in out.sequences]
    return [
        [
            Scored(sc, sc * len(seq) ** penalty if beam else sc, per, lp)
            for seq, sc, per, lp in zip(seqs, row, each, logprobs, strict=True)
        ]
        for seqs, row, each, logprobs in zip(out.sequences, out.scores, tokens, raw, strict=True)
    ]


def startup_notes(gen: Generator, given: Mapping[str, Any]) -> list[str]:
    """What to know before a run starts: ``--backend auto`` runs ``generate()`` (and why), a dtype slow on this CPU,
    sampling the user did not ask for (``given``: the settings given) with no seed: outputs that differ run to run."""
    notes = [f"running transformers generate(): {gen.fallback}"] if gen.fallback else []
    notes += [slow] if (slow := slow_dtype(gen.loaded)) else []
    if gen.config.do_sample and gen.seed is None and given.get("do_sample") is None:
        notes.append(
            "the model's own settings sample (do_sample in its generation_config.json, or the preset's), unseeded: "
            "outputs differ from run to run; --seed N repeats them, --temperature 0 searches greedily"
        )
    return notes


def slow_dtype(loaded: Loaded) -> str | None:
    """Why a run's dtype is slow on this CPU, or ``None``: bfloat16 where oneDNN has no bf16 products for it (an
    AVX2-only CPU: the maps fall back to ``F.linear``, 3x float32's time on the Marian shape, docs/BENCHMARKS.md,
    "bfloat16 and int8 on the CPU")."""
    from seqgen_cli.models.linear_maps import ONEDNN_DTYPES, cpu_isa

    if loaded.device.type != "cpu" or loaded.dtype != torch.bfloat16 or torch.bfloat16 in ONEDNN_DTYPES:
        return None
    return (
        f"this CPU ({cpu_isa()}) has no bfloat16 products: --dtype bfloat16 runs several times slower than float32 "
        "here; float32, the default on the CPU, is faster and exact"
    )


def unknown_token(tokenizer: Any, config: Any, rows: int | None, ids: Sequence[int]) -> str | None:
    """Why the model cannot take ``ids``, or ``None``: a token the tokenizer has and the model's embedding has no
    row for (bart-large-cnn's ``<mask>``, 50264, past its ``vocab_size`` of 50264), which every backend would index
    past its table."""
    if rows is None or not ids or max(ids) < rows:
        return None
    bad = next(i for i in ids if i >= rows)
    vocab = getattr(config, "vocab_size", None)
    field = f" (vocab_size {vocab} in its config.json)" if vocab is not None else ""
    return (
        f"token {tokenizer.convert_ids_to_tokens(bad)!r} (id {bad}) is not in the model's vocabulary: its embedding "
        f"has {rows} rows{field}; remove it from the input"
    )


def input_rows(model: Any) -> int | None:
    """The rows of the embedding input ids index (the encoder's, for an encoder-decoder; the own trees have no
    ``get_input_embeddings``), or ``None`` where the model shows none: an id past them is an IndexError there."""
    encoder = model.get_encoder() if model.config.is_encoder_decoder else None
    embedding = getattr(encoder, "embed_tokens", None)
    if embedding is None and hasattr(model, "get_input_embeddings"):
        embedding = model.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


@dataclass(frozen=True)
class GeneratorSpec:
    """What a :class:`Generator` is built from (the command line's settings; ``--workers`` ships it to each
    worker, which builds its own)."""

    model: str
    backend: str = "auto"
    device: str | None = None
    dtype: str | None = None
    preset: str | None = None
    prefix: str | None = None
    max_source_length: int | None = None
    seed: int | None = None
    capture: bool | None = None
    refill: bool = False
    lanes: int = DEFAULT_BATCH_SIZE  # refill: --batch-size
    lane_tokens: int | None = None  # refill: --batch-tokens
    target_lang: str | None = None  # --target-lang: resolved through the tokenizer into forced_bos_token_id
    prompt: PromptSettings | None = None  # --prompt-template, --chat, ... (prompts.py)
    stop: tuple[str, ...] = ()  # --stop
    scores: bool = False  # --scores
    grammar: GrammarSpec | None = None  # --json-schema, --regex, --grammar, --choice
    generation: dict[str, Any] = field(default_factory=dict)  # transformers' names; None: not given

    def build(self) -> Generator:
        return Generator(
            self.model, backend=self.backend, device=self.device, dtype=self.dtype, preset=self.preset,
            prefix=self.prefix, max_source_length=self.max_source_length, seed=self.seed, capture=self.capture,
            refill=self.refill, lanes=self.lanes, lane_tokens=self.lane_tokens, target_lang=self.target_lang,
            prompt=self.prompt, stop=self.stop, scores=self.scores, grammar=self.grammar, **self.generation,
        )  # fmt: skip
