"""Backend choice: every supported family gets its fast backend; anything else the generic one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

from seqgen_cli.generator import Generator
from seqgen_cli.models import (
    DecoderOnlyBackend,
    EncoderDecoderBackend,
    FastBackend,
    GenericBackend,
    backend_name,
    get_backend,
    inner_backend,
    own_widths,
)
from seqgen_cli.models.capture import capture
from seqgen_cli.models.families import FAMILIES as FAST_FAMILIES
from tests.tiny_models import FAMILIES, load_tiny


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_picks_the_fast_backend_for_each_family(tiny_models, family: str) -> None:
    path = tiny_models(family)
    model = load_tiny(path)[0]
    backend = get_backend(model)
    shared = EncoderDecoderBackend if model.config.is_encoder_decoder else DecoderOnlyBackend
    assert type(backend) is shared and backend.description is FAST_FAMILIES[model.config.model_type]
    assert isinstance(backend, FastBackend) and inner_backend(backend) is backend
    generic = get_backend(model, generic=True)
    assert isinstance(generic, GenericBackend) and not isinstance(generic, FastBackend)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_the_capture_wrapper_unwraps_to_the_fast_backend_it_runs(tiny_models, family: str) -> None:
    """``inner_backend`` reads through the capture wrapper by its declared ``unwrap`` (``fast.Wrapper``): the engine's
    name and widths are the wrapped backend's."""
    model = load_tiny(tiny_models(family))[0]
    fast = get_backend(model)
    # capture() decides by the device's type: nothing runs there
    wrapped, path = capture(fast, torch.device("cuda"), True, compiler=lambda decode: decode)
    assert path == "captured" and wrapped is not fast and inner_backend(wrapped) is fast
    assert backend_name(wrapped) == backend_name(fast) == f"{model.config.model_type} decoder"
    assert own_widths(wrapped) == own_widths(fast) == model.config.is_encoder_decoder


SHARED = ("decoder_only.py", "encoder_decoder.py", "prefill.py", "source.py")
# attribute names of one family's modules or config: the family files read them (``facts``), the shared code never
FAMILY_NAMES = (
    "embed_tokens rotary_emb embed_positions padding_idx compute_bias wpe wte ln_f n_head n_positions self_attn"
    " final_layer_norm layernorm_embedding"
).split()


def test_the_shared_decoders_name_no_familys_attributes() -> None:
    """The shared decoders read a model through its family file's facts (``layers.DecoderFacts``,
    ``layers.CausalFacts``) and transformers' standard accessors only."""
    models = Path(__file__).resolve().parents[2] / "seqgen_cli" / "models"
    texts = {name: (models / name).read_text() for name in SHARED}
    found = [(name, w) for name, text in texts.items() for w in FAMILY_NAMES if re.search(rf"\b{w}\b", text)]
    assert not found, found


def test_unlisted_family_runs_through_the_generic_backend(tmp_path: Path, tiny_models) -> None:
    """An architecture without a fast backend (OPT) still runs in seqgen's engine, exactly."""
    torch.manual_seed(0)
    gpt2_tok = AutoTokenizer.from_pretrained(tiny_models("gpt2"))
    config = OPTConfig(
        vocab_size=len(gpt2_tok), hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=256, pad_token_id=gpt2_tok.pad_token_id,
        bos_token_id=gpt2_tok.bos_token_id, eos_token_id=gpt2_tok.eos_token_id,
    )  # fmt: skip
    OPTForCausalLM(config).save_pretrained(tmp_path)
    gpt2_tok.save_pretrained(tmp_path)
    fast = Generator(str(tmp_path), backend="auto", max_new_tokens=6, num_beams=3)
    assert fast.backend == "fast" and fast.model.config.model_type not in FAST_FAMILIES
    hf = Generator(str(tmp_path), backend="hf", max_new_tokens=6, num_beams=3)
    texts = ["the cat sat on the mat", "once upon a time", "a"]
    assert fast.generate(texts) == hf.generate(texts)
    assert isinstance(fast._model_backend, GenericBackend)


@pytest.mark.parametrize(
    ("family", "flags", "engine"),
    [
        ("bart", [], "bart decoder"),
        ("t5", [], "t5 decoder"),
        ("t5", ["--dtype", "int8"], "t5 decoder"),
        ("gpt2", ["--dtype", "int8"], "gpt2 decoder"),
        ("llama", ["--dtype", "int8"], "llama decoder"),
        ("llama-dynamic", [], "generic (the fast decoder does not run this llama variant: rope_type 'dynamic'"),
    ],
)
def test_stats_and_the_closing_line_name_the_engine_that_ran(
    tiny_models, tmp_path: Path, family: str, flags: list[str], engine: str
) -> None:
    """``--stats`` ``device.engine`` and the closing line say whether the checkpoint got a fast decoder, and if
    not, why."""
    import json

    from tests.helpers import seqgen

    src = tmp_path / "in.txt"
    src.write_text("one two three\nfour five\n", encoding="utf-8")
    stats = tmp_path / "stats.json"
    model = tiny_models(family.removesuffix("-dynamic"))
    if family.endswith("-dynamic"):  # a variant the fast backend refuses: a length-dependent RoPE
        import shutil

        model = Path(shutil.copytree(model, tmp_path / "model"))
        config = json.loads((model / "config.json").read_text())
        rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        (model / "config.json").write_text(json.dumps(config | {"rope_parameters": rope}), encoding="utf-8")
    res = seqgen("generate", "-m", str(model), str(src), "-o", str(tmp_path / "out.txt"),
                 "--max-new-tokens", "3", "--stats", str(stats), *flags)  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert json.loads(stats.read_text())["device"]["engine"].startswith(engine)
    generic = engine.startswith("generic")  # not "fast (generic (...))": seqgen's engine did not run it
    assert f"backend {engine}" in res.stderr if generic else f"backend fast ({engine}" in res.stderr
