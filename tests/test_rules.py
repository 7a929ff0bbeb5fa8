"""The rules every generation setting is held to, whatever its source (``rules.py``): one per setting, each
refusal a line that names the value's source and the bounds as written; no transformers loaded to read them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from seqgen_cli.errors import SeqgenError
from seqgen_cli.rules import FLAG, GENERATION_KEYS, MOST, RULES, check_setting, describe


def test_every_generation_setting_has_a_rule() -> None:
    assert set(RULES) == set(GENERATION_KEYS)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("top_p", 1.5, "must be a finite number > 0 and <= 1"),
        ("num_beams", 2.0, f"must be a whole number >= 1 and <= {MOST}"),  # in full, not 2.14748e+09
        ("early_stopping", "sometimes", "must be true or false or never"),
        ("length_penalty", float("nan"), "must be a finite number"),
        ("forced_eos_token_id", [], f"must be a whole number >= 0 and <= {MOST}, or a list of them"),
    ],
)
def test_a_value_past_its_rule_says_what_the_rule_takes(key: str, value: object, problem: str) -> None:
    assert RULES[key].problem(value) == problem


@pytest.mark.parametrize(("key", "value"), [("early_stopping", "never"), ("forced_eos_token_id", [2, 3])])
def test_the_extra_values_a_rule_allows(key: str, value: object) -> None:
    assert RULES[key].problem(value) is None


def test_an_error_names_a_flag_as_typed_and_a_file_by_its_path() -> None:
    assert describe("num_beams", 0, FLAG) == "--num-beams 0"
    with pytest.raises(SeqgenError, match=r"^my\.toml: num_beams = 0: must be a whole number >= 1"):
        check_setting("num_beams", 0, "my.toml")


def test_the_rules_load_no_model_library() -> None:
    """``seqgen --help`` and ``seqgen presets`` read the rules, the presets and the stop checks: no transformers."""
    code = "import sys, seqgen_cli.rules, seqgen_cli.presets, seqgen_cli.stops; print('transformers' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr
