"""Batching, shared by ``Generator.generate_iterable`` and the file pipeline.

Inputs arrive as :class:`Item` chunks in input order. :class:`Batcher` reads a look-ahead *window* of them,
sorts it by source length and cuts batches of at most ``batch_size`` inputs and ``batch_tokens`` padded
source tokens, counted once per row the model runs (``rows`` = beams, or returned sequences when more), and at
most a :class:`MemoryLimit` of device memory (caches and logits as the backend counts them, the encoder's and the
search's temporaries: ``seqgen_cli/memory.py``; on CUDA by default the free memory that the one
``budget.DeviceBudget`` holds, read again after the first batch of each new shape, and read as each batch is
cut); an input longer than the budget on its own still forms a batch of one. Windows are consecutive in input
order, so every input of a later window comes after every input of an earlier one. :func:`generate_split` runs a
batch and, when it runs out of memory, splits it in halves down to a single input: no input is dropped.

Batch independence. An input's arithmetic runs at :func:`~seqgen_cli.shapes.input_width` of its own length, never
at a longer neighbour's: the fast encoder-decoder backends run each input's encoder at its own width and sum
cross-attention chunk by chunk (``Batch.widths``), so their batches mix widths (``buckets=False``); the others
(decoder-only prompts, the generic backend) take inputs of one bucket per batch. With the fast backends'
row-invariant products (``models/linear_maps.py``) the bytes of an output then depend on its input and the
settings only, not on which inputs share its batch, the window, the batch size, a shard or the reader's timing
(CPU float32; tests/models/test_determinism.py). The refill engine (``--refill``) takes a whole window per call
(docs/ARCHITECTURE.md, "Lanes and refill").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from seqgen_cli.errors import SeqgenError, is_oom
from seqgen_cli.shapes import input_width

MIN_WINDOW = 2048
CHUNK_SIZE = 256  # inputs tokenised by one call (Generator.generate_iterable, the pipeline's reader)
DEFAULT_BATCH_SIZE = 32  # inputs per batch (--batch-size); with --refill, lanes
LOGIT_BYTES = (
    3 * 4
)  # per row and vocabulary entry while a step is searched: logits, log-probs, scores (float32)


@dataclass
class Encoded:
    """One tokenised input."""

    ids: list[int]
    truncated: bool
    error: str | None = None  # why the model cannot take these ids (a token past its embedding): a bad input
    grammar: Any = None  # what its output must match (structured outputs: its JSONL schema's, or the run's)
    breaks: tuple[int, ...] = ()  # where its prompt may break into segments (``Prompted.breaks``)


# texts and their JSONL objects (or None) -> their tokens (``Generator.encode``)
Encode = Callable[[Sequence[str], Sequence[Any]], list[Encoded]]


class Input(Protocol):
    """What :func:`tokenise` reads of an input (the pipeline's ``Record``, or :class:`Text`)."""

    @property
    def index(self) -> int: ...

    @property
    def text(self) -> str: ...  # empty or blank: nothing to generate

    @property
    def where(self) -> str: ...


@dataclass(frozen=True)
class Text:
    """One text given to ``Generator.generate_iterable``."""

    index: int
    text: str

    @property
    def where(self) -> str:
        return f"input {self.index + 1}"


@dataclass
class Item:
    """One input: its position, its token ids (``None``: nothing to generate) and what to report it as."""

    index: int  # position among all inputs, 0-based
    ids: list[int] | None
    where: str  # e.g. "data.txt:17", for messages
    truncated: bool = False
    record: Any = None  # the caller's own object, handed back in the Result (the pipeline's Record)
    error: str | None = None  # why its tokens cannot run, naming it (``ids`` is then ``None``): a bad input
    grammar: Any = None  # what its output must match (``Encoded.grammar``)
    breaks: tuple[int, ...] = ()  # where its prompt may break into segments (``Encoded.breaks``)


@dataclass
class Chunk:
    """Items in input order; ``starved``: no further input was waiting when it was made (a slow pipe)."""

    items: list[Item]
    starved: bool = False


@dataclass
class ItemBatch:
    """Items the batcher cut to run together (one width bucket); the model sees them padded as a
    ``search.protocol.Batch``."""

    items: list[Item]
    window: int  # which look-ahead window it came from (0, 1, ...)


@dataclass
class Result:
    """One input's outcome: generated token ids per returned sequence (and their scores where the run gives
    them), or nothing and maybe an error."""

    item: Item
    sequences: list[list[int]] | None = None
    error: str | None = None
    scores: list[Scored] | None = None  # one per sequence


class Scored(NamedTuple):
    """An output's scores, in float32 as the search computed them (``--scores``)."""

    score: float  # beam search: generate()'s sequences_scores (length-penalised); else the log_prob
    log_prob: float  # the summed log-probabilities of its tokens under the processed scores (EOS included)
    tokens: list[float] | None = None  # each token's log-prob (None: the search kept none, capture's beam search)
    # --logprobs: each token's raw log-prob (before the processors) and the step's best (id, log-prob)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class Generated(NamedTuple):
    """A batch's outputs: per input its sequences (best first) and, where asked for, their scores."""

    sequences: list[list[list[int]]]
    scores: list[list[Scored]] | None = None


def tokenise(inputs: Sequence[Input], encode: Encode) -> list[Item]:
    """Items for ``inputs`` in order (each input the item's ``record``), tokenised by one ``encode`` call; a
    blank text's item has no ``ids`` (nothing to generate), nor has an input whose tokens the model cannot take
    (``Encoded.error``): its ``error`` names it, for the caller's ``--on-error`` (a bad line, not a crash)."""
    items = [Item(x.index, None, x.where, record=x) for x in inputs]
    todo = [it for it in items if it.record.text.strip()]
    if todo:
        texts, fields = [it.record.text for it in todo], [getattr(it.record, "fields", None) for it in todo]
        for it, enc in zip(todo, encode(texts, fields), strict=True):
            if enc.error is not None:
                it.error = f"{it.where}: {enc.error}"
            else:
                it.ids, it.truncated, it.grammar, it.breaks = enc.ids, enc.truncated, enc.grammar, enc.breaks
    return items


def text_chunks(texts: Iterable[str], encode: Encode) -> Iterator[Chunk]:
    """Tokenised items of ``texts`` in input order, :data:`CHUNK_SIZE` at a time (``Generator.generate_iterable``;
    the file pipeline's reader thread does the same from records)."""
    group: list[Text] = []
    for index, text in enumerate(texts):
        group.append(Text(index, text))
        if len(group) == CHUNK_SIZE:
            yield Chunk(tokenise(group, encode))
            group = []
    if group:
        yield Chunk(tokenise(group, encode))


def pad_ids(
    batch: Sequence[Sequence[int]], width: int, pad_id: int, left: bool, device: Any
) -> tuple[Any, Any]:
    """Token ids padded to a ``[B, width]`` rectangle (right: encoder-decoder sources; ``left``: decoder-only
    prompts) and its mask, int64 on ``device``.

    ``width`` is the :func:`~seqgen_cli.shapes.input_width` of the longest input: an input batched with others of
    its bucket (``Batcher``) gets the width it has alone, so its output does not depend on its neighbours. The
    rectangle is built on the host; for a CUDA device in pinned memory, copied with ``non_blocking=True`` so the
    host queues the copy and goes on (the caching host allocator keeps the pinned block until the copy is done).
    """
    import torch

    pinned = torch.device(device).type == "cuda"
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long, pin_memory=pinned)
    mask = torch.zeros((len(batch), width), dtype=torch.long, pin_memory=pinned)
    for i, ids in enumerate(batch):
        cols = slice(width - len(ids), width) if left else slice(0, len(ids))
        input_ids[i, cols] = torch.tensor(ids, dtype=torch.long)
        mask[i, cols] = 1
    return input_ids.to(device, non_blocking=pinned), mask.to(device, non_blocking=pinned)


def break_table(breaks: Sequence[Sequence[int]], device: Any) -> Any:
    """Each prompt's breaks (``Encoded.breaks``) as ``Batch.breaks``: [B, K] int64 on ``device``, 0 past a prompt's
    own; ``None`` where no prompt has one."""
    import torch

    k = max(map(len, breaks), default=0)
    if not k:
        return None
    return torch.tensor([[*b, *[0] * (k - len(b))] for b in breaks], dtype=torch.long).to(device)


T = TypeVar("T")


class InOrder(Generic[T]):
    """Reassembly buffer: values :meth:`add`-ed by input index in any order come out of :meth:`ready` in input
    order, each as soon as every earlier one has come out."""

    def __init__(self, start: int = 0) -> None:
        self.next = start  # index of the next value to come out
        self.pending: dict[int, T] = {}  # added, not out yet

    def add(self, index: int, value: T) -> None:
        self.pending[index] = value

    def add_all(self, pairs: Iterable[tuple[int, T]]) -> None:
        self.pending.update(pairs)

    def ready(self) -> Iterator[T]:
        """The values that are next in order, removed as they are taken."""
        while self.next in self.pending:
            value = self.pending.pop(self.next)
            self.next += 1
            yield value


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes a batch may hold, and what a batch of ``inputs`` inputs padded to ``width`` tokens holds. ``limit``:
    the budget, or a function that says it when each batch is cut (``budget.DeviceBudget.memory_limit``: the
    device budget, read again as shapes run; ``None``: no limit)."""

    limit: int | Callable[[], int | None]
    cost: Callable[[int, int], int]  # (inputs, width) -> bytes (Generator.batch_bytes)

    @property
    def budget(self) -> int | None:
        return self.limit() if callable(self.limit) else self.limit


def default_window(batch_size: int) -> int:
    """Inputs read ahead and sorted by length: 16 batches, at least ``MIN_WINDOW``."""
    return max(16 * batch_size, MIN_WINDOW)


def plan_batches(
    lengths: list[int],
    batch_size: int,
    batch_tokens: int | None,
    rows: int = 1,
    sort: bool = True,
    memory: MemoryLimit | None = None,
    buckets: bool = True,
    width: Callable[[int], int] = input_width,
) -> Iterator[list[int]]:
    """Positions grouped into batches of one :func:`~seqgen_cli.shapes.input_width` each: shortest first when
    ``sort``, else bucket by bucket, in the given order within each. ``buckets=False`` (backends that run each
    input at its own width, and the refill engine): batches mix widths, cut by size and budget (at the batch's
    widest) only. ``width``: an input's padded width for its length (``Generator.width``: its own length, no
    padding, for a model whose outputs depend on it). One batch at a time: the memory budget is read as each batch
    is cut, so a budget read again after a batch ran applies to the rest of its window."""
    widths = [width(n) for n in lengths]
    order = sorted(range(len(lengths)), key=(lengths if sort else widths).__getitem__)
    batch: list[int] = []
    widest = 0  # the batch's width: its widest input's
    for i in order:
        padded = max(widest, widths[i])
        budget = None if memory is None else memory.budget
        over = (batch_tokens is not None and padded * (len(batch) + 1) * rows > batch_tokens) or (
            memory is not None and budget is not None and memory.cost(len(batch) + 1, padded) > budget
        )
        if batch and ((buckets and widths[batch[0]] != widths[i]) or len(batch) >= batch_size or over):
            yield batch
            batch, padded = [], widths[i]
        batch.append(i)
        widest = padded
    if batch:
        yield batch


class Batcher:
    """Turns chunks of items into batches; items with nothing to generate go to ``passthrough``.

    A window is cut when it holds its size in inputs, at the end of the input, or when the reader is
    starved (only a pipe with nothing more to read yet: ``Chunk.starved``), so a slow producer still sees its
    outputs early; batches then depend on timing, outputs do not (module docstring). With ``grow``, windows
    grow: the first holds ``batch_size`` inputs, each next one four times as many, up to ``window``, so the first
    outputs come after one batch, not after a whole look-ahead (``seqgen generate ... | head``); the smaller
    windows' batches fill less well, so a run takes a few per cent longer. ``window <= 1`` turns sorting off:
    windows of ``batch_size`` inputs, batched in input order within each width bucket.
    """

    def __init__(
        self,
        chunks: Iterator[Chunk],
        passthrough: Callable[[list[Item]], None],
        *,
        batch_size: int,
        batch_tokens: int | None = None,
        rows: int = 1,
        window: int | None = None,
        memory: MemoryLimit | None = None,
        buckets: bool = True,
        grow: bool = False,
        width: Callable[[int], int] = input_width,
    ) -> None:
        self._chunks = chunks
        self.grow = grow
        self.buckets = buckets  # batches of one width bucket each (plan_batches)
        self.width = width  # an input's padded width for its length (plan_batches)
        self._passthrough = passthrough
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.rows = rows
        self.memory = memory
        window = default_window(batch_size) if window is None else window
        self.sort = window > 1
        self.window = window if self.sort else batch_size
        self.source_tokens = 0  # real source tokens in generated batches
        self.padded_tokens = 0  # the same, padded to each batch's width bucket
        self.batches = 0
        self._windows = 0
        self._stopped = False

    def stop(self) -> None:
        """Finish the current window's batches, then end (read no further)."""
        self._stopped = True

    @property
    def window_size(self) -> int:
        """Inputs the next window holds: ``window``; with ``grow``, ``batch_size``, four times as many per window,
        up to ``window``."""
        return min(self.window, self.batch_size << min(2 * self._windows, 30)) if self.grow else self.window

    @property
    def padding_ratio(self) -> float:
        """Share of the padded source tokens that are padding."""
        return 1 - self.source_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def _cut(self, pending: list[Item]) -> Iterator[ItemBatch]:
        lengths = [len(it.ids or ()) for it in pending]
        window = self._windows
        self._windows += 1
        plan = plan_batches(
            lengths,
            self.batch_size,
            self.batch_tokens,
            self.rows,
            self.sort,
            self.memory,
            self.buckets,
            self.width,
        )
        for idx in plan:
            self.source_tokens += sum(lengths[i] for i in idx)
            self.padded_tokens += sum(self.width(lengths[i]) for i in idx)
            self.batches += 1
            yield ItemBatch([pending[i] for i in idx], window)

    def __iter__(self) -> Iterator[ItemBatch]:
        pending: list[Item] = []
        try:
            for chunk in self._chunks:
                if self._stopped:
                    return
                skip = [it for it in chunk.items if it.ids is None]
                if skip:
                    self._passthrough(skip)
                pending.extend(it for it in chunk.items if it.ids is not None)
                while len(pending) >= self.window_size and not self._stopped:
                    size = self.window_size
                    head, pending = pending[:size], pending[size:]
                    yield from self._cut(head)
                if pending and chunk.starved and not self._stopped:
                    yield from self._cut(pending)
                    pending = []
        except Exception:
            if pending and not self._stopped:  # generate what came before a bad line, then raise
                yield from self._cut(pending)
            raise
        if pending and not self._stopped:
            yield from self._cut(pending)


class Generates(Protocol):
    def generate_output(
        self,
        batch: Sequence[Sequence[int]],
        indices: Sequence[int] | None = None,
        grammars: Sequence[Any] = (),
        breaks: Sequence[Sequence[int]] = (),
    ) -> Generated: ...


def free_device_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate_split(gen: Generates, items: list[Item]) -> list[Result]:
    """Generate for ``items``; on out-of-memory split the batch in halves and retry, down to one input.

    A single input that still fails (out of memory, or a ``SeqgenError``) comes back as a ``Result`` whose
    ``error`` names its line.
    """
    try:
        grammars = [it.grammar for it in items]  # structured outputs: each input's (passed where any has one)
        own: dict[str, Any] = {"grammars": grammars} if any(g is not None for g in grammars) else {}
        if any(it.breaks for it in items):  # decoder-only prompts with breaks (the prompt tree)
            own["breaks"] = [it.breaks for it in items]
        out = gen.generate_output([it.ids for it in items], [it.index for it in items], **own)
        scores = out.scores if out.scores is not None else [None] * len(items)
        return [Result(it, seqs, None, sc) for it, seqs, sc in zip(items, out.sequences, scores, strict=True)]
    except Exception as err:  # noqa: BLE001 - only out-of-memory and user errors are handled
        if not (is_oom(err) or isinstance(err, SeqgenError)):
            raise
        failure = "out of memory" if is_oom(err) else str(err)
    # Outside the except block, so the failed attempt's tensors can be freed before the retry.
    free_device_memory()
    if len(items) == 1:
        it = items[0]
        n = len(it.ids or ())
        if failure == "out of memory" and hasattr(gen, "out_of_memory"):  # a Generator says what it needed
            failure = gen.out_of_memory(n)
        return [Result(it, None, f"{it.where}: {failure} (input of {n} tokens, run alone)")]
    half = len(items) // 2
    return generate_split(gen, items[:half]) + generate_split(gen, items[half:])
