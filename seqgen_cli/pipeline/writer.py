"""Writer stage: a background thread detokenises and writes outputs, strictly in input order.

Results arrive in any order (batches are sorted by length); a reassembly buffer writes each output as
soon as every earlier one is written, so a pipe shows results early and memory holds at most the
outputs of the batches in flight.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from seqgen_cli.batching import InOrder, Item, Result, Scored
from seqgen_cli.outputs import Detokenise, OutputText
from seqgen_cli.pipeline.formats import InputDigest, input_key
from seqgen_cli.pipeline.queues import put_unless
from seqgen_cli.pipeline.records import SCORE_FIELDS, Record
from seqgen_cli.pipeline.resume import JournalReuse
from seqgen_cli.pipeline.sinks import Sink


def format_output(
    record: Record,
    outputs: list[str],
    output_format: str,
    output_field: str,
    error: str | None = None,
    scores: list[Scored] | None = None,
    scored: bool = False,
    complete: list[bool] | None = None,
    logprobs: list[Any] | None = None,
    reasoning: list[str | None] | None = None,
) -> str:
    """The output line(s) for one input, newline-terminated.

    Text: one line per returned sequence (``num_return_sequences`` consecutive lines, best first);
    newlines inside a generation become spaces so line alignment holds. JSONL: the input object
    (for text input ``{"text": line}``) with ``output_field`` set to the string, or to a list when more than one
    sequence is returned, and ``error`` set for an input that was skipped. ``scored`` (``--scores``): text lines
    begin ``score<TAB>log_prob<TAB>`` (empty for an input with none: blank, skipped), JSONL objects get ``score``,
    ``log_prob`` and ``token_log_probs`` (lists beside a list; ``null`` where none). ``complete`` (a grammar): each
    output's match is whole, JSONL's ``complete`` field. ``logprobs`` (``--logprobs``): each output's
    :func:`logprob_entries`, JSONL's ``logprobs`` field. ``reasoning`` (``--reasoning field``): each output's reasoning,
    JSONL's ``reasoning`` field.
    """
    numbers: list[Scored | None] = list(scores) if scores is not None else [None] * len(outputs)
    if output_format == "jsonl":
        obj = (
            dict(record.fields) if record.fields is not None else {"text": record.text}
        )  # text input: its line
        obj[output_field] = outputs[0] if len(outputs) == 1 else outputs
        if scored:
            for name, attribute in SCORE_FIELDS.items():
                values = [None if sc is None else getattr(sc, attribute) for sc in numbers]
                obj[name] = values[0] if len(values) == 1 else values
        if complete is not None:
            obj["complete"] = complete[0] if len(complete) == 1 else complete
        if logprobs is not None:
            obj["logprobs"] = logprobs[0] if len(logprobs) == 1 else logprobs
        if reasoning is not None:
            obj["reasoning"] = reasoning[0] if len(reasoning) == 1 else reasoning
        if error is not None:
            obj["error"] = error
        return json.dumps(obj, ensure_ascii=False, allow_nan=False) + "\n"
    lines = [" ".join(o.splitlines()) for o in outputs]
    if scored:
        leads = ["\t\t" if sc is None else f"{sc.score!r}\t{sc.log_prob!r}\t" for sc in numbers]
        lines = [lead + line for lead, line in zip(leads, lines, strict=True)]
    return "".join(line + "\n" for line in lines)


def logprob_entries(
    sequence: Sequence[int], scored: Scored | None, text: Detokenise
) -> list[dict[str, Any]] | None:
    """``--logprobs``' JSONL value for one output: per token its ``id``, ``token`` (its text alone), ``logprob``
    (raw) and ``top``, the step's best as the same fields; ``None`` for an input with none."""
    if scored is None or scored.logprobs is None:
        return None
    ids = list(dict.fromkeys([*sequence, *(i for _, top in scored.logprobs for i, _ in top)]))  # each id once
    words = dict(zip(ids, text([[i] for i in ids]), strict=True))
    return [
        {
            "id": t,
            "token": words[t],
            "logprob": lp,
            "top": [{"id": i, "token": words[i], "logprob": v} for i, v in top],
        }
        for t, (lp, top) in zip(sequence, scored.logprobs, strict=True)
    ]


_CLOSE = object()


class OrderedWriter:
    """Background writer: :meth:`put` results in any order; they reach ``sink`` in input order."""

    def __init__(
        self,
        sink: Sink,
        texts: OutputText,
        *,
        output_format: str = "text",
        output_field: str = "output",
        num_sequences: int = 1,
        start: int = 0,
        digest: InputDigest | None = None,
        keep: list[str] | None = None,
        reuse: JournalReuse | None = None,
        scores: bool = False,
        complete: Callable[[Item, Sequence[int]], bool | None] | None = None,
        logprobs: bool = False,
    ) -> None:
        self.sink = sink
        self._logprobs = logprobs  # --logprobs: each output's tokens in its JSONL object
        self._complete = complete  # an output's test against its input's grammar (None: it has none)
        self.incomplete = 0  # outputs generated here that ended before their grammar completed
        self._scores = scores  # --scores: each output's Scored in its line
        self._texts = texts  # the outputs' texts as written (texts.detokenise: a token's own text, --logprobs)
        self._format = output_format
        self._field = output_field
        self._n = num_sequences
        self._order: InOrder[tuple[Record, str, str]] = InOrder(start)  # (record, line(s), first output)
        self.digest = digest or InputDigest()
        self.keep = keep  # when a list: the first output of every input is appended (for scoring)
        # a resumed run's journaled outputs, handed over as the generate loop takes them (JournalReuse.take)
        self.reuse = reuse if reuse is not None else JournalReuse()
        self._q: queue.Queue = queue.Queue(maxsize=64)  # backpressure: a slow sink slows generation
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="seqgen-write", daemon=True)

    @property
    def next(self) -> int:
        """Index of the next input to write."""
        return self._order.next

    def start(self) -> OrderedWriter:
        self._thread.start()
        return self

    def put(self, results: list[Result]) -> None:
        if not put_unless(self._q, results, lambda: self.error is not None):
            assert self.error is not None
            raise self.error

    def close(self) -> None:
        """Stop the thread once every result put so far is written (what can be, in order) and committed."""
        put_unless(self._q, _CLOSE, lambda: not self._thread.is_alive())
        self._thread.join()
        if self.error is not None:
            raise self.error

    @property
    def waiting(self) -> int:
        """Outputs finished but waiting for an earlier input (journaled where the sink keeps a journal)."""
        return len(self._order.pending)

    def _whole(self, r: Result) -> list[bool] | None:
        """Whether each output of ``r`` completed its input's grammar; ``None`` where there is none."""
        if self._complete is None or r.sequences is None:
            return None
        whole = [self._complete(r.item, seq) for seq in r.sequences]
        return None if None in whole else [bool(w) for w in whole]

    def _listed(self, r: Result) -> list[Any]:
        """``--logprobs``' value for each output of ``r`` (``None`` for a blank or skipped input)."""
        if r.sequences is None:
            return [None] * self._n
        scores = r.scores or [None] * len(r.sequences)
        detokenise = self._texts.detokenise
        return [logprob_entries(seq, sc, detokenise) for seq, sc in zip(r.sequences, scores, strict=True)]

    def _loop(self) -> None:
        try:
            while (got := self._q.get()) is not _CLOSE:
                t0 = time.perf_counter()
                self._take(got)  # commits: nothing waits for a later commit
                self.seconds += time.perf_counter() - t0
        except BaseException as err:  # noqa: BLE001 - e.g. BrokenPipeError: raised in the main thread
            self.error = err

    def _take(self, results: list[Result]) -> None:
        """Format a batch's results, write what is next in order, journal the rest (then all is durable)."""
        seqs = [s for r in results if r.sequences is not None for s in r.sequences]
        texts = iter(self._texts(seqs) if seqs else [])
        field = self._texts.reasoning == "field"  # --reasoning field: JSONL's reasoning field
        fresh: list[int] = []  # generated by this batch (not found in a resumed run's journal)
        for r in results:
            index, record = r.item.index, r.item.record
            written = [next(texts) for _ in r.sequences] if r.sequences is not None else []
            outs = [t.answer for t in written] if r.sequences is not None else [""] * self._n
            reasoning = ([t.reasoning for t in written] or [None] * self._n) if field else None
            line = self.reuse.pop(index)
            if line is None:
                whole = self._whole(r)
                self.incomplete += whole.count(False) if whole else 0
                listed = self._listed(r) if self._logprobs else None
                line = format_output(
                    record, outs, self._format, self._field, r.error, r.scores, self._scores, whole, listed, reasoning
                )
                fresh.append(index)
            self._order.add(index, (record, line, outs[0] if outs else ""))
        for record, line, first in self._order.ready():
            self.sink.write(line.encode("utf-8", "surrogatepass"))
            self.digest.update(record)
            if self.keep is not None:
                self.keep.append(first)
        self.sink.commit(self.digest.hexdigest())
        waiting = self._order.pending
        self.sink.journal([(i, input_key(waiting[i][0]), waiting[i][1]) for i in fresh if i in waiting])
