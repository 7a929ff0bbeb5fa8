"""seqgen's own module trees (``models/own_model.py``, each family file's ``Tree``: the BART family, T5 / mT5 / UMT5, T5Gemma): the checkpoint's weights exactly where
transformers puts them (ties too), an encoder bit-identical to transformers', the same generation settings, outputs
identical to the fast path over transformers' model in float32 and int8, and a fallback to transformers for a
checkpoint it does not read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from seqgen_cli.generator import Generator
from seqgen_cli.models import backend_name, own_model
from seqgen_cli.models.tree import OwnSeq2Seq
from tests.tiny_models import BART_SHAPE, FAMILY_CONFIGS, SEQ2SEQ_IDS, T5_SHAPE, V, sharpen, t5_vocabulary

SHAPE = {**BART_SHAPE, "max_position_embeddings": 64}


def untied(config: tf.PretrainedConfig) -> tf.PretrainedConfig:
    config.tie_word_embeddings = False
    return config


CASES: dict[str, Callable[[], tf.PretrainedConfig]] = {
    "bart": lambda: tf.BartConfig(**SHAPE),
    "bart untied": lambda: tf.BartConfig(tie_word_embeddings=False, **SHAPE),
    "mbart": lambda: tf.MBartConfig(scale_embedding=True, **SHAPE),
    "marian": lambda: tf.MarianConfig(**SHAPE),
    "marian own decoder vocabulary": lambda: tf.MarianConfig(
        share_encoder_decoder_embeddings=False, decoder_vocab_size=V + 6, **SHAPE
    ),
    "pegasus": lambda: tf.PegasusConfig(scale_embedding=True, **SHAPE),
    "m2m_100": lambda: tf.M2M100Config(scale_embedding=True, **SHAPE),
    "t5": lambda: tf.T5Config(**T5_SHAPE),  # v1.0: ReLU, tied head (its input rescaled)
    "t5 v1.1": lambda: tf.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **T5_SHAPE),
    "mt5": FAMILY_CONFIGS["mt5"],
    "umt5": lambda: tf.UMT5Config(feed_forward_proj="gated-gelu", **T5_SHAPE),  # a relative bias in every block
    # grouped-query heads, soft-capping, a window of 4 the sources pass (sliding layers' masks), a tied head
    "t5gemma": FAMILY_CONFIGS["t5gemma"],
    "t5gemma untied": lambda: untied(FAMILY_CONFIGS["t5gemma"]()),
}
# Cases saved with a head of their own beside a config that ties it (transformers keeps the checkpoint's head):
# T5 v1.1 / mT5 / UMT5 as flan-t5-base, mt5 and umt5 checkpoints are (``tie_word_embeddings: false`` in
# config.json, which transformers 5 reads as tied), and a BART saved so: case -> (its config, the tied source).
OWN_HEAD = {
    "t5 v1.1 own head": ("t5 v1.1", "shared.weight"),
    "mt5 own head": ("mt5", "shared.weight"),
    "umt5 own head": ("umt5", "shared.weight"),
    "bart own head": ("bart", "model.shared.weight"),
}
CASES.update({case: CASES[base] for case, (base, _) in OWN_HEAD.items()})


def own_head(folder: Path, source: str, seed: int) -> None:
    """Give the saved checkpoint in ``folder`` an ``lm_head.weight`` of its own (``source``'s rows permuted) and,
    for T5's kinds, ``tie_word_embeddings: false`` in config.json, as their real checkpoints have."""
    tensors = load_file(str(folder / "model.safetensors"))
    rows = torch.randperm(tensors[source].shape[0], generator=torch.Generator().manual_seed(seed))
    tensors["lm_head.weight"] = tensors[source][rows].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if "t5" in config["model_type"]:
        config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``checkpoint(case) -> folder``: a random checkpoint saved by transformers (safetensors)."""
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            torch.manual_seed(0)
            model = sharpen(tf.AutoModelForSeq2SeqLM.from_config(CASES[case]()), seed=1)
            folder = tmp_path_factory.mktemp(case.replace(" ", "-"))
            model.save_pretrained(folder)
            if case in OWN_HEAD:
                own_head(folder, OWN_HEAD[case][1], seed=5)
            made[case] = folder
        return made[case]

    return get


def both(folder: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(seqgen's own tree, transformers' model) of ``folder``, in ``dtype``."""
    config = tf.AutoConfig.from_pretrained(folder)
    own, why = own_model.load(str(folder), config, dtype)
    assert own is not None, why
    return own, tf.AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=dtype).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_own_tree_holds_transformers_weights_and_settings(case: str, checkpoint: Callable[[str], Path]) -> None:
    own, ref = both(checkpoint(case))
    mine, theirs = own.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert torch.equal(mine[key], tensor), key
    ptr = {name: p.data_ptr() for name, p in ref.named_parameters(remove_duplicate=False)}
    own_ptr = {name: p.data_ptr() for name, p in own.named_parameters(remove_duplicate=False)}
    shares = {(a, b) for a in ptr for b in ptr if a < b and ptr[a] == ptr[b]}
    assert shares == {(a, b) for a in own_ptr for b in own_ptr if a < b and own_ptr[a] == own_ptr[b]}  # the ties
    for side in ("encoder", "decoder") if case == "m2m_100" else ():  # sinusoids, no weights: made by each
        assert torch.equal(getattr(own.model, side).embed_positions.weights, getattr(ref.model, side).embed_positions.weights)
    assert own.generation_config.to_dict() == ref.generation_config.to_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_own_encoder_is_bit_identical_to_transformers(
    case: str, dtype: torch.dtype, checkpoint: Callable[[str], Path]
) -> None:
    own, ref = both(checkpoint(case), dtype)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, V, (3, 9), generator=g)
    lengths = torch.tensor([9, 6, 2])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).long()  # [3, 9]
    ids = ids.masked_fill(mask == 0, SEQ2SEQ_IDS["pad_token_id"])
    with torch.inference_mode():
        for i, m in ((ids, mask), (ids[:1], mask[:1])):  # padded, and a batch without padding (no mask)
            mine = own.get_encoder()(i, m).last_hidden_state
            theirs = ref.get_encoder()(input_ids=i, attention_mask=m).last_hidden_state
            assert torch.equal(mine, theirs)
        if case == "m2m_100":  # past its table (64 + 2 rows): the sinusoids grow, as transformers' do
            long = torch.randint(3, V, (2, 80), generator=g)
            mine = own.get_encoder()(long, torch.ones_like(long)).last_hidden_state
            assert torch.equal(mine, ref.get_encoder()(input_ids=long).last_hidden_state)


TEXTS = ["the committee approved the plan", "a dog ran", "researchers found a new way to read old letters"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("family", ["bart", "marian", "mbart", "pegasus", "t5", "flan-t5"])
def test_generator_runs_own_tree_with_transformers_outputs(
    family: str, dtype: str, tiny_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast engine over the own tree gives the tokens it gives over transformers' model (own tree refused)."""
    settings = dict(num_beams=4, no_repeat_ngram_size=3, max_new_tokens=12)
    gen = Generator(str(tiny_models(family)), backend="fast", dtype=dtype, **settings)
    assert gen.loaded.own and isinstance(gen.model, OwnSeq2Seq)
    assert gen.device_stats()["loader"] == "seqgen"
    assert backend_name(gen.model_backend()) == f"{gen.model.config.model_type} decoder"
    ours = gen.generate(TEXTS)
    monkeypatch.setattr(own_model, "refusal", lambda config: "refused by the test")
    theirs = Generator(str(tiny_models(family)), backend="fast", dtype=dtype, **settings)
    assert not theirs.loaded.own and theirs.device_stats()["loader"] == "transformers (refused by the test)"
    assert ours == theirs.generate(TEXTS)
    if dtype != "int8":  # and generate() itself, on transformers' model loaded on first use, in the run's dtype
        assert isinstance(gen.loaded.reference, tf.PreTrainedModel)
        assert next(gen.loaded.reference.parameters()).dtype == gen.loaded.dtype
    if dtype == "float32":
        assert ours == Generator(str(tiny_models(family)), backend="hf", **settings).generate(TEXTS)


def test_hf_backend_gets_transformers_model(tiny_models: Callable[[str], Path]) -> None:
    gen = Generator(str(tiny_models("marian")), backend="hf", max_new_tokens=4)
    assert not gen.loaded.own and isinstance(gen.model, tf.PreTrainedModel)


def test_checkpoint_it_does_not_read_goes_to_transformers(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """An unexpected weight, or no safetensors: the reason, and transformers loads the checkpoint."""
    src = checkpoint("marian")
    odd = tmp_path / "odd"
    odd.mkdir()
    for f in src.iterdir():
        (odd / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, str(odd / "model.safetensors"), {"format": "pt"})
    config = tf.AutoConfig.from_pretrained(odd)
    assert own_model.load(str(odd), config) == (None, "unexpected weights (model.extra.weight, ...)")
    (odd / "model.safetensors").unlink()
    torch.save(tensors, odd / "pytorch_model.bin")
    assert own_model.load(str(odd), config) == (None, "no safetensors in the folder")
    quick = tf.AutoConfig.from_pretrained(src, activation_function="quick_gelu")
    assert own_model.load(str(src), quick)[1] == "activation 'quick_gelu' is not written here"


@pytest.mark.parametrize("how", ["sharded", "float16"])
def test_shards_and_half_precision_files_read_as_transformers_reads_them(how: str, tmp_path: Path) -> None:
    """A checkpoint in several safetensors files (an index), or saved in float16: the same float32 weights as
    transformers loads from it."""
    torch.manual_seed(0)
    model = sharpen(tf.AutoModelForSeq2SeqLM.from_config(CASES["marian"]()), seed=3)
    if how == "float16":
        model = model.half()
    model.save_pretrained(tmp_path, max_shard_size="100KB" if how == "sharded" else "5GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == (how == "sharded")
    config = tf.AutoConfig.from_pretrained(tmp_path)
    own, why = own_model.load(str(tmp_path), config)
    assert own is not None, why
    ref = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.float32)
    theirs = ref.state_dict()
    assert own.state_dict().keys() == theirs.keys()
    assert all(t.dtype == torch.float32 and torch.equal(own.state_dict()[k], t) for k, t in theirs.items())



@pytest.mark.parametrize(("name", "dtype"), [("umt5", "float32"), ("t5gemma", "float32"), ("t5gemma", "int8")])
def test_t5_vocabulary_families_run_own_tree_with_transformers_outputs(
    name: str, dtype: str, tiny_models: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UMT5 (a relative bias in every block) and T5Gemma (its own stacks' configs, eager attention): a random
    checkpoint with the tiny T5's tokenizer, the fast engine over the own tree and over transformers' model give
    the same tokens; in float32 generate()'s too."""
    t5 = tiny_models("t5")
    torch.manual_seed(0)
    config = t5_vocabulary(name, tf.AutoConfig.from_pretrained(t5).vocab_size)
    sharpen(tf.AutoModelForSeq2SeqLM.from_config(config), seed=4).save_pretrained(tmp_path)
    tf.AutoTokenizer.from_pretrained(t5).save_pretrained(tmp_path)
    settings = dict(num_beams=4, no_repeat_ngram_size=3, max_new_tokens=12)
    gen = Generator(str(tmp_path), backend="fast", dtype=dtype, **settings)
    assert gen.loaded.loader == "seqgen" and backend_name(gen.model_backend()) == f"{name} decoder"
    ours = gen.generate(TEXTS)
    if dtype == "float32":
        assert ours == Generator(str(tmp_path), backend="hf", **settings).generate(TEXTS)
    monkeypatch.setattr(own_model, "refusal", lambda config: "refused by the test")
    assert ours == Generator(str(tmp_path), backend="fast", dtype=dtype, **settings).generate(TEXTS)


def test_a_tied_weight_converts_once_to_the_run_dtype(tiny_models: Callable[[str], Path]) -> None:
    """``own_model.in_dtype``: names that share a tensor (tied embeddings) share one converted tensor, equal to
    ``to(dtype)`` bit for bit; tensors already in the dtype stay themselves."""
    from seqgen_cli.models.own_model import in_dtype, read_safetensors

    tensors = read_safetensors(tiny_models("bart"))
    assert tensors is not None
    tensors["tied.copy"] = tensors["model.shared.weight"]  # a tie, as own_model.tie makes them
    kept = torch.zeros(3, dtype=torch.bfloat16)
    tensors["already.bf16"] = kept
    out = in_dtype(tensors, torch.bfloat16)
    assert out["tied.copy"] is out["model.shared.weight"] and out["already.bf16"] is kept
    for name, t in tensors.items():
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], t.to(torch.bfloat16)), name
