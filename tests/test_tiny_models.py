"""Sanity checks for the tiny fixture registry: loading, tokenizers, generation, variety; a fixture for every model
type ``seqgen models`` lists as fast."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from tests.helpers import seqgen
from tests.tiny_models import (
    CAUSAL_FAMILIES,
    CHECKPOINT_MODEL_TYPES,
    FAMILIES,
    REAL_TOKENIZER_DIRS,
    SEQ2SEQ_FAMILIES,
    fixture_model_types,
    load_tiny,
    sample_texts,
    shared_dir,
)

TEXTS = sample_texts(3, seed=1)


def _generate(
    model: torch.nn.Module, tok: object, family: str, texts: list[str], **kw: object
) -> list[list[int]]:
    enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=256)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, **kw)
    if family in CAUSAL_FAMILIES:
        out = out[:, enc["input_ids"].shape[1] :]
    return out.tolist()


def _content_len(row: list[int], tok: object, gen: GenerationConfig) -> int:
    """Number of generated tokens before EOS, ignoring decoder-start / forced-BOS / pad tokens."""
    skip = {gen.decoder_start_token_id, gen.forced_bos_token_id, tok.pad_token_id}
    n = 0
    for t in row:
        if t == tok.eos_token_id and n > 0:
            break
        if t not in skip and t != tok.eos_token_id:
            n += 1
    return n


def _check_generation(model: torch.nn.Module, tok: object, family: str) -> None:
    gen = model.generation_config
    greedy = _generate(model, tok, family, TEXTS, num_beams=1)
    beam = _generate(model, tok, family, TEXTS, num_beams=2)
    assert len({tuple(r) for r in greedy}) > 1, f"{family}: identical greedy outputs for different inputs"
    assert len({tuple(r) for r in beam}) > 1, f"{family}: identical beam outputs for different inputs"
    long_enough = sum(_content_len(r, tok, gen) > 3 for r in greedy)
    assert long_enough >= 2, f"{family}: greedy outputs end too early: {greedy}"
    if family in SEQ2SEQ_FAMILIES:
        assert all(r[0] == gen.decoder_start_token_id for r in greedy)
        if gen.forced_bos_token_id is not None:
            assert all(r[1] == gen.forced_bos_token_id for r in greedy)
    for text in tok.batch_decode(greedy, skip_special_tokens=True):
        assert isinstance(text, str)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model(family: str, tiny_models: Callable[[str], Path]) -> None:
    path = tiny_models(family)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file(), name
    model, tok = load_tiny(path)
    cfg, gen = model.config, model.generation_config

    # special tokens agree between tokenizer, config and generation config
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert gen.eos_token_id == cfg.eos_token_id == tok.eos_token_id
    assert gen.pad_token_id == cfg.pad_token_id == tok.pad_token_id
    assert cfg.vocab_size == len(tok)
    assert 300 <= len(tok) <= 1000
    if family in CAUSAL_FAMILIES:
        assert tok.padding_side == "left"
        assert getattr(cfg, "max_position_embeddings", getattr(cfg, "n_positions", 0)) >= 512
    elif family not in ("t5", "flan-t5"):
        assert cfg.max_position_embeddings >= 512
    if family in ("t5", "flan-t5", "pegasus"):
        assert (tok.pad_token_id, tok.eos_token_id, gen.decoder_start_token_id) == (0, 1, 0)
    if family in ("bart", "mbart"):
        assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id) == (0, 1, 2)
        assert gen.decoder_start_token_id == tok.eos_token_id
    if family == "mbart":
        assert tok.convert_ids_to_tokens(gen.forced_bos_token_id) == "de_DE"
    if family == "marian":
        assert gen.decoder_start_token_id == tok.pad_token_id
        assert gen.bad_words_ids == [[tok.pad_token_id]]
    if family == "gpt2":
        assert tok.pad_token_id == tok.eos_token_id
    if family == "llama":
        assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.model_type == CHECKPOINT_MODEL_TYPES[family]

    # tokenizer round-trip (special tokens stripped)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True).split() == text.split()

    _check_generation(model, tok, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_real_tokenizer_model(family: str, real_tokenizer_models: Callable[[str], Path]) -> None:
    if family not in REAL_TOKENIZER_DIRS:
        pytest.skip(f"no real tokenizer for {family}")
    if shared_dir() is None:
        pytest.skip("shared/ absent")
    path = real_tokenizer_models(family)
    model, tok = load_tiny(path)
    src = shared_dir() / "tokenizers" / REAL_TOKENIZER_DIRS[family]
    real_cfg = GenerationConfig.from_pretrained(src)
    assert model.generation_config.eos_token_id == real_cfg.eos_token_id == tok.eos_token_id
    # real quirks kept: bart-large-cnn's config has 50264 rows but its tokenizer 50265 ids (<mask> = 50264);
    # t5 has 32128 rows for 32100 tokenizer ids
    assert len(tok) - model.config.vocab_size <= 1
    if family == "gpt2":
        assert tok.pad_token_id == tok.eos_token_id and tok.padding_side == "left"
    # only token ids from the real generation config; tests choose search settings explicitly
    _check_generation(model, tok, family)


def test_every_fast_model_type_has_a_fixture() -> None:
    """A model type ``seqgen models`` lists on a fast decoder has a tiny fixture in the registry (a checkpoint, a
    family config or a decoder-only variant), so a family added to ``models/families/`` without one fails here;
    and every fixture's model type is one seqgen knows."""
    res = seqgen("models")
    assert res.exit_code == 0, res.stderr
    rows = [line.split(None, 1) for line in res.stdout.splitlines() if not line.startswith("(other)")]
    fast = {name for name, what in rows if what.startswith("fast ")}
    assert len(fast) >= 20, rows  # the listing's shape still reads as this test reads it
    fixtures = fixture_model_types()
    assert sorted(fast - set(fixtures)) == [], "fast model types without a fixture in tests/tiny_models.py"
    assert sorted(set(fixtures) - fast) == [], "fixtures of model types seqgen runs on no fast decoder"


def test_sample_texts_deterministic_and_varied() -> None:
    a, b = sample_texts(40, seed=3), sample_texts(40, seed=3)
    assert a == b
    lengths = [len(t.split()) for t in a]
    assert min(lengths) >= 3 and max(lengths) <= 130
    assert max(lengths) > 40 and min(lengths) < 10


@pytest.mark.parametrize("family", ["marian", "pegasus"])
def test_load_builds_the_same_sinusoid_tables(family: str, tiny_models: Callable[[str], Path]) -> None:
    """seqgen's vectorised sinusoid tables (loading.fast_sinusoids) are transformers' own, bit for bit, and
    transformers' class is left as it was."""
    from seqgen_cli import loading
    from seqgen_cli.models.families import bart as own_bart

    ours = loading.load(str(tiny_models(family)), "cpu").model
    theirs, _ = load_tiny(tiny_models(family))
    cls = type(theirs.model.encoder.embed_positions)
    assert cls.create_weight is not own_bart.sinusoid_table
    for part in ("encoder", "decoder"):
        mine = getattr(ours.model, part).embed_positions.weight
        assert torch.equal(mine, getattr(theirs.model, part).embed_positions.weight)
    for n_pos, dim in [(512, 512), (1024, 1024), (37, 15), (9, 1)]:
        emb = cls(n_pos, dim)
        assert torch.equal(own_bart.sinusoid_table(emb), emb.create_weight()), (n_pos, dim)


def test_fast_sinusoids_keeps_a_different_formula() -> None:
    """A transformers whose table differs from seqgen's keeps its own create_weight during the load."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding as cls

    from seqgen_cli import loading
    from seqgen_cli.models.families import bart as own_bart

    original = cls.create_weight

    def other(self: torch.nn.Embedding) -> torch.Tensor:
        return original(self) * 2

    cls.create_weight = other
    try:
        with loading.fast_sinusoids("marian"):
            assert cls.create_weight is other
    finally:
        cls.create_weight = original
    with loading.fast_sinusoids("marian"):
        assert cls.create_weight is own_bart.sinusoid_table
    assert cls.create_weight is original
