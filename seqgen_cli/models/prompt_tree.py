"""The prompt tree: each prompt *segment*'s keys and values computed once per run, for every prompt that begins with
the same tokens (a system turn, few-shot examples, a task's instruction; several different ones in one run).

A prompt's *breaks* are where its prompter says a shared part may end (``prompts.Prompter``: after each message of a
conversation but the last, before the input's text); :func:`segment_ends` keeps those at least :data:`MIN_SEGMENT`
tokens past the one before, so a prompt is a chain of segments. A segment's K/V is computed over its prefix's (the
segments before it, :meth:`~seqgen_cli.models.prefill.Prefill.over`) and kept here by the prompt's tokens up to its
end and the segment ends before (:func:`segment_key`); a later prompt with the same ones reuses it instead of computing it again, in this batch or a later one.

Exactness. A segment's arithmetic runs at widths that follow from its own prefix and its own length
(``shapes.input_width`` of each), and its breaks from its prompt's own text, so a prompt's K/V (and its outputs) do
not depend on which prompts come beside it or before it: reusing a segment only saves computing it again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import Tensor

MIN_SEGMENT = 16  # tokens: a break closer than this to the one before is not kept (a forward of its own is not worth it)
TREE_BYTES = 1 << 30  # the segments' K/V kept for later prompts; the least recently used go first

# a segment: its prompt's segment ends up to its own, and the prompt's tokens up to there (both decide its bits)
Key = tuple[tuple[int, ...], tuple[int, ...]]


def segment_key(prompt: Sequence[int], ends: Sequence[int], j: int) -> Key:
    """The :data:`Key` of ``prompt``'s segment ``j`` (``ends``: :func:`segment_ends`)."""
    return tuple(ends[: j + 1]), tuple(prompt[: ends[j]])


def span(key: Key) -> tuple[int, int]:
    """The positions a segment covers: ``(start, end)`` (its start is the segment end before it, or 0)."""
    ends = key[0]
    return (ends[-2] if len(ends) > 1 else 0), ends[-1]


def segment_ends(length: int, breaks: Sequence[int]) -> list[int]:
    """Where a prompt of ``length`` tokens with ``breaks`` (token counts) splits: the breaks at least
    :data:`MIN_SEGMENT` tokens past the one kept before (or the start) and short of the end, then ``length``."""
    ends: list[int] = []
    for b in sorted(set(breaks)):
        if b - (ends[-1] if ends else 0) >= MIN_SEGMENT and b < length:
            ends.append(b)
    return [*ends, length]


class PromptTree:
    """Segments' K/V (``[L, 2, Hkv, s, d]``: every layer's keys and values of the segment's ``s`` tokens) by their
    :data:`Key`, at most ``budget`` bytes. ``stats`` (``--stats`` ``prompt_tree``): segments computed, those reused
    by another prompt, the tokens prefilled through segments and the tokens reused instead."""

    def __init__(self, budget: int = TREE_BYTES) -> None:
        self.budget = budget
        self.kept: OrderedDict[Key, Tensor] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.reused: set[Key] = set()  # kept segments another prompt has taken
        self.stats = {"segments": 0, "shared": 0, "tokens": 0, "saved": 0}

    def chain(self, prompt: Sequence[int], ends: Sequence[int]) -> list[Tensor]:
        """The kept K/V of ``prompt``'s first segments (``ends``: :func:`segment_ends`, the last one never kept), as
        far as every one is kept; the deeper ones are dropped after the shallower (reused last, so kept longer)."""
        found = []
        for j in range(len(ends) - 1):
            key = segment_key(prompt, ends, j)
            kv = self.kept.get(key)
            if kv is None:
                break
            found.append((key, kv))
        for key, kv in reversed(found):
            self.kept.move_to_end(key)
            self.took(key, kv)
        return [kv for _, kv in found]

    def took(self, key: Key, kv: Tensor) -> None:
        """A prompt reuses the segment ``key`` (kept, or computed for another prompt of its batch)."""
        if key not in self.reused:
            self.reused.add(key)
            self.stats["shared"] += 1
        self.stats["saved"] += int(kv.shape[3])

    def computed(self, key: Key, kv: Tensor, keep: bool) -> None:
        """A segment was computed; ``keep``: a prompt may go on past it (the last segment of a prompt that is not
        another's prefix is not kept)."""
        self.stats["segments"] += 1
        self.stats["tokens"] += int(kv.shape[3])
        if not keep or kv.nbytes > self.budget:
            return
        if (old := self.kept.pop(key, None)) is not None:  # kept still, below a dropped parent: computed again
            self.nbytes -= old.nbytes
        self.kept[key] = kv  # the newest
        self.nbytes += kv.nbytes
        while self.nbytes > self.budget:
            old, gone = self.kept.popitem(last=False)
            self.nbytes -= gone.nbytes
            self.reused.discard(old)
