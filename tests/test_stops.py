"""Stop strings and stop token ids (``stops.py``): the checkpoint's stop strings then ``--stop``'s, each list
checked in one line naming its source; ``--stop-token-id``'s ids added once to the EOS ids."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from seqgen_cli.errors import SeqgenError
from seqgen_cli.rules import CHECKPOINT, FLAG
from seqgen_cli.stops import MOST_STOPS, all_stops, check_stop_strings, with_stop_tokens


def test_the_checkpoints_stop_strings_come_first() -> None:
    assert all_stops("###", ["\n\n"]) == ["###", "\n\n"]
    assert all_stops(None, []) is None  # none: generate() runs no stop check


@pytest.mark.parametrize(
    ("value", "source", "message"),
    [
        ("", FLAG, "--stop '': an empty stop string stops nothing: drop it"),
        (
            {"a": 1},
            CHECKPOINT,
            f"{CHECKPOINT}: stop_strings = {{'a': 1}}: must be a string or a list of strings",
        ),
        (
            [f"s{i}" for i in range(MOST_STOPS + 1)],
            FLAG,
            f"{MOST_STOPS + 1} stop strings: at most {MOST_STOPS}",
        ),
    ],
)
def test_stop_strings_that_stop_nothing_or_cost_a_minute_are_one_line(
    value, source: str, message: str
) -> None:
    with pytest.raises(SeqgenError) as err:
        check_stop_strings(value, source)
    assert str(err.value).startswith(message)


def test_stop_token_ids_join_the_eos_ids_once() -> None:
    config = GenerationConfig(eos_token_id=2)
    config.stop_token_id = [5, 2, 7]
    assert with_stop_tokens(config).eos_token_id == [2, 5, 7]
    assert with_stop_tokens(GenerationConfig(eos_token_id=[1, 2])).eos_token_id == [
        1,
        2,
    ]  # none given: as it was
