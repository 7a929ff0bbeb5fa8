"""The Python API: ``Generator`` turns texts (or token ids) into generated texts (or token ids).

    gen = Generator("path/to/checkpoint", preset="cnndm-bart")
    outputs = gen.generate(["first article ...", "second article ..."])   # list[list[str]]

Three layers, as CTranslate2's ``translate_batch`` / ``translate_iterable`` / ``translate_file``:
``generate_ids(batch)`` runs one batch of token ids; ``generate_iterable(texts)`` streams any number of
texts through length-sorted, token-budget batches (``seqgen_cli.batching``) with out-of-memory splitting;
the file pipeline (``seqgen_cli.pipeline``) adds reader and writer threads, input order and resume on top.

Backends: ``hf`` is plain transformers ``generate()`` (the reference); ``fast`` is seqgen's own
decoding engine over the model (per-family fast decoders where they exist, a generic one otherwise);
``auto`` picks ``fast`` when the settings are ones the engine supports, else ``hf``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from seqgen_cli.batching import (
    CHUNK_SIZE,
    Batcher,
    Chunk,
    Encoded,
    InOrder,
    Item,
    MemoryLimit,
    Text,
    free_memory_budget,
    generate_split,
    tokenise,
)
from seqgen_cli.config import Preset, check_flags, load_preset, resolve_generation_config
from seqgen_cli.errors import SeqgenError
from seqgen_cli.loading import Loaded, load
from seqgen_cli.search import settings as search_settings
from seqgen_cli.search.refill import RefillStats
from seqgen_cli.shapes import graph_width, input_width

BACKENDS = ("auto", "fast", "hf")
# per row and vocabulary entry while a step is searched: logits, log-probs and scores (float32)
LOGIT_BYTES = 3 * 4


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
        capture: bool = True,
        refill: bool = False,
        **generation: Any,
    ) -> None:
        """``capture``: on CUDA, run the fast backends' decode step as CUDA graphs (``models/capture.py``);
        ``False`` runs it eagerly (``step_path`` says which, and why). ``refill``: run the fast engine over fixed
        input lanes that finished inputs hand to waiting ones (``search/refill.py``; the fast backends' families,
        float32/half: elsewhere batches run as without it)."""
        if backend not in BACKENDS:
            raise SeqgenError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
        self.preset = load_preset(preset) if isinstance(preset, str) else preset
        flags = check_flags(generation)  # the settings given, checked before the (slow) model load
        self.loaded: Loaded = load(model, device, dtype)
        self.tokenizer = self.loaded.tokenizer
        self.model = self.loaded.model
        self.is_encoder_decoder = self.loaded.is_encoder_decoder
        self.config = resolve_generation_config(
            self.model.generation_config, self.preset, flags, self.is_encoder_decoder
        )
        self.prefix = prefix if prefix is not None else (self.preset.prefix if self.preset else None)
        self.max_source_length = max_source_length or (self.preset.max_source_length if self.preset else None)
        self.max_source_length = self._source_limit(self.max_source_length)
        self.seed = seed
        if seed is not None:
            torch.manual_seed(seed)
        self.backend = self._pick_backend(backend)
        self.capture = capture
        self.lanes = 32  # refill: input lanes (batch_limits sets them)
        self.lane_tokens: int | None = None  # refill: most padded source tokens x rows over the lanes
        self.refill_stats = RefillStats()
        self._model_backend = None  # the engine's model backend, built on first use (int8: now)
        self._step_path = ""  # how the engine runs its decode step (see step_path)
        # bytes a batch may hold (caches + logits, batch_bytes): on CUDA the free memory now; None = no limit
        self.memory_budget: int | None = free_memory_budget(self.loaded.device)
        self._sizing: Any = None  # generate()'s caches as the generic backend counts them (hf backend)
        if self.loaded.int8:
            self._quantize()
        self.refill = refill and self.backend == "fast" and self._refills()

    # -- settings ---------------------------------------------------------------------------------
    def _refills(self) -> bool:
        """Whether ``--refill`` runs here: not int8, and the engine's backend has lanes (a ``RefillBackend``: a fast
        family's, not the generic one a refused variant gets). Builds the engine."""
        if self.loaded.int8:
            return False
        from seqgen_cli.search.protocol import RefillBackend

        engine = self._engine()
        plain = getattr(engine, "backend", engine)  # under a CapturedBackend: its backend
        return isinstance(plain, RefillBackend)

    def _source_limit(self, requested: int | None) -> int | None:
        """The longest input the model takes: the smaller of the request and the model's position limit.

        A model without a position limit (T5's relative positions) takes the request as given, by default the
        tokenizer's ``model_max_length`` where that is a real number (not transformers' ``int(1e30)`` for "no
        limit"), so one huge line is truncated (and counted) instead of asking for any amount of memory.
        """
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if getattr(cfg, "model_type", "").startswith(("t5", "mt5")):
            limit = None  # relative positions: no hard limit
        if limit is None:
            if requested is not None:
                return requested
            tokenizer_limit = getattr(self.tokenizer, "model_max_length", None)
            real = isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < 10**9  # 1e30: none set
            limit = tokenizer_limit if real else None
        if limit is not None and not self.is_encoder_decoder:
            limit = max(1, limit - self.max_new_tokens())
        if requested is None:
            return limit
        return min(requested, limit) if limit else requested

    @property
    def num_return_sequences(self) -> int:
        """Outputs per input."""
        return search_settings.num_return_sequences(self.config)

    @property
    def rows_per_input(self) -> int:
        """Rows the model runs per input: beams, or returned sequences when more (sampling)."""
        return search_settings.rows_per_input(self.config)

    def max_new_tokens(self, prompt_len: int = 0) -> int:
        """Most new tokens for a prompt of ``prompt_len`` tokens (ignored for encoder-decoder models)."""
        return search_settings.new_token_limits(self.config, self.is_encoder_decoder, prompt_len)[0]

    def min_new_tokens(self, prompt_len: int = 0) -> int:
        """Fewest new tokens before EOS is allowed, for a prompt of ``prompt_len`` tokens."""
        return search_settings.new_token_limits(self.config, self.is_encoder_decoder, prompt_len)[1]

    def batch_limits(
        self, batch_size: int, batch_tokens: int | None, window: int | None
    ) -> tuple[int, int | None]:
        """What the batcher should cut, ``(batch_size, batch_tokens)``: the batches themselves; with refill, the
        whole look-ahead ``window`` per call, run over ``batch_size`` lanes (and ``batch_tokens`` padded source
        tokens x rows over the lanes)."""
        if not self.refill:
            return batch_size, batch_tokens
        from seqgen_cli.batching import default_window

        self.lanes, self.lane_tokens = batch_size, batch_tokens
        window = default_window(batch_size) if window is None or window <= 1 else window
        return max(batch_size, window), None

    def _pick_backend(self, backend: str) -> str:
        """``fast`` (seqgen's engine) where it runs the resolved settings, else ``hf`` (``generate()``)."""
        from seqgen_cli.search import unsupported_reason

        if backend == "hf":
            return "hf"
        reason = unsupported_reason(self.config)
        if reason is None:
            return "fast"
        if backend == "fast":
            raise SeqgenError(f"--backend fast cannot run these settings: {reason} (use --backend hf)")
        return "hf"

    def _quantize(self) -> None:
        """``--dtype int8``: linear layers in int8 (in place): the int8 fast backend, or the whole model for
        the generic backend and ``generate()`` (``models/linear_maps.py``)."""
        from seqgen_cli.models import get_backend
        from seqgen_cli.models.linear_maps import quantize_linears

        if self.backend == "fast":
            self._engine(get_backend(self.model, int8=True))
        else:
            quantize_linears(self.model)

    def _engine(self, backend: Any = None) -> Any:
        """The engine's model backend (built on first use, or ``backend``), behind the capture path."""
        from seqgen_cli.models import get_backend
        from seqgen_cli.models.capture import capture

        if self._model_backend is None:
            backend = get_backend(self.model) if backend is None else backend
            self._model_backend, self._step_path = capture(backend, self.loaded.device, self.capture)
        return self._model_backend

    @property
    def step_path(self) -> str:
        """How decode steps run: ``captured`` (CUDA graphs), or ``eager (<reason>)``; ``generate()`` for the
        hf backend."""
        from seqgen_cli.models.capture import CapturedBackend

        if self.backend != "fast":
            return "generate()"
        engine = self._engine()
        return engine.path if isinstance(engine, CapturedBackend) else self._step_path  # path: may fall back

    def batch_bytes(self, inputs: int, width: int) -> int | None:
        """Device memory a batch of ``inputs`` inputs padded to ``width`` tokens holds while it decodes: the
        backend's caches (``cache_bytes``, capture's padding included; ``generate()``'s as the generic backend
        counts them) and the logits rows; ``None`` when the backend cannot say."""
        from seqgen_cli.models.generic import GenericBackend

        if self.backend == "fast":
            backend = self._engine()
        elif not isinstance(backend := self._sizing, GenericBackend):
            backend = self._sizing = GenericBackend(self.model)
        cache_bytes = getattr(backend, "cache_bytes", None)
        r = self.rows_per_input
        caches = None if cache_bytes is None else cache_bytes(inputs, width, r, self.max_new_tokens(width))
        return None if caches is None else caches + inputs * r * backend.vocab_size * LOGIT_BYTES

    def memory_limit(self) -> MemoryLimit | None:
        """The batcher's memory budget: :attr:`memory_budget` over :meth:`batch_bytes`, where both are known."""
        if self.memory_budget is None or self.batch_bytes(1, 1) is None:
            return None
        return MemoryLimit(self.memory_budget, self.batch_bytes)

    # -- tokens -----------------------------------------------------------------------------------
    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        """Tokenise (with the prefix), truncating to ``max_source_length``."""
        if self.prefix:
            texts = [self.prefix + t for t in texts]
        limit = self.max_source_length
        full = self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        out = []
        for text, ids in zip(texts, full, strict=True):
            if limit is not None and len(ids) > limit:
                ids = self.tokenizer(text, truncation=True, max_length=limit)["input_ids"]
                out.append(Encoded(ids, True))
            else:
                out.append(Encoded(ids, False))
        return out

    def decode(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        """Token ids to text, special tokens removed."""
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=True)

    def pad(self, batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad to a rectangle: right for encoder-decoder sources, left for decoder-only prompts. [B, S] int64.

        ``S`` is the :func:`~seqgen_cli.shapes.input_width` of the longest input (at most the model's position
        limit): an input batched with others of its bucket (``Batcher``) gets the width it has alone, so its
        output does not depend on its neighbours. The rectangle is built on the host; for a CUDA device in
        pinned memory, copied with ``non_blocking=True`` so the host queues the copy and goes on (the caching
        host allocator keeps the pinned block until the copy is done).
        """
        width = input_width(max(len(ids) for ids in batch), self._source_limit(None))
        device = self.loaded.device
        pinned = device.type == "cuda"
        input_ids = torch.full(
            (len(batch), width), self.tokenizer.pad_token_id, dtype=torch.long, pin_memory=pinned
        )
        mask = torch.zeros((len(batch), width), dtype=torch.long, pin_memory=pinned)
        for i, ids in enumerate(batch):
            cols = slice(0, len(ids)) if self.is_encoder_decoder else slice(width - len(ids), width)
            input_ids[i, cols] = torch.tensor(ids, dtype=torch.long)
            mask[i, cols] = 1
        return input_ids.to(device, non_blocking=pinned), mask.to(device, non_blocking=pinned)

    def device_stats(self) -> dict[str, Any]:
        """Where and how the model runs, for ``--stats`` and the closing line: ``device``, ``dtype``,
        ``step_path`` (:attr:`step_path`); under CUDA graphs ``shapes_compiled``, ``compile_seconds``,
        ``captured_steps`` and ``eager_steps`` (``CapturedBackend.stats``); and on CUDA ``device_name`` and
        ``peak_gpu_memory_mb`` (``torch.cuda.max_memory_allocated`` since the start or the last
        ``torch.cuda.reset_peak_memory_stats``, in MiB)."""
        from seqgen_cli.models.capture import CapturedBackend

        device = self.loaded.device
        dtype = "int8" if self.loaded.int8 else str(self.loaded.dtype).removeprefix("torch.")
        out: dict[str, Any] = {"device": str(device), "dtype": dtype, "step_path": self.step_path}
        if isinstance(self._model_backend, CapturedBackend):
            out.update(self._model_backend.stats())
        if self.refill:
            st = self.refill_stats
            out["refill"] = {
                "lanes": self.lanes,
                "occupancy": round(st.occupancy, 4),
                "joins": st.joins,
                "steps": st.steps,
                "row_steps": st.row_steps,
                "live_row_steps": st.live_row_steps,
            }
        if device.type == "cuda":
            out["device_name"] = torch.cuda.get_device_name(device)
            out["peak_gpu_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        return out

    # -- generation -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate_ids(
        self, batch: Sequence[Sequence[int]], indices: Sequence[int] | None = None
    ) -> list[list[list[int]]]:
        """Generate for one batch of token-id inputs: per input, ``num_return_sequences`` id lists.

        Each list holds the generated tokens only (no prompt, no decoder start token, no padding),
        best first. ``indices``: each input's index in the run, which (with ``seed``) seeds its sampling stream
        (default: its position in ``batch``), so a sampled output does not depend on its batch.
        """
        if not batch:
            return []
        if any(len(ids) == 0 for ids in batch):
            raise SeqgenError("cannot generate from an empty token sequence")
        input_ids, mask = self.pad(batch)
        if self.backend == "fast":
            return self._generate_fast(input_ids, mask, indices)
        return self._generate_hf(input_ids, mask)

    def _generate_fast(
        self, input_ids: torch.Tensor, mask: torch.Tensor, indices: Sequence[int] | None
    ) -> list[list[list[int]]]:
        from seqgen_cli.search import generate
        from seqgen_cli.search.protocol import Batch

        if self.refill:
            return self._generate_refill(Batch(input_ids, mask), indices)
        batch = Batch(input_ids, mask)
        return generate(self._engine(), batch, self.config, seed=self.seed, indices=indices).sequences

    def _generate_refill(self, batch: Any, indices: Sequence[int] | None) -> list[list[list[int]]]:
        """The refill engine over ``self.lanes`` lanes (fewer where ``lane_tokens`` cannot hold them at the
        batch's widest source), inputs joining in batch order."""
        from seqgen_cli.search.refill import generate_refill

        engine = self._engine()  # under a CapturedBackend: its lane steps replay compiled graphs
        lanes = self.lanes
        if self.lane_tokens is not None:
            width = graph_width(batch.input_ids.shape[1], getattr(engine, "max_position_embeddings", None))
            lanes = max(1, min(lanes, self.lane_tokens // (width * self.rows_per_input)))
        widths = None  # decoder-only: each prompt's length limits count from its own width, as without refill
        if not self.is_encoder_decoder:
            limit = self._source_limit(None)
            widths = [input_width(int(n), limit) for n in batch.attention_mask.sum(dim=1).tolist()]
        out = generate_refill(
            engine, batch, self.config, lanes=lanes, seed=self.seed, indices=indices, stats=self.refill_stats,
            widths=widths,
        )  # fmt: skip
        return out.sequences

    def _generate_hf(self, input_ids: torch.Tensor, mask: torch.Tensor) -> list[list[list[int]]]:
        sequences = self.model.generate(
            input_ids=input_ids, attention_mask=mask, generation_config=self.config
        )
        start = 1 if self.is_encoder_decoder else input_ids.shape[1]
        n = self.num_return_sequences
        rows = [strip_generated(row[start:].tolist(), self.config.eos_token_id) for row in sequences]
        return [rows[i * n : (i + 1) * n] for i in range(len(input_ids))]

    def generate_iterable(
        self,
        texts: Iterable[str],
        *,
        batch_size: int = 32,
        batch_tokens: int | None = None,
        sort_window: int | None = None,
    ) -> Iterator[list[str]]:
        """Per input, ``num_return_sequences`` strings (best first), in input order, streaming.

        Reads ``sort_window`` texts ahead (default :func:`~seqgen_cli.batching.default_window`), sorts them
        by length and cuts batches of ``batch_size`` inputs and ``batch_tokens`` padded tokens x rows; a
        batch that runs out of memory is split. An empty text gives empty strings. Raises ``SeqgenError``
        for an input that cannot run even alone.
        """
        order: InOrder[list[str]] = InOrder()
        empty = [""] * self.num_return_sequences

        def passthrough(items: list[Item]) -> None:
            order.add_all((it.index, empty) for it in items)

        batch_size, batch_tokens = self.batch_limits(batch_size, batch_tokens, sort_window)
        batcher = Batcher(
            self._chunks(texts), passthrough, batch_size=batch_size, batch_tokens=batch_tokens,
            rows=self.rows_per_input, window=sort_window, memory=self.memory_limit(), buckets=not self.refill,
        )  # fmt: skip
        for batch in batcher:
            for result in generate_split(self, batch.items):
                if result.error is not None:
                    raise SeqgenError(result.error)
                order.add(result.item.index, self.decode(result.sequences))
            yield from order.ready()
        yield from order.ready()  # empty inputs after the last batch

    def _chunks(self, texts: Iterable[str]) -> Iterator[Chunk]:
        """Tokenised items in input order, :data:`~seqgen_cli.batching.CHUNK_SIZE` at a time."""
        group: list[Text] = []
        for index, text in enumerate(texts):
            group.append(Text(index, text))
            if len(group) == CHUNK_SIZE:
                yield Chunk(tokenise(group, self.encode))
                group = []
        if group:
            yield Chunk(tokenise(group, self.encode))

    def generate(self, texts: Sequence[str], batch_size: int = 32) -> list[list[str]]:
        """Generate for texts: per input, ``num_return_sequences`` strings, best first."""
        return list(self.generate_iterable(texts, batch_size=batch_size))


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
    capture: bool = True
    refill: bool = False
    generation: dict[str, Any] = field(default_factory=dict)  # transformers' names; None: not given

    def build(self) -> Generator:
        return Generator(
            self.model, backend=self.backend, device=self.device, dtype=self.dtype, preset=self.preset,
            prefix=self.prefix, max_source_length=self.max_source_length, seed=self.seed, capture=self.capture,
            refill=self.refill, **self.generation,
        )  # fmt: skip


def strip_generated(tokens: list[int], eos: int | list[int] | None) -> list[int]:
    """Cut a padded output row after its first end-of-sequence token (kept)."""
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1]
    return tokens
