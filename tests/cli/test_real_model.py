"""The one real trained model in ../shared (Arabic->Latin transliteration, a Pegasus checkpoint):
seqgen's fast backend reproduces its known outputs and transformers' generate(), end to end."""

from __future__ import annotations

import pytest

from tests.helpers import seqgen
from tests.tiny_models import shared_dir

NAMES = ["آتزمون", "آتشيسون", "محمد", "بغداد", "ترامب"]
EXPECTED = ["atzmon", "achison", "mahmad", "baghdad", "tramp"]  # documented in ../shared/README.md


@pytest.mark.parametrize("beams", ["1", "4"])
def test_transliteration_model_end_to_end(beams: str) -> None:
    shared = shared_dir()
    model = shared / "models" / "aren-transliteration" if shared else None
    if model is None or not model.is_dir():
        pytest.skip("../shared/models/aren-transliteration absent")
    stdin = "".join(" ".join(name) + "\n" for name in NAMES)  # space-separated letters
    outs = {}
    for backend in ("auto", "hf"):
        res = seqgen(
            "generate", "-m", str(model), "--num-beams", beams, "--backend", backend, "-q", input=stdin
        )
        assert res.exit_code == 0, res.stderr
        outs[backend] = res.stdout.splitlines()
    assert outs["auto"] == EXPECTED
    assert outs["auto"] == outs["hf"]
