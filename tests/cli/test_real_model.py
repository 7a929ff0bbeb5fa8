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


def test_ctranslate2_decodes_from_the_checkpoints_start_token(tmp_path) -> None:
    """CTranslate2's Pegasus converter sets its start token to ``<blank>``; this checkpoint starts from ``<s>``:
    seqgen's conversion (``bench.ct2.convert``) starts where transformers does, so CT2 gives the known outputs."""
    pytest.importorskip("ctranslate2")
    shared = shared_dir()
    model = shared / "models" / "aren-transliteration" if shared else None
    if model is None or not model.is_dir():
        pytest.skip("../shared/models/aren-transliteration absent")
    import ctranslate2
    from transformers import AutoTokenizer

    from seqgen_cli.bench import ct2

    path = ct2.convert(str(model), cache=tmp_path)
    tok = AutoTokenizer.from_pretrained(str(model))
    tokens = [tok.convert_ids_to_tokens(tok(" ".join(name))["input_ids"]) for name in NAMES]
    for beams in (1, 4):
        results = ctranslate2.Translator(str(path)).translate_batch(tokens, beam_size=beams)
        outs = [tok.decode(tok.convert_tokens_to_ids(r.hypotheses[0]), skip_special_tokens=True) for r in results]
        assert outs == EXPECTED, beams
