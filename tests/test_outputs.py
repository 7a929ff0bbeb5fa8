"""``outputs.py``: an output's text as written, the stop string cut and the reasoning split off."""

from __future__ import annotations

import pytest

from seqgen_cli.outputs import OutputText, Text, cut_at_stop, split_reasoning


@pytest.mark.parametrize(
    ("text", "split"),
    [
        ("<think>\nfirst, the verb\n</think>\n\nDas Haus", Text("Das Haus", "first, the verb")),  # Qwen3
        ("the verb goes last\n</think>\n\nDas Haus", Text("Das Haus", "the verb goes last")),  # R1: opened earlier
        ("<think>\n\n</think>\n\nDas Haus", Text("Das Haus", "")),  # Qwen3, enable_thinking=False
        ("<think>\nstill thinking when the tokens ran", Text("", "still thinking when the tokens ran")),
        ("Das Haus", Text("Das Haus", None)),
        ("a </think> b </think> c", Text("b </think> c", "a")),  # the first closing tag ends the reasoning
        ("Das Haus\n", Text("Das Haus\n", None)),  # an answer keeps its own whitespace
    ],
)
def test_the_first_closing_tag_splits_reasoning_from_answer(text: str, split: Text) -> None:
    assert split_reasoning(text) == split


@pytest.mark.parametrize(
    ("text", "stops", "cut"),
    [
        ("Das Haus ist klein.\n", ["\n"], "Das Haus ist klein."),
        ("one. two\nthree", ["\n", "."], "one"),  # the first place any stop begins
        ("no stop here", ["\n"], "no stop here"),
        ("ends in the stop###", ["###"], "ends in the stop"),
    ],
)
def test_the_text_ends_before_the_first_stop(text: str, stops: list[str], cut: str) -> None:
    assert cut_at_stop(text, stops) == cut


def test_output_text_cuts_then_splits_as_asked() -> None:
    decoded = {1: "<think>hm\n</think>\n\nJa.\nmore", 2: "Nein.\nmore"}

    def decode(seqs):
        return [decoded[s[0]] for s in seqs]

    seqs = [[1], [2]]
    assert OutputText(decode, ("\n",))(seqs) == [Text("<think>hm"), Text("Nein.")]  # the first newline ends it
    assert OutputText(decode, ("\n",), keep_stop=True)(seqs) == [Text(decoded[1]), Text(decoded[2])]
    whole = OutputText(decode, ("more",), reasoning="field")(seqs)
    assert whole == [Text("Ja.\n", "hm"), Text("Nein.\n", None)]
    assert OutputText(decode, ("more",), reasoning="strip")(seqs) == [Text("Ja.\n"), Text("Nein.\n")]
