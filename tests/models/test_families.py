"""The fast families beyond the checkpoint fixtures (``tests/tiny_models.py``: ``FAMILY_CONFIGS``): each a tiny
random model built from its transformers config (``family_model``), run on its fast decoder (a test fails if it
falls back to the generic backend) and token-identical to ``generate()`` in float32: a batch, the refill engine's
lanes, the captured (static) step, and its int8 variant on the fast decoder."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import DecoderOnlyBackend, EncoderDecoderBackend, backend_name, get_backend
from seqgen_cli.models.capture import CapturedBackend
from seqgen_cli.models.families import FAMILIES
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.models.linear_maps import is_quantized
from seqgen_cli.search import generate
from tests.equivalence import MASKED_SUM_RTOL, SETTINGS, check_equivalence, refill
from tests.helpers import with_fixture_tokenizer
from tests.models.neighbours import check_neighbours
from tests.tiny_models import FAMILY_CONFIGS, LLAMA_SHAPE, V, family_model, sharpen, sources

NAMES = list(FAMILY_CONFIGS)
QUICK = ("greedy", "beam4_ngram3_lp2_minmax_es")


@pytest.mark.parametrize("name", NAMES)
def test_each_family_runs_its_fast_decoder(name: str) -> None:
    m = family_model(name)
    backend = get_backend(m)
    shared = EncoderDecoderBackend if m.config.is_encoder_decoder else DecoderOnlyBackend
    assert type(backend) is shared and backend.description is FAMILIES[name]
    assert backend_name(backend) == f"{name} decoder"


@pytest.mark.parametrize("setting", QUICK)
@pytest.mark.parametrize("name", NAMES)
def test_equivalence(name: str, setting: str) -> None:
    m = family_model(name)
    result = check_equivalence(m, get_backend, sources(m.config), SETTINGS[setting])
    print(f"{name} {setting}: {result.summary()}")
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    assert result.identical == result.total or SETTINGS[setting].get("num_beams", 1) > 1


@pytest.mark.parametrize("name", NAMES)
def test_refill_equivalence(name: str) -> None:
    """Inputs joining the lanes at many steps: the lane caches (per-lane positions, relative bias per layer,
    rotary per layer type) as exact as a batch."""
    m = family_model(name)
    kwargs = SETTINGS["beam4_ngram3_lp2_minmax_es"]
    result = check_equivalence(
        m, get_backend, sources(m.config, seed=1), kwargs, engine=refill(lanes=3, seed=2), rtol=MASKED_SUM_RTOL
    )
    assert not result.mismatches, "\n".join(result.mismatches[:5])


@pytest.mark.parametrize("name", NAMES)
def test_static_step_equivalence(name: str) -> None:
    """The captured path's static step (eager here: padded lanes and widths, span buckets, compaction)."""
    m = family_model(name)

    def factory(model: torch.nn.Module) -> CapturedBackend:
        return CapturedBackend(get_backend(model), lambda decode: decode)

    result = check_equivalence(m, factory, sources(m.config, seed=3), SETTINGS["greedy"], rtol=MASKED_SUM_RTOL)
    assert not result.mismatches and result.identical == result.total, "\n".join(result.mismatches[:5])


@pytest.mark.parametrize("name", NAMES)
def test_int8_runs_the_fast_decoder(name: str) -> None:
    """``--dtype int8`` keeps the family on its fast decoder: every layer map and the LM head int8 copies."""
    import copy

    m = copy.deepcopy(family_model(name))
    backend = get_backend(m, int8=True)
    assert not isinstance(backend, GenericBackend) and backend.int8 and is_quantized(backend.lm)
    layers = backend.layers
    assert all(is_quantized(f) for lay in layers for f in lay.maps.values())
    batch = sources(m.config, 4)
    state, first = backend.start(batch, 2, 3)
    tokens = torch.full((8,), getattr(m.config, "decoder_start_token_id", None) or 5)
    assert torch.isfinite(backend.step(state, tokens)).all()


def test_refused_variants_name_their_reason() -> None:
    """A length-dependent RoPE (Phi-3.5's longrope) runs the generic backend, which says why; so would an
    attention kind no decoder writes (Llama 4's chunked attention)."""
    from types import SimpleNamespace

    from seqgen_cli.models.families import refusal

    phi3 = tf.Phi3Config(**LLAMA_SHAPE, sliding_window=None, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 32})  # fmt: skip
    backend = get_backend(tf.AutoModelForCausalLM.from_config(phi3))
    assert isinstance(backend, GenericBackend) and "length-dependent RoPE" in backend.reason
    chunked = tf.Qwen3Config(**LLAMA_SHAPE).to_dict() | {"layer_types": ["chunked_attention", "full_attention"]}
    assert "chunked_attention" in refusal(SimpleNamespace(config=SimpleNamespace(**chunked)))
    assert refusal(SimpleNamespace(config=tf.Qwen3Config(**LLAMA_SHAPE))) is None


def test_m2m100_a_generated_pad_token_takes_the_padding_position() -> None:
    """M2M-100 / NLLB number positions from the tokens: a pad token fed to the decoder takes the padding row of
    the sinusoid table (zeros), not its step's. A model biased towards pad generates it mid-sequence."""
    import copy

    m = copy.deepcopy(family_model("m2m_100"))
    pad = m.config.pad_token_id
    with torch.no_grad():
        m.get_output_embeddings().bias[pad] += 6.5  # pads among other tokens (7.5: nearly only pads)
    batch = sources(m.config)
    config = resolve_generation_config(m.generation_config, None, SETTINGS["greedy"])
    ours = generate(get_backend(m), batch, config).sequences
    assert any(pad in list(seq[0][:-1]) for seq in ours)  # fed back to the decoder mid-sequence
    result = check_equivalence(m, get_backend, batch, SETTINGS["greedy"])
    assert not result.mismatches and result.identical == result.total, "\n".join(result.mismatches[:5])


@pytest.mark.slow  # inductor compiles: a few seconds of CPU per family
@pytest.mark.parametrize(
    "name", ["m2m_100", "pegasus_x", "umt5", "t5gemma", "t5gemma2", "phi3", "gemma2", "gemma3_text"]
)
def test_static_step_compiles_whole(name: str) -> None:
    """What the captured path compiles on CUDA, under the real inductor on the CPU: one graph per shape
    (``fullgraph=True``, no dynamic shapes), the eager static step's logits (inductor reassociates sums:
    :data:`~tests.equivalence.COMPILED_TOL`), through a beam reordering."""
    from seqgen_cli.models.lane_table import run_step
    from tests.equivalence import COMPILED_TOL

    m = family_model(name)
    backend = get_backend(m)
    torch._dynamo.reset()
    compiled = torch.compile(backend.decode, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    batch = sources(m.config, 3, seed=4)
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        states = [backend.start(batch, 2, 6)[0] for _ in range(2)]
        for state in states:
            state.cache.make_static()
        for t in range(5):
            tokens = torch.randint(4, V, (6,), generator=g)
            expected = run_step(backend.decode, states[0], tokens)
            got = run_step(compiled, states[1], tokens)
            torch.testing.assert_close(got, expected, rtol=COMPILED_TOL, atol=COMPILED_TOL)
            if t == 1:
                for state in states:
                    backend.reorder(state, torch.tensor([1, 1, 2, 3, 5, 4]))


def test_led_takes_sources_as_long_as_its_encoder() -> None:
    """LED's config names its encoder's positions (16,384 in led-large-16384) apart from its decoder's (1,024):
    the source limit is the encoder's, not the tokenizer's default."""
    from types import SimpleNamespace

    from seqgen_cli.loading import source_limit

    config = tf.LEDConfig(max_encoder_position_embeddings=16384, max_decoder_position_embeddings=1024)
    assert source_limit(config, SimpleNamespace(model_max_length=1024), None) == 16384
    assert source_limit(config, SimpleNamespace(model_max_length=1024), 4096) == 4096


# the fixture checkpoint whose tokenizer a family borrows (else the llama fixture's)
TOKENIZER_OF = {
    "bart": ("m2m_100", "led", "pegasus_x"),
    "t5": ("mt5", "longt5", "umt5", "t5gemma", "t5gemma2"),
}


@pytest.mark.parametrize("name", NAMES)
def test_an_inputs_logits_do_not_depend_on_its_neighbours(name: str, tiny_models, tmp_path) -> None:
    """Batch independence on the CPU in float32, as tests/models/test_determinism.py holds it for the first families: an
    input's logits, alone or among neighbours of its own and other widths that stay or leave, are the same bits.
    The family's checkpoint is saved with a fixture tokenizer whose special ids it shares (vocabulary 601). (With
    an MLP 48 wide this fails for the SiLU / GELU families: see ARCHITECTURE, "Batch-independent outputs".)"""

    from seqgen_cli.generator import Generator

    fixture = next((f for f, names in TOKENIZER_OF.items() if name in names), "llama")
    config = FAMILY_CONFIGS[name]()
    encoder = getattr(config, "encoder", None)
    for part in (config, encoder, getattr(encoder, "text_config", None), getattr(config, "decoder", None)):
        if part is not None:  # T5Gemma: its stacks' configs too
            part.vocab_size = 601
    auto = tf.AutoModelForSeq2SeqLM if config.is_encoder_decoder else tf.AutoModelForCausalLM
    torch.manual_seed(0)
    sharpen(auto.from_config(config), seed=1).save_pretrained(tmp_path)
    with_fixture_tokenizer(tmp_path, tiny_models(fixture))
    check_neighbours(Generator(str(tmp_path), max_new_tokens=8))


def test_only_the_family_files_name_a_familys_model_type() -> None:
    """A family is a file under ``models/families/``: no other module of the package names one of its
    ``model_type``s (a string constant equal to one), so adding a family touches that folder only. Each family
    file names its own rows and no other file's."""
    import ast
    from pathlib import Path

    from seqgen_cli.models import families

    package = Path(families.__file__).resolve().parents[3]  # the folder holding seqgen_cli/
    named: dict[str, set[str]] = {}
    for path in (package / "seqgen_cli").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in FAMILIES}
        if found:
            named[path.relative_to(package).as_posix()] = found
    outside = {p: sorted(names) for p, names in named.items() if not p.startswith("seqgen_cli/models/families/")}
    assert outside == {}
    for file in families.FILES:
        own = set(file.FAMILIES)
        name = Path(file.__file__).relative_to(package).as_posix()
        assert named[name] == own, name  # its own rows, written there (so the check above can see them), no other
        doc = file.__doc__ or ""
        assert all(re.search(rf"\b{t}\b", doc) for t in own), name  # its docstring says how each differs
