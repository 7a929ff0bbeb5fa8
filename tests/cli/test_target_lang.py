"""Translation into a chosen language: ``--target-lang CODE`` resolves the code through the tokenizer's language
codes (mBART-50 ``de_DE``, M2M-100 ``de``/``__de__``, NLLB ``deu_Latn``) into ``forced_bos_token_id``;
``forced_bos_token_id``/``forced_eos_token_id`` are settings like any other (flags, presets, one rule each), and
the fast engine forces them as ``generate()`` does."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import Generator
from seqgen_cli.languages import language_codes, resolve_target_lang
from seqgen_cli.models import EncoderDecoderBackend, get_backend
from tests.equivalence import check_equivalence
from tests.helpers import one_line_error, seqgen, write_lines
from tests.tiny_models import MBART50, builtin_corpus, load, sample_texts, text_batch

TEXTS = [
    "The committee approved the new plan in Berlin.",
    "a short input",
    "Prices rose by 4.5% in the first quarter.",
]


@pytest.fixture
def mbart50(real_tokenizer_models) -> Path:
    """The tiny mBART-50-shaped checkpoint (``tests/tiny_models.py: build_mbart50``); skips without ../shared."""
    return real_tokenizer_models(MBART50)


def _run(model: Path, tmp_path: Path, *args: str, name: str = "out.txt"):
    src = write_lines(tmp_path / "in.txt", TEXTS)
    out = tmp_path / name
    res = seqgen("generate", "-m", str(model), str(src), "-o", str(out), "-q", "--max-new-tokens", "8", *args)
    return res, out


# -- mBART-50 -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=12), dict(num_beams=4, max_new_tokens=12)])
def test_mbart50_target_lang_forces_its_code_exactly_as_generate(mbart50: Path, kwargs: dict) -> None:
    gen = Generator(str(mbart50), device="cpu", target_lang="de_DE", **kwargs)
    de = gen.tokenizer.lang_code_to_id["de_DE"]
    assert type(gen.tokenizer).__name__ == "MBart50Tokenizer"
    assert gen.model.generation_config.forced_bos_token_id is None  # the checkpoint leaves the language open
    assert gen.config.forced_bos_token_id == de and gen.backend == "fast"
    assert isinstance(gen.model_backend(), EncoderDecoderBackend)  # the fast backend, not the generic one
    batch = [e.ids for e in gen.encode(TEXTS)]
    assert all(ids[0] == gen.tokenizer.lang_code_to_id["en_XX"] for ids in batch)  # source: [en_XX] X </s>
    fast = gen.generate_ids(batch)
    assert all(seq[0] == de for outputs in fast for seq in outputs)
    hf = Generator(str(mbart50), device="cpu", backend="hf", target_lang="de_DE", **kwargs).generate_ids(
        batch
    )
    assert fast == hf
    # and on many inputs, through the equivalence harness (EOS-tuned model): generate(forced_bos_token_id=de)
    loaded = load(mbart50)
    result = check_equivalence(
        loaded.model, get_backend, text_batch(loaded, 16), dict(forced_bos_token_id=de, **kwargs)
    )
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    if kwargs.get("num_beams", 1) == 1:
        assert result.identical == result.total


def test_mbart50_target_lang_on_the_command_line(mbart50: Path, tmp_path: Path) -> None:
    res, out = _run(mbart50, tmp_path, "--target-lang", "de_DE")
    assert res.exit_code == 0, res.stderr
    tok_de = Generator(str(mbart50), device="cpu").tokenizer.lang_code_to_id["de_DE"]
    same, by_id = _run(mbart50, tmp_path, "--forced-bos-token-id", str(tok_de), name="by-id.txt")
    assert same.exit_code == 0, same.stderr
    assert out.read_text(encoding="utf-8") == by_id.read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8").count("\n") == len(TEXTS)
    ro, ro_out = _run(mbart50, tmp_path, "--target-lang", "ro-RO", "--num-beams", "2", name="ro.txt")
    hf, hf_out = _run(
        mbart50, tmp_path, "--target-lang", "ro_RO", "--num-beams", "2", "--backend", "hf", name="hf.txt"
    )
    assert ro.exit_code == 0 and hf.exit_code == 0, ro.stderr + hf.stderr
    assert ro_out.read_bytes() == hf_out.read_bytes()


def test_mbart50_unknown_code_lists_close_codes(mbart50: Path, tmp_path: Path) -> None:
    res, out = _run(mbart50, tmp_path, "--target-lang", "de_Latx")
    line = one_line_error(
        res, "--target-lang de_Latx: not a language code of the model's tokenizer", "close: de_DE"
    )
    assert "52 codes in all" in line and res.exit_code == 2
    assert not out.exists()


def test_mbart50_preset_with_forced_ids_is_accepted(mbart50: Path, tmp_path: Path) -> None:
    de = Generator(str(mbart50), device="cpu").tokenizer.lang_code_to_id["de_DE"]
    preset = tmp_path / "translate.toml"
    preset.write_text(
        f'description = "into German"\n[generation]\nforced_bos_token_id = {de}\nforced_eos_token_id = 2\n',
        encoding="utf-8",
    )
    gen = Generator(str(mbart50), device="cpu", preset=str(preset), max_new_tokens=6)
    assert (
        gen.config.forced_bos_token_id == de and gen.config.forced_eos_token_id == 2 and gen.backend == "fast"
    )
    assert all(outputs[0][0] == de for outputs in gen.generate_ids([e.ids for e in gen.encode(TEXTS)]))
    res, out = _run(mbart50, tmp_path, "--preset", str(preset))
    flag, flag_out = _run(mbart50, tmp_path, "--target-lang", "de_DE", name="flag.txt")
    assert res.exit_code == 0 and flag.exit_code == 0, res.stderr + flag.stderr
    assert out.read_bytes() == flag_out.read_bytes()
    # a flag wins over the preset, as every flag does
    assert (
        Generator(
            str(mbart50), device="cpu", preset=str(preset), target_lang="fr_XX"
        ).config.forced_bos_token_id
        != de
    )


# -- the tiny mBART (no ../shared needed): language codes as plain extra special tokens ------------------------


def test_tiny_mbart_target_lang_replaces_the_checkpoint_forced_bos(tiny_models) -> None:
    model = str(tiny_models("mbart"))
    base = Generator(model, device="cpu", max_new_tokens=6)
    fr = base.tokenizer.convert_tokens_to_ids("fr_XX")
    assert base.config.forced_bos_token_id != fr  # the checkpoint forces de_DE
    assert {"en_XX", "de_DE", "fr_XX", "ro_RO", "pt_XX"} <= set(language_codes(base.tokenizer))
    for kwargs in (dict(), dict(num_beams=3, num_return_sequences=2)):
        fast = Generator(model, device="cpu", target_lang="fr_XX", max_new_tokens=6, **kwargs)
        hf = Generator(model, device="cpu", target_lang="fr_XX", max_new_tokens=6, backend="hf", **kwargs)
        assert fast.backend == "fast" and fast.config.forced_bos_token_id == fr
        batch = [e.ids for e in fast.encode(sample_texts(6, seed=3))]
        ours = fast.generate_ids(batch)
        assert all(seq[0] == fr for outputs in ours for seq in outputs)
        assert ours == hf.generate_ids(batch)


@pytest.mark.parametrize("code", ["fr_XX", "fr-XX", "FR_xx", " fr_XX"])
def test_spellings_of_an_mbart_code(tiny_models, code: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_models("mbart"))
    assert resolve_target_lang(tok, code) == tok.convert_tokens_to_ids("fr_XX")


def test_unknown_code_and_tokenizer_without_codes_are_one_line_errors(tiny_models, tmp_path: Path) -> None:
    res, out = _run(tiny_models("mbart"), tmp_path, "--target-lang", "fr_Latx")
    one_line_error(res, "--target-lang fr_Latx: not a language code", "close: fr_XX", "5 codes in all")
    assert not out.exists()
    res, _ = _run(tiny_models("mbart"), tmp_path, "--target-lang", "German")
    one_line_error(res, "--target-lang German: not a language code", "e.g. de_DE, en_XX")
    res, _ = _run(tiny_models("bart"), tmp_path, "--target-lang", "de_DE")
    one_line_error(
        res, "--target-lang de_DE: the model's tokenizer has no language codes", "mBART-50, M2M-100"
    )
    assert res.exit_code == 2 and not out.exists()


def test_target_lang_and_forced_bos_contradict(tiny_models, tmp_path: Path) -> None:
    res, out = _run(tiny_models("mbart"), tmp_path, "--target-lang", "fr_XX", "--forced-bos-token-id", "5")
    one_line_error(res, "--target-lang and --forced-bos-token-id contradict; give one")
    assert not out.exists()


# -- forced_bos_token_id / forced_eos_token_id as settings ------------------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--forced-bos-token-id", "-1"], "--forced-bos-token-id -1: must be a whole number >= 0"),
        (["--forced-eos-token-id", "-3"], "--forced-eos-token-id -3: must be a whole number >= 0"),
        (["--forced-bos-token-id", "100000"], "--forced-bos-token-id 100000: not a token of the model"),
    ],
)
def test_forced_id_flags_are_checked(tiny_models, tmp_path: Path, args: list[str], needle: str) -> None:
    res, out = _run(tiny_models("bart"), tmp_path, *args)
    one_line_error(res, needle)
    assert res.exit_code == 2 and not out.exists()


@pytest.mark.parametrize(
    "body,needle",
    [
        ("forced_bos_token_id = -1", "forced_bos_token_id = -1: must be a whole number >= 0"),
        ("forced_bos_token_id = 1.5", "forced_bos_token_id = 1.5: must be a whole number"),
        ('forced_bos_token_id = "de_DE"', "forced_bos_token_id = 'de_DE': must be a whole number"),
        (
            "forced_eos_token_id = []",
            "forced_eos_token_id = []: must be a whole number >= 0 and <= 2147483647, or a list of them",
        ),
        ("forced_eos_token_id = [2, -1]", "must be a whole number >= 0 and <= 2147483647, or a list of them"),
        ("forced_eos_token_id = 99999", "forced_eos_token_id = 99999: not a token of the model"),
    ],
)
def test_forced_ids_in_a_preset_are_checked(tiny_models, tmp_path: Path, body: str, needle: str) -> None:
    preset = tmp_path / "task.toml"
    preset.write_text(f"[generation]\n{body}\n", encoding="utf-8")
    res, out = _run(tiny_models("bart"), tmp_path, "--preset", str(preset))
    one_line_error(res, f"preset {preset}: ", needle)
    assert not out.exists()


def test_forced_eos_flag_and_preset_list_run_as_generate(tiny_models, tmp_path: Path) -> None:
    """A forced EOS id other than EOS: the last token at the length limit, on the fast engine as in generate()."""
    model = str(tiny_models("bart"))
    preset = tmp_path / "task.toml"
    preset.write_text("[generation]\nforced_eos_token_id = [7, 9]\n", encoding="utf-8")
    for extra in (dict(forced_eos_token_id=7), dict(preset=str(preset))):
        fast = Generator(model, device="cpu", max_new_tokens=5, num_beams=2, **extra)
        hf = Generator(model, device="cpu", max_new_tokens=5, num_beams=2, backend="hf", **extra)
        assert fast.backend == "fast"
        batch = [e.ids for e in fast.encode(sample_texts(5, seed=7))]
        ours = fast.generate_ids(batch)
        assert ours == hf.generate_ids(batch)
        assert any(seq[-1] in (7, 9) for outputs in ours for seq in outputs)
    res, _ = _run(tiny_models("bart"), tmp_path, "--forced-eos-token-id", "7", "--forced-bos-token-id", "5")
    assert res.exit_code == 0, res.stderr


# -- M2M-100 and NLLB tokenizers (transformers' own classes over tiny vocabularies) -----------------------------


def _m2m100_tokenizer(tmp_path: Path):
    spm = pytest.importorskip("sentencepiece")
    from transformers import M2M100Tokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(builtin_corpus(300)), model_writer=model, vocab_size=150, minloglevel=2
    )
    (tmp_path / "spm.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    return M2M100Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "spm.model"))


def test_m2m100_codes(tmp_path: Path) -> None:
    tok = _m2m100_tokenizer(tmp_path)
    de = tok.get_lang_id("de")
    for code in ("de", "__de__", "DE", "__DE__"):
        assert resolve_target_lang(tok, code) == de, code
    with pytest.raises(SeqgenError) as err:
        resolve_target_lang(tok, "dx")
    assert "\n" not in str(err.value) and "--target-lang dx: not a language code" in str(err.value)
    assert "100 codes in all" in str(err.value)  # one name per language: "de", not also "__de__"


@pytest.mark.parametrize(
    ("typed", "code"),
    [("de", "deu_Latn"), ("deu", "deu_Latn"), ("de_DE", "deu_Latn"), ("de-AT", "deu_Latn"), ("ar", "arb_Arab"),
     ("zh", "zho_Hans"), ("zh-TW", "zho_Hant"), ("no", "nob_Latn"), ("pt_BR", "por_Latn"), ("en_GB", "eng_Latn")],
)  # fmt: skip
def test_nllb_takes_a_language_as_users_type_it(typed: str, code: str) -> None:
    """ISO 639-1 and 639-3 codes and locales resolve to NLLB's code of that language (CLDR's matching, regions
    aside), as mBART-50's ``fr_FR`` to ``fr_XX``."""
    from transformers import NllbTokenizer

    tok = NllbTokenizer()
    assert resolve_target_lang(tok, typed) == tok.convert_tokens_to_ids(code)


def test_a_language_the_model_has_twice_or_in_another_script_is_an_error(tiny_models) -> None:
    from transformers import NllbTokenizer

    tok = NllbTokenizer()
    with pytest.raises(SeqgenError, match=r"--target-lang fa: more than one .*: pes_Arab, prs_Arab$"):
        resolve_target_lang(tok, "fa")  # Iranian Persian and Dari
    with pytest.raises(SeqgenError, match=r"--target-lang sr-Latn: not a language code"):
        resolve_target_lang(tok, "sr-Latn")  # NLLB's Serbian is Cyrillic
    mbart = AutoTokenizer.from_pretrained(tiny_models("mbart"))
    assert resolve_target_lang(mbart, "fr_FR") == resolve_target_lang(mbart, "fr") == mbart.convert_tokens_to_ids("fr_XX")


def test_nllb_codes() -> None:
    from transformers import NllbTokenizer

    tok = NllbTokenizer()
    deu = tok.convert_tokens_to_ids("deu_Latn")
    for code in ("deu_Latn", "deu-Latn", "DEU_latn"):
        assert resolve_target_lang(tok, code) == deu, code
    with pytest.raises(SeqgenError, match=r"--target-lang deu_Latx: .*close: deu_Latn"):
        resolve_target_lang(tok, "deu_Latx")


@pytest.mark.parametrize(
    "kwargs", [dict(max_new_tokens=10), dict(num_beams=4, max_new_tokens=10, forced_eos_token_id=2)]
)
def test_m2m100_architecture_forces_the_language_on_the_fast_decoder(kwargs: dict) -> None:
    """M2M-100 and NLLB (``model_type`` m2m_100) run the fast encoder-decoder decoder: same tokens."""
    import torch
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration

    from seqgen_cli.search import Batch

    torch.manual_seed(0)
    ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    config = M2M100Config(
        vocab_size=300, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        init_std=1.0, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **ids,
    )  # fmt: skip
    model = M2M100ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(**ids)
    assert isinstance(get_backend(model), EncoderDecoderBackend)
    source = torch.randint(4, 280, (6, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(source)
    source[:, -1] = 2
    source[3:, 7], source[3:, 8:], mask[3:, 8:] = 2, 1, 0  # shorter inputs, right-padded
    result = check_equivalence(
        model, get_backend, Batch(source, mask), dict(forced_bos_token_id=290, **kwargs)
    )
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    assert result.identical == result.total


def test_a_tokenizer_with_ordinary_special_tokens_only_has_no_codes(tiny_models) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_models("t5"))
    assert language_codes(tok) == {}
    with pytest.raises(SeqgenError, match="has no language codes"):
        resolve_target_lang(tok, "de")


def test_spec_carries_target_lang_to_workers() -> None:
    """``--workers`` ships the GeneratorSpec: the target language travels with it, as a flag of its own."""
    import pickle

    from seqgen_cli.generator import GeneratorSpec

    spec = pickle.loads(pickle.dumps(GeneratorSpec(model="m", target_lang="de_DE")))
    assert spec.target_lang == "de_DE" and "target_lang" not in spec.generation


# -- OPUS-MT multi-target models: the language as a >>code<< token before the source ---------------------------


def test_opus_mt_target_lang_goes_before_the_source_as_its_token(real_tokenizer_models, tmp_path: Path) -> None:
    """The real opus-mt-tc-big-en-pt tokenizer has ``>>por<<`` and ``>>pob<<``: ``--target-lang por`` (or ``pt``,
    or ``>>por<<``) puts ``>>por<< `` before every input, as ``--prefix '>>por<< '`` does, and forces no BOS; a
    language it lacks is one line naming the ones it has."""
    model = real_tokenizer_models("marian")
    gen = Generator(str(model), device="cpu", target_lang="por", max_new_tokens=6)
    por = gen.tokenizer.convert_tokens_to_ids(">>por<<")
    assert gen.prefix == ">>por<< " and gen.config.forced_bos_token_id is None
    ids = [e.ids for e in gen.encode(TEXTS)]
    assert all(row[0] == por for row in ids)
    by_prefix = Generator(str(model), device="cpu", prefix=">>por<< ", max_new_tokens=6)
    assert ids == [e.ids for e in by_prefix.encode(TEXTS)]
    assert gen.generate_ids(ids) == by_prefix.generate_ids(ids)
    for typed in ("pt", ">>por<<", "pt-PT"):
        assert Generator(str(model), device="cpu", target_lang=typed).prefix == ">>por<< ", typed
    res, out = _run(model, tmp_path, "--target-lang", "de")
    one_line_error(res, "--target-lang de: not a target language of the model (pob, por: its >>code<< tokens)")
    assert not out.exists()
