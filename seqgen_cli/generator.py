"""The Python API: ``Generator`` turns texts (or token ids) into generated texts (or token ids).

    gen = Generator("path/to/checkpoint", preset="cnndm-bart")
    outputs = gen.generate(["first article ...", "second article ..."])   # list[list[str]]

Three layers, as CTranslate2's ``translate_batch`` / ``translate_iterable`` / ``translate_file``:
``generate_ids(batch)`` runs one batch of token ids; ``generate_iterable(texts)`` streams any number of
texts through length-sorted, token-budget batches (``seqgen_cli.batching``) with out-of-memory splitting;
the file pipeline (``seqgen_cli.pipeline``) adds reader and writer threads, input order and resume on top.
Both run their batches through ``generate_batches``, the one generate loop.

A generator is built from a :class:`GeneratorSpec` (its settings, held once) in named steps: the settings checked
before the load, the checkpoint loaded, the generation settings resolved against it, the prompter, the backend.

Backends: ``hf`` is plain transformers ``generate()`` (the reference); ``fast`` is seqgen's own
decoding engine over the model (per-family fast decoders where they exist, a generic one otherwise);
``auto`` picks ``fast`` when the settings are ones the engine supports, else ``hf``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from seqgen_cli import search, startup
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
    break_table,
    default_window,
    generate_split,
    pad_ids,
    text_chunks,
)
from seqgen_cli.budget import DeviceBudget, out_of_memory
from seqgen_cli.config import chat_length, check_checkpoint, check_flags, default_length, settings_for_model
from seqgen_cli.errors import SeqgenError
from seqgen_cli.grammars import Grammars, GrammarSpec
from seqgen_cli.languages import check_target, resolve_target_prefix
from seqgen_cli.loading import Loaded, limit_said, load, source_limit
from seqgen_cli.memory import batch_bytes
from seqgen_cli.models import (
    backend_refusal,
    backend_stats,
    capture,
    get_backend,
    length_dependent_rope,
    linear_maps,
    own_widths,
    to_int8,
)
from seqgen_cli.models.capture import CapturedBackend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.models.reference import hf_generate
from seqgen_cli.outputs import REASONING, OutputText
from seqgen_cli.presets import Preset, load_preset
from seqgen_cli.prompts import Prompter, PromptSettings, stop_check
from seqgen_cli.search import settings as search_settings
from seqgen_cli.search.protocol import Batch, RefillBackend, SearchOutput
from seqgen_cli.search.refill import RefillStats, generate_refill
from seqgen_cli.shapes import input_width
from seqgen_cli.stops import all_stops

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


@dataclass(frozen=True)
class GeneratorSpec:
    """What a :class:`Generator` is built from, each setting once: ``Generator(model, **settings)`` builds one
    (:meth:`of`), the command line another (``pipeline.job.generator_spec``); ``--workers`` ships it to each
    worker, which builds its own (:meth:`build`)."""

    model: str
    backend: str = "auto"  # BACKENDS
    device: str | None = None
    dtype: str | None = None
    preset: str | Preset | None = None  # a preset's name, a .toml file's path, or the preset
    prefix: str | None = None
    max_source_length: int | None = None
    seed: int | None = None
    # on CUDA, the fast backends' decode step as CUDA graphs (models/capture.py), each shape compiled once its
    # eager steps pay for it (None), at once (True) or never (False; Generator.step_path)
    capture: bool | None = None
    # the fast engine over ``lanes`` fixed input lanes that finished inputs hand to waiting ones, at most
    # ``lane_tokens`` padded source tokens x rows over them (search/refill.py; the fast backends' families,
    # float32/half: elsewhere batches run as without it)
    refill: bool = False
    lanes: int = DEFAULT_BATCH_SIZE  # refill: --batch-size
    lane_tokens: int | None = None  # refill: --batch-tokens
    # --target-lang: a tokenizer's language code or language (de_DE, deu_Latn, de), resolved through the tokenizer
    # into forced_bos_token_id, or OPUS-MT's >>deu<< before each input
    target_lang: str | None = None
    # how an input becomes its prompt: --prompt-template, --chat, ... (prompts.py)
    prompt: PromptSettings | None = None
    stop: Sequence[str] = ()  # --stop: stop strings beside the checkpoint's
    keep_stop: bool = False  # --keep-stop: the text written ends with the stop string (outputs.py)
    reasoning: str = "keep"  # --reasoning: a thinking model's reasoning kept, stripped or a field (outputs.py)
    scores: bool = False  # --scores: each output's Scored (output_scores: greedy and sampling gather them)
    # every output a match of it (structured outputs, grammars.py): --json-schema, --regex, --grammar, --choice
    grammar: GrammarSpec | None = None
    generation: dict[str, Any] = field(default_factory=dict)  # transformers' names; None: not given

    @classmethod
    def of(cls, model: str | GeneratorSpec, **settings: Any) -> GeneratorSpec:
        """``Generator(model, **settings)``'s spec: the settings this class names, the rest generation settings;
        ``model`` a spec: it with ``settings`` replacing its fields."""
        if isinstance(model, GeneratorSpec):
            return replace(model, **settings)
        own = set(cls.__dataclass_fields__) - {"model", "generation"}
        return cls(model, **{k: settings.pop(k) for k in own if k in settings}, generation=settings)

    def build(self) -> Generator:
        """The generator this spec describes (``--workers``: each worker builds its own)."""
        return Generator(self)


class BatchLayers:
    """The API's layers over one batch (``generate_output``), as CTranslate2's ``translate_iterable`` over
    ``translate_batch``: a batch's ids (:meth:`generate_ids`), the one generate loop (:meth:`generate_batches`) and
    texts streamed through it (:meth:`generate_iterable`, :meth:`generate`). They run on what a generator gives: its
    batch layer (``encode``, ``generate_output``, ``texts``), its batching path (``batcher``), ``budget`` and
    ``num_return_sequences`` (the tests' stand-in generator gives them too)."""

    def generate_ids(
        self, batch: Sequence[Sequence[int]], indices: Sequence[int] | None = None
    ) -> list[list[list[int]]]:
        """Per input of one batch of token ids, ``num_return_sequences`` lists of generated ids (no prompt, no decoder
        start token, no padding), best first. ``indices``: each input's index in the run, seeding its sampling stream
        with ``seed`` (default: its position), so a sampled output does not depend on its batch."""
        return self.generate_output(batch, indices).sequences

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
                order.add(result.item.index, [t.answer for t in self.texts(result.sequences)])
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

    def generate(self, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE) -> list[list[str]]:
        """Generate for texts: per input, ``num_return_sequences`` strings, best first."""
        return list(self.generate_iterable(texts, batch_size=batch_size, early=False))


class Generator(BatchLayers):
    """A loaded model with resolved generation settings, built from a :class:`GeneratorSpec` in named steps."""

    def __init__(self, model: str | GeneratorSpec, **settings: Any) -> None:
        """``Generator("path", max_new_tokens=8, dtype="int8")``: ``settings`` are :class:`GeneratorSpec`'s fields
        and generation settings (transformers' names); or ``Generator(spec)``, ``settings`` replacing its fields."""
        self.spec = spec = GeneratorSpec.of(model, **settings)
        self.preset, flags = checked_settings(spec)  # before the (slow) model load
        self._load(spec)
        # OPUS-MT's target language: >>code<< tokens before each input, no forced BOS
        lang_prefix = resolve_target_prefix(self.tokenizer, spec.target_lang)
        self._resolve_settings(spec, flags, None if lang_prefix else spec.target_lang)
        self._build_prompter(spec, lang_prefix)
        self.seed = spec.seed
        if spec.seed is not None:  # torch's generator: generate()'s sampling draws from it
            torch.manual_seed(spec.seed)
        self._choose_backend(spec.backend)
        self._prepare_backend(spec)
        self.input_vocabulary = input_vocabulary(self.model)  # an input id past it is a bad input (encode)

    # -- the steps: __init__'s, in order ------------------------------------------------------------
    def _load(self, spec: GeneratorSpec) -> None:
        """The checkpoint: tokenizer and weights (``own``: the fast engine's module tree)."""
        self.loaded: Loaded = load(spec.model, spec.device, spec.dtype, own=spec.backend != "hf")
        self.tokenizer, self.model = self.loaded.tokenizer, self.loaded.model
        self.is_encoder_decoder = self.loaded.is_encoder_decoder

    def _resolve_settings(self, spec: GeneratorSpec, flags: dict[str, Any], target_lang: str | None) -> None:
        """The run's generation settings (the checkpoint's, the preset's, the flags'; ``target_lang``: a forced
        BOS), with the stop strings, the scores and the grammars they run with."""
        self.config = config = settings_for_model(self.model, self.tokenizer, self.preset, flags, target_lang)
        config.stop_strings = all_stops(config.stop_strings, spec.stop)  # the checkpoint's, then --stop's
        config.output_scores = spec.scores or "logprobs" in flags  # not the checkpoint's: the caller's output
        self.stop_check = stop_check(self.tokenizer, config.stop_strings)  # once: its tables take a while
        self.texts = OutputText(self.detokenise, tuple(config.stop_strings or ()), spec.keep_stop, spec.reasoning)
        self.grammars = Grammars(spec.grammar, self.tokenizer, self.model, config)  # the run's, each schema's
        self.grammar = self.grammars.run
        self.chat_length = chat_length(config, self.model.config, bool(spec.prompt and spec.prompt.chat))
        self.default_length = default_length(config)  # transformers' 20 new tokens, set by nobody

    def _build_prompter(self, spec: GeneratorSpec, lang_prefix: str) -> None:
        """How an input becomes its prompt (``prompts.py``), and the longest input the model takes."""
        self.prompt = prompt_settings(spec.prompt, spec.prefix, self.preset, lang_prefix)
        self.prefix = self.prompt.prefix
        self.prompter = Prompter(self.prompt, self.tokenizer, breaks=not self.is_encoder_decoder)  # renders or fails
        requested = spec.max_source_length or getattr(self.preset, "max_source_length", None)
        self.max_source_length = self._source_limit(requested)
        self.limit_said = source_limit_said(self, requested, from_flag=spec.max_source_length is not None)

    def _choose_backend(self, requested: str) -> None:
        """``fast`` or ``hf`` (``auto``'s pick; ``fallback``: why it runs ``generate()``), and its model."""
        refused = backend_refusal(self.model.config)  # a model no backend of seqgen's runs (generate() does)
        self.backend, self.fallback = search.choose_backend(requested, self.config, refused)
        # outputs that depend on the padding and the neighbours' lengths (generate()'s too): run unpadded (width)
        self.exact_widths = length_dependent_rope(self.model.config)
        if self.backend != "fast":  # generate() runs transformers' model
            self.model = self.loaded.use_reference()

    def _prepare_backend(self, spec: GeneratorSpec) -> None:
        """The memory budget, the model backend (built on first use; int8: now) and refill's lanes."""
        self.refill_stats = RefillStats()
        self._model_backend: Any = None  # the model backend (see model_backend)
        self._step_path = ""  # how the backend runs its decode step (see step_path)
        self.budget = DeviceBudget.read(self.loaded.device)  # what batches and the kept states are held to
        self._sizing: Any = None  # generate()'s caches as the generic backend counts them (hf backend)
        if self.loaded.int8:  # --dtype int8: the int8 fast backend, or transformers' model quantized in place
            int8 = to_int8(self.model, fast=self.backend == "fast")
            if int8 is not None:
                self.model_backend(int8)
        # --refill where the backend has lanes (a fast family's RefillBackend; a CapturedBackend wraps only those)
        fast = self.backend == "fast" and not self.loaded.int8
        self.refill = spec.refill and fast and isinstance(self.model_backend(), RefillBackend)

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
        if self.exact_widths or self.refill:
            return bool(self.exact_widths)
        return not (self.backend == "fast" and own_widths(self.model_backend()))

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

    def model_backend(self, backend: Any = None) -> Any:
        """The model backend the search runs on (built on first use, or ``backend``), behind the capture path."""
        if self._model_backend is None:
            with startup.stage("fast backend"):
                backend = get_backend(self.model) if backend is None else backend
            # capture.capture, looked up at each call (the tests replace it)
            self._model_backend, self._step_path = capture.capture(
                backend, self.loaded.device, self.spec.capture
            )
            if isinstance(self._model_backend, CapturedBackend):  # its kept states, held against this budget
                self._model_backend.pool.budget = self.budget
        return self._model_backend

    @property
    def step_path(self) -> str:
        """How decode steps run: ``captured`` (CUDA graphs), ``eager (<reason>)``; ``generate()`` (hf backend)."""
        if self.backend != "fast":
            return "generate()"
        backend = self.model_backend()
        return backend.path if isinstance(backend, CapturedBackend) else self._step_path  # path: may fall back

    @property
    def memory_budget(self) -> int | None:  # bytes a batch may hold (README): budget.limit; None: no limit
        return self.budget.limit

    @memory_budget.setter
    def memory_budget(self, limit: int | None) -> None:
        self.budget.limit = limit

    def batch_bytes(self, inputs: int, width: int) -> int | None:
        """Device memory a batch of ``inputs`` inputs padded to ``width`` tokens holds while it decodes
        (:func:`~.memory.batch_bytes`; ``generate()``'s as the generic backend counts it); ``None``: cannot say."""
        if self.backend == "fast":
            backend = self.model_backend()
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
        prompted = self.prompter.encode(texts, fields, self.max_source_length, self.limit_said)
        unknown = partial(unknown_token, self.tokenizer, self.model.config, self.input_vocabulary)
        encoded = [Encoded(p.ids, p.truncated, p.error or unknown(p.ids), breaks=p.breaks) for p in prompted]
        return [input_grammar(self.grammars, f, e) for e, f in zip(encoded, fields, strict=True)]

    def detokenise(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        """Token ids to text, special tokens removed (the tokenizer's ``batch_decode``)."""
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=True)

    def pad(self, batch: Sequence[Sequence[int]], breaks: Sequence[Sequence[int]] = ()) -> Batch:
        """[B, S] ids and mask (:func:`~.batching.pad_ids`) at the widest input's width; ``widths``: each one's;
        ``breaks``: each decoder-only prompt's (``Encoded.breaks``), for the prompt tree."""
        limit = self._source_limit(None)
        widths = tuple(len(ids) if self.exact_widths else input_width(len(ids), limit) for ids in batch)
        left, device = not self.is_encoder_decoder, self.loaded.device
        table = break_table(breaks, device) if left else None
        return Batch(*pad_ids(batch, max(widths), self.tokenizer.pad_token_id, left, device), widths, table)

    def device_stats(self) -> dict[str, Any]:
        """Where and how the model runs (``--stats``, closing line): :func:`device_stats`."""
        return device_stats(self)

    # -- generation -------------------------------------------------------------------------------
    def batcher(
        self,
        chunks: Iterable[Chunk],
        passthrough: Callable[[list[Item]], None],
        batch_size: int = DEFAULT_BATCH_SIZE,
        batch_tokens: int | None = None,
        sort_window: int | None = None,
        early: bool = False,
    ) -> Batcher:
        """The one batching path (``generate_iterable``, the pipeline, the benchmarks): :class:`~.batching.Batcher`
        with this generator's rows, memory budget and refill (a batch is then a whole window, run over the lanes);
        ``early``: windows grow from one batch (docs/EXPERIMENTS.md, "Time to the first lines")."""
        if self.refill:
            lanes = self.spec.lanes
            window = default_window(lanes) if sort_window is None or sort_window <= 1 else sort_window
            batch_size, batch_tokens = max(lanes, window), None
        return Batcher(
            chunks,
            passthrough,
            batch_size=batch_size,
            batch_tokens=batch_tokens,
            rows=self.rows_per_input,
            window=sort_window,
            memory=self.budget.memory_limit(self.batch_bytes),
            buckets=self.buckets,
            grow=early,
            width=self.width,
        )

    @torch.inference_mode()
    def generate_output(
        self,
        batch: Sequence[Sequence[int]],
        indices: Sequence[int] | None = None,
        grammars: Sequence[Any] = (),
        breaks: Sequence[Sequence[int]] = (),
    ) -> Generated:
        """:meth:`generate_ids`' sequences, with their scores where the generator gives them (``scores``);
        ``grammars``: each input's (its JSONL schema's; default: the run's); ``breaks``: each prompt's
        (``Encoded.breaks``)."""
        if not batch:
            return Generated([])
        if any(len(ids) == 0 for ids in batch):
            raise SeqgenError("cannot generate from an empty token sequence")
        padded, want = self.pad(batch, breaks), bool(self.config.output_scores)
        own = list(grammars) if any(g is not None and g is not self.grammar for g in grammars) else None
        grammar = self.grammar if own is None else own
        guides = {"stop": self.stop_check, "grammar": grammar}  # stop strings, grammars
        if self.backend != "fast":  # generate()'s ValueError for a max_length the prompt fills, as one line
            search_settings.check_room(self.config, self.is_encoder_decoder, padded.input_ids.shape[1])
            out = hf_generate(
                self.model, padded, self.config, scores=want, tokenizer=self.tokenizer, grammar=grammar
            )
        elif self.refill:
            # the lanes: a prompt's limits count from its own width (captured: lane steps replay graphs)
            out = generate_refill(
                self.model_backend(),
                padded,
                self.config,
                lanes=self.spec.lanes,
                seed=self.seed,
                indices=indices,
                stats=self.refill_stats,
                widths=padded.widths,
                lane_tokens=self.spec.lane_tokens,
                **guides,
            )
        else:
            out = search.generate(
                self.model_backend(), padded, self.config, seed=self.seed, indices=indices, **guides
            )
        return Generated(out.sequences, scored(self.config, out) if want else None)


def checked_settings(spec: GeneratorSpec) -> tuple[Preset | None, dict[str, Any]]:
    """``spec``'s preset and generation settings given (``flags``), checked before the (slow) model load: the
    backend's name, the flags, the target language, ``--stop`` and the checkpoint's generation_config.json."""
    if spec.backend not in BACKENDS:
        raise SeqgenError(f"unknown backend {spec.backend!r} (choose from {', '.join(BACKENDS)})")
    preset = load_preset(spec.preset) if isinstance(spec.preset, str) else spec.preset
    flags = check_flags(spec.generation)  # the settings given
    check_target(spec.target_lang, flags)
    if spec.reasoning not in REASONING:
        raise SeqgenError(f"unknown reasoning mode {spec.reasoning!r} (choose from {', '.join(REASONING)})")
    # --stop and the checkpoint's generation_config.json, before the weights are read
    check_checkpoint(spec.model, preset, flags, spec.stop)
    return preset, flags


def source_limit_said(gen: Generator, requested: int | None, from_flag: bool) -> str:
    """Where ``gen.max_source_length`` comes from, in words (:func:`~seqgen_cli.loading.limit_said`), for the
    errors that name it: ``--max-source-length``, the preset's, or the model's context less the new tokens."""
    by = "--max-source-length" if from_flag else "the preset's max_source_length"
    new_tokens = 0 if gen.is_encoder_decoder else gen.new_token_limits()[0]
    return limit_said(gen.model.config, requested, by, gen.max_source_length, new_tokens)


def device_stats(gen: Generator) -> dict[str, Any]:
    """Where and how ``gen``'s model runs: device, dtype, backend (``engine``), step path, capture and GPU figures,
    refill lanes."""
    ran = backend_stats(gen.model_backend()) if gen.backend == "fast" else {"engine": "generate()"}  # generic: why
    out: dict[str, Any] = {**gen.loaded.describe(), **ran, "step_path": gen.step_path}
    if isinstance(gen._model_backend, CapturedBackend):
        out.update(gen._model_backend.stats())
    if gen.refill:
        out["refill"] = {"lanes": gen.spec.lanes, **gen.refill_stats.report()}
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
    if gen.chat_length:
        notes.append(
            f"--chat with no length set: up to {gen.chat_length} new tokens an output, which ends at its end of turn "
            "(--max-new-tokens sets another)"
        )
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
    bf16_products = torch.bfloat16 in linear_maps.ONEDNN_DTYPES  # read at each call (the tests replace it)
    if loaded.device.type != "cpu" or loaded.dtype != torch.bfloat16 or bf16_products:
        return None
    return (
        f"this CPU ({linear_maps.cpu_isa()}) has no bfloat16 products: --dtype bfloat16 runs several times slower "
        "than float32 here; float32, the default on the CPU, is faster and exact"
    )


def unknown_token(tokenizer: Any, config: Any, vocabulary: int | None, ids: Sequence[int]) -> str | None:
    """Why the model cannot take ``ids``, or ``None``: a token the tokenizer has and the model's embedding has no
    row for (bart-large-cnn's ``<mask>``, 50264, past its ``vocab_size`` of 50264), which every backend would index
    past its table."""
    if vocabulary is None or not ids or max(ids) < vocabulary:
        return None
    bad = next(i for i in ids if i >= vocabulary)
    vocab = getattr(config, "vocab_size", None)
    field = f" (vocab_size {vocab} in its config.json)" if vocab is not None else ""
    return (
        f"token {tokenizer.convert_ids_to_tokens(bad)!r} (id {bad}) is not in the model's vocabulary: its embedding "
        f"has {vocabulary} rows{field}; remove it from the input"
    )


def input_vocabulary(model: Any) -> int | None:
    """How many ids the model's input embedding takes, its rows (the encoder's, for an encoder-decoder; the own
    trees have no ``get_input_embeddings``), or ``None`` where the model shows none: an id past them is an IndexError
    there."""
    encoder = model.get_encoder() if model.config.is_encoder_decoder else None
    embedding = getattr(encoder, "embed_tokens", None)
    if embedding is None and hasattr(model, "get_input_embeddings"):
        embedding = model.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None
