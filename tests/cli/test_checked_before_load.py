"""Every setting a run takes from a checkpoint or the command line is checked before the weights are read, in one
line naming where it came from: a checkpoint's ``stop_strings`` and other generation settings (the weights here are
broken on purpose, so an error about them would mean the check came too late), ``--stop``, a sharded index naming a
missing shard, a refused ``auto_map``, a missing ``langcodes``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from seqgen_cli.stops import MOST_STOPS
from tests.helpers import one_line_error, seqgen, write_lines
from tests.tiny_models import copy_checkpoint


@pytest.fixture
def broken(tiny_models, tmp_path: Path) -> Path:
    """The tiny GPT-2 with its weights cut in half: loading them fails (test_bad_inputs: "cannot load its weights")."""
    model = copy_checkpoint(tiny_models("gpt2"), tmp_path / "model")
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return model


def _set_generation(model: Path, **settings) -> Path:
    path = model / "generation_config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text(encoding="utf-8")), **settings}), encoding="utf-8"
    )
    return path


def _generate(model: Path, tmp_path: Path, *args: str):
    src = write_lines(tmp_path / "in.txt", ["an input"])
    return seqgen("generate", "-m", str(model), str(src), "--max-new-tokens", "3", "-q", *args)


@pytest.mark.parametrize("value", [5, [None], [["a"]], {"a": 1}, [""], ""])
def test_a_checkpoints_malformed_stop_strings_are_one_line_before_the_weights(
    broken, tmp_path, value
) -> None:
    """``5``, ``[null]``, ``[["a"]]`` crashed after the load (TypeError, AttributeError); a dict's keys were taken as
    stops; an empty string stopped nothing."""
    path = _set_generation(broken, stop_strings=value)
    one_line_error(_generate(broken, tmp_path), f"{path}: stop_strings = ")


def test_a_checkpoints_bad_setting_names_its_file_before_the_weights(broken, tmp_path) -> None:
    path = _set_generation(broken, num_beams=0)
    one_line_error(_generate(broken, tmp_path), f"{path}: num_beams = 0")
    assert (
        _generate(broken, tmp_path, "--num-beams", "2").exit_code != 0
    )  # replaced by a flag: the weights' error
    one_line_error(_generate(broken, tmp_path, "--num-beams", "2"), "cannot load its weights")


@pytest.mark.parametrize(
    ("stops", "needle"),
    [
        ([""], "--stop '': an empty stop string"),
        ([f"s{i}" for i in range(MOST_STOPS + 1)], f"at most {MOST_STOPS}"),
    ],
)
def test_stop_flags_that_stop_nothing_or_cost_a_minute_are_refused(broken, tmp_path, stops, needle) -> None:
    """``--stop ''`` did nothing; 1000 ``--stop`` strings took 74 s to start (transformers' tables per string)."""
    one_line_error(_generate(broken, tmp_path, *(a for s in stops for a in ("--stop", s))), needle)


def test_a_sharded_index_naming_a_missing_shard_is_one_line(tiny_models, tmp_path) -> None:
    model = copy_checkpoint(tiny_models("gpt2"), tmp_path / "model")
    weights = model / "model.safetensors"
    weights.rename(model / "part-1.safetensors")
    from safetensors import safe_open

    with safe_open(str(model / "part-1.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    index = {
        "metadata": {},
        "weight_map": {k: ("part-1.safetensors" if i else "part-2.safetensors") for i, k in enumerate(keys)},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    one_line_error(
        _generate(model, tmp_path), "model.safetensors.index.json names part-2.safetensors", "not in the"
    )


def test_a_refused_auto_map_names_its_classes(tiny_models, tmp_path) -> None:
    """The refusal printed ``dict_values([[...]])``."""
    model = copy_checkpoint(tiny_models("gpt2"), tmp_path / "model")
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(
        tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": ["tok.MyTokenizer", "tok.MyTokenizerFast"]}
    )
    path.write_text(json.dumps(config), encoding="utf-8")
    line = one_line_error(_generate(model, tmp_path), "(tok.MyTokenizer, tok.MyTokenizerFast)")
    assert "dict_values" not in line


def test_a_missing_langcodes_is_named_not_blamed_on_the_model(monkeypatch) -> None:
    """``--target-lang pt`` without langcodes said "not a target language of the model"."""
    from seqgen_cli.errors import SeqgenError
    from seqgen_cli.languages import same_language

    monkeypatch.setitem(sys.modules, "langcodes", None)  # import langcodes: ImportError
    with pytest.raises(SeqgenError, match=r"--target-lang pt: .*needs langcodes.*not installed.*por_Latn"):
        same_language("pt", {"por_Latn": 1, "deu_Latn": 2})
