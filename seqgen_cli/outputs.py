"""What an output's tokens become as the text written: detokenised (special tokens removed), the stop string that ended
it cut, and a thinking model's reasoning split from its answer.

Stop strings. A search ends an output at the step its text first reaches a stop string (``generate(stop_strings=...)``:
the tokens keep it). The text written ends before it, as vLLM's default (``include_stop_str_in_output=False``),
llama.cpp's and the OpenAI API's do; ``--keep-stop`` writes it, as transformers' decoded text has it.

Reasoning. Qwen3, QwQ, DeepSeek-R1 and Phi-4-reasoning write their reasoning between ``<think>`` and ``</think>``
before the answer (R1's template opens the ``<think>`` in the prompt: only the closing tag is in the output).
``--reasoning keep`` writes the output as generated; ``strip`` the answer alone; ``field`` the answer, and the
reasoning in a JSONL ``reasoning`` field (vLLM's ``--reasoning-parser``, llama.cpp's ``--reasoning-format``).

The tokens (``--scores``, ``--logprobs``) stay those of the whole output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

OPEN, CLOSE = "<think>", "</think>"
REASONING = ("keep", "strip", "field")  # --reasoning

Detokenise = Callable[[Sequence[Sequence[int]]], list[str]]  # token ids -> text, per output


class Text(NamedTuple):
    """An output's text as written, and its reasoning where split off (``--reasoning field``; else ``None``)."""

    answer: str
    reasoning: str | None = None


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` before the first place any of ``stops`` begins (the one that ended it), or whole."""
    first = min((at for at in (text.find(stop) for stop in stops) if at >= 0), default=-1)
    return text if first < 0 else text[:first]


def split_reasoning(text: str) -> Text:
    """``text`` as answer and reasoning: up to the first ``</think>`` is reasoning (less a leading ``<think>`` and
    the whitespace around it), the rest the answer (less the whitespace after the tag). An output cut short while
    thinking (a ``<think>`` never closed) is all reasoning, its answer empty; one with neither tag all answer."""
    head, closed, tail = text.partition(CLOSE)
    if closed:
        return Text(tail.lstrip(), head.strip().removeprefix(OPEN).strip())
    if text.lstrip().startswith(OPEN):
        return Text("", text.strip().removeprefix(OPEN).strip())
    return Text(text, None)


@dataclass(frozen=True)
class OutputText:
    """A run's outputs' texts (``Generator.texts``): ``detokenise``'s, the first of ``stops`` cut unless ``keep_stop``,
    the reasoning as ``reasoning`` says (:data:`REASONING`)."""

    detokenise: Detokenise
    stops: tuple[str, ...] = ()
    keep_stop: bool = False
    reasoning: str = "keep"

    def __call__(self, sequences: Sequence[Sequence[int]]) -> list[Text]:
        texts = self.detokenise(sequences)
        if self.stops and not self.keep_stop:
            texts = [cut_at_stop(t, self.stops) for t in texts]
        if self.reasoning == "keep":
            return [Text(t) for t in texts]
        split = [split_reasoning(t) for t in texts]
        return split if self.reasoning == "field" else [Text(s.answer) for s in split]
