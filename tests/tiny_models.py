"""The one registry of tiny, randomly initialised family fixtures for tests, built fully offline.

* Checkpoints: ``build(family, dest)`` writes a complete checkpoint folder (config, generation config, safetensors
  weights, tokenizer) for one of :data:`FAMILIES`; ``build_real_tokenizer(family, dest)`` does the same with a real
  tokenizer + real config from ``../shared/tokenizers`` shrunk to tiny widths/depths (real vocab and special ids);
  :func:`cached_build` keeps them across sessions (the ``tiny_models`` fixture of ``tests/conftest.py``).
  :func:`load` reads one back for the engine tests (float32, EOS-tuned) and :func:`text_batch` tokenises sample
  texts for it.
* In-memory models: a tiny config of every other fast family (:data:`FAMILY_CONFIGS`, :func:`family_model`) and
  the decoder-only variants (:data:`DECODER_ONLY_CONFIGS`, :func:`decoder_only_model`), over a 97-token
  vocabulary (:data:`V`) with :func:`sources` as inputs.

Weights are random (seeded), so outputs are meaningless text, but deterministic and varied across inputs. Every
model type ``seqgen models`` lists as fast has a fixture here (:func:`fixture_model_types`,
``tests/test_tiny_models.py``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from seqgen_cli.search import Batch

FAMILIES: tuple[str, ...] = ("bart", "mbart", "marian", "pegasus", "t5", "flan-t5", "gpt2", "llama")
SEQ2SEQ_FAMILIES: frozenset[str] = frozenset({"bart", "mbart", "marian", "pegasus", "t5", "flan-t5"})
CAUSAL_FAMILIES: frozenset[str] = frozenset({"gpt2", "llama"})

#: family -> folder under ``shared/tokenizers`` used by :func:`build_real_tokenizer` (mbart/llama: none).
REAL_TOKENIZER_DIRS: dict[str, str] = {
    "bart": "bart-large-cnn",
    "marian": "opus-mt-tc-big-en-pt",
    "pegasus": "pegasus-xsum",
    "t5": "t5-small",
    "flan-t5": "flan-t5-small",
    "gpt2": "gpt2",
}

#: mBART language-code tokens present in the tiny mBART vocabulary (appended after the trained vocab).
MBART_LANG_CODES: tuple[str, ...] = ("en_XX", "de_DE", "fr_XX", "ro_RO", "pt_XX")
MBART_SRC_LANG = "en_XX"
MBART_TGT_LANG = "de_DE"

SEED = 0
VOCAB_SIZE = 600
D_MODEL = 32
FFN_DIM = 64
N_HEADS = 4
N_LAYERS = 2
# Random-init knobs, tuned so greedy outputs are long (EOS is not argmax everywhere) and differ between
# inputs. Small-std seq2seq models collapse to "argmax = current token" (tied embeddings + residual stream
# dominated by the input embedding); large sub-layer weights plus down-scaled token embeddings avoid that.
INIT_STD = 0.2  # decoder-only (gpt2/llama) initializer_range
SEQ2SEQ_INIT_STD = 1.0  # bart/mbart/marian/pegasus init_std; T5 initializer_factor
EMBED_SCALE: dict[str, float] = {"bart": 0.3, "mbart": 0.3, "marian": 0.3, "pegasus": 0.3, "t5": 0.1}
_ALPHABET = [chr(c) for c in range(33, 127)] + list("éèêàâäöüïçñßÉÜÖÄ€£°’“”–—")
SEQ2SEQ_MAX_POSITIONS = 512
CAUSAL_MAX_POSITIONS = 1024

# ----------------------------------------------------------------------------------------------------------
# Built-in English text (deterministic, generated from a small grammar)
# ----------------------------------------------------------------------------------------------------------

_SUBJECTS = [
    "the government",
    "a spokesman",
    "the committee",
    "the old man",
    "my sister",
    "the company",
    "researchers",
    "the police",
    "the mayor",
    "local residents",
    "the team",
    "a young woman",
    "the president",
    "the children",
    "the bank",
    "scientists",
    "the minister",
    "the court",
    "our neighbours",
    "the airline",
    "the new manager",
    "the students",
    "a doctor",
    "the city council",
    "the football club",
    "the museum",
    "farmers",
    "the judge",
]
_VERBS = [
    "announced",
    "rejected",
    "described",
    "approved",
    "discussed",
    "reported",
    "found",
    "built",
    "visited",
    "criticised",
    "welcomed",
    "opened",
    "sold",
    "bought",
    "studied",
    "explained",
    "changed",
    "supported",
    "planned",
    "questioned",
    "delivered",
    "painted",
    "measured",
    "celebrated",
    "repaired",
    "closed",
]
_ADJECTIVES = [
    "new",
    "old",
    "large",
    "small",
    "important",
    "difficult",
    "public",
    "quiet",
    "famous",
    "green",
    "early",
    "final",
    "recent",
    "local",
    "national",
    "strange",
    "simple",
    "expensive",
    "popular",
    "careful",
    "bright",
]
_OBJECTS = [
    "plan",
    "report",
    "bridge",
    "school",
    "project",
    "budget",
    "law",
    "station",
    "hospital",
    "garden",
    "road",
    "book",
    "film",
    "decision",
    "study",
    "market",
    "house",
    "river",
    "company",
    "museum",
    "agreement",
    "vote",
    "price",
    "storm",
    "season",
    "festival",
    "machine",
    "system",
    "proposal",
    "meeting",
]
_PLACES = [
    "in London",
    "in Berlin",
    "near the coast",
    "in the north",
    "on Monday",
    "last year",
    "on Friday evening",
    "in the capital",
    "after the election",
    "during the summer",
    "in 2014",
    "at the weekend",
    "in Paris",
    "across the country",
    "before the match",
    "in the city centre",
    "at the end of the month",
]
_CONNECTORS = ["because", "although", "while", "after", "before", "and", "but", "so", "when", "since"]
_QUOTES = [
    '"We are very happy with the result," she said.',
    '"It was not an easy decision," he told reporters.',
    "The figures were published on Tuesday.",
    "More than 300 people attended the event.",
    "Prices rose by 4.5% in the first quarter.",
    "Officials said the work would take about 18 months.",
    "Nobody was injured, according to the fire service.",
    "The talks will continue next week in Geneva.",
    "It is the first time this has happened since 1998.",
    "Critics say the cost of $2.3 million is too high.",
]


def _sentence(rng: random.Random) -> str:
    """One random English sentence from the built-in grammar."""
    if rng.random() < 0.15:
        return rng.choice(_QUOTES)
    clause = (
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} the {rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}"
    )
    if rng.random() < 0.6:
        clause += f" {rng.choice(_PLACES)}"
    if rng.random() < 0.4:
        clause += (
            f" {rng.choice(_CONNECTORS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)}"
            f" a {rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}"
        )
    clause = clause[0].upper() + clause[1:]
    return clause + rng.choice([".", ".", ".", "!", "?"])


def builtin_corpus(n: int = 600, seed: int = SEED) -> list[str]:
    """``n`` deterministic built-in English sentences (tokenizer training data and offline sample texts)."""
    rng = random.Random(seed)
    return [_sentence(rng) for _ in range(n)]


# ----------------------------------------------------------------------------------------------------------
# Shared reference folder and sample texts
# ----------------------------------------------------------------------------------------------------------


def shared_dir() -> Path | None:
    """The read-only ``shared`` folder (``$SEQGEN_SHARED`` or ``<repo>/../shared``), or None when absent."""
    repo_root = Path(__file__).resolve().parent.parent
    path = Path(os.environ.get("SEQGEN_SHARED", repo_root.parent / "shared"))
    return path if path.is_dir() else None


def _read_lines(path: Path, limit: int) -> list[str]:
    lines: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = " ".join(line.split())
            if line:
                lines.append(line)
            if len(lines) >= limit:
                break
    return lines


def sample_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic English inputs of varied length (about 3 to 120 words).

    Uses WMT14 newstest sentences and CNN/DM (SummEval) articles from ``shared/data`` when present, otherwise
    the built-in grammar. Roughly: 1/4 short fragments, 1/2 single sentences, 1/4 truncated articles.
    """
    rng = random.Random(seed)
    shared = shared_dir()
    sentences: list[str] = []
    articles: list[str] = []
    if shared is not None:
        wmt = shared / "data" / "wmt" / "en-de" / "newstest2014.en"
        cnn = shared / "data" / "cnndm" / "summeval.source"
        if wmt.is_file():
            sentences = [s for s in _read_lines(wmt, 1000) if 3 <= len(s.split()) <= 60]
        if cnn.is_file():
            articles = _read_lines(cnn, 100)
    if not sentences:
        sentences = builtin_corpus(1000, seed=1234)
    if not articles:
        pool = builtin_corpus(2000, seed=4321)
        articles = [" ".join(pool[i : i + 20]) for i in range(0, len(pool), 20)]
    out: list[str] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.25:
            words = rng.choice(sentences).split()
            out.append(" ".join(words[: rng.randint(3, 8)]))
        elif kind < 0.75:
            out.append(rng.choice(sentences))
        else:
            words = rng.choice(articles).split()
            out.append(" ".join(words[: rng.randint(40, 120)]))
    return out


# ----------------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------------


def _train_bpe_bytelevel(special: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    return tok


def _train_unigram(special: list[str], unk: str, prepend_scheme: str = "always") -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" {2,}", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    trainer = trainers.UnigramTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        unk_token=unk,
        initial_alphabet=_ALPHABET,
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    return tok


def _template(tok: Any, single: str, pair: str) -> None:
    from tokenizers import processors

    names = {t for t in (single + " " + pair).split() if not t.startswith("$")}
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tok.token_to_id(t)) for t in sorted(names)]
    )


def _make_tokenizer(family: str) -> Any:
    """A ``PreTrainedTokenizerFast`` with the family's special-token layout (see module report for ids)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kw: dict[str, Any]
    if family == "bart":
        tok = _train_bpe_bytelevel(["<s>", "<pad>", "</s>", "<unk>"])
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
        _template(tok, "<s> $A </s>", "<s> $A </s> </s> $B </s>")
        kw = dict(
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            cls_token="<s>",
            sep_token="</s>",
            mask_token="<mask>",
        )
    elif family == "gpt2":
        tok = _train_bpe_bytelevel([])
        tok.add_special_tokens(["<|endoftext|>"])  # last id, as in real GPT-2
        kw = dict(
            bos_token="<|endoftext|>",
            eos_token="<|endoftext|>",
            unk_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            padding_side="left",
        )
    elif family == "mbart":
        tok = _train_unigram(["<s>", "<pad>", "</s>", "<unk>"], unk="<unk>")
        tok.add_special_tokens(list(MBART_LANG_CODES) + ["<mask>"])
        _template(tok, f"{MBART_SRC_LANG} $A </s>", f"{MBART_SRC_LANG} $A $B </s>")
        kw = dict(
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            cls_token="<s>",
            sep_token="</s>",
            mask_token="<mask>",
            additional_special_tokens=list(MBART_LANG_CODES),
        )
    elif family == "marian":
        tok = _train_unigram(["</s>", "<unk>"], unk="<unk>")
        tok.add_special_tokens(["<pad>"])  # last id, as in real OPUS-MT
        _template(tok, "$A </s>", "$A $B </s>")
        kw = dict(eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    elif family in ("pegasus", "t5", "flan-t5"):
        tok = _train_unigram(["<pad>", "</s>", "<unk>"], unk="<unk>")
        _template(tok, "$A </s>", "$A </s> $B </s>")
        kw = dict(eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    elif family == "llama":
        tok = _train_unigram(["<unk>", "<s>", "</s>"], unk="<unk>", prepend_scheme="first")
        _template(tok, "<s> $A", "<s> $A <s> $B")
        kw = dict(
            bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>", padding_side="left"
        )
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=SEQ2SEQ_MAX_POSITIONS, **kw)
    return fast


# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------

_BART_LIKE_SIZES: dict[str, Any] = dict(
    d_model=D_MODEL,
    encoder_layers=N_LAYERS,
    decoder_layers=N_LAYERS,
    encoder_attention_heads=N_HEADS,
    decoder_attention_heads=N_HEADS,
    encoder_ffn_dim=FFN_DIM,
    decoder_ffn_dim=FFN_DIM,
    init_std=SEQ2SEQ_INIT_STD,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)
_T5_SIZES: dict[str, Any] = dict(
    d_model=D_MODEL,
    d_kv=D_MODEL // N_HEADS,
    d_ff=FFN_DIM,
    num_layers=N_LAYERS,
    num_decoder_layers=N_LAYERS,
    num_heads=N_HEADS,
    initializer_factor=SEQ2SEQ_INIT_STD,
    dropout_rate=0.0,
)
_GPT2_SIZES: dict[str, Any] = dict(
    n_embd=D_MODEL,
    n_layer=N_LAYERS,
    n_head=N_HEADS,
    initializer_range=INIT_STD,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)


# BART-like families: config class, the roles of (bos, eos, pad, decoder start, forced BOS) token ids, and
# the architecture switches (every one also forces EOS at max length).
_ROLE_NAMES = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "forced_bos_token_id",
)
_BART_LIKE: dict[str, tuple[str, tuple[str | None, ...], dict[str, Any]]] = {
    "bart": (
        "BartConfig",
        ("bos", "eos", "pad", "eos", "bos"),
        dict(scale_embedding=False, normalize_before=False, activation_function="gelu"),
    ),
    "mbart": (
        "MBartConfig",
        ("bos", "eos", "pad", "eos", "lang"),
        dict(scale_embedding=True, activation_function="relu"),
    ),
    "marian": (
        "MarianConfig",
        ("eos", "eos", "pad", "pad", None),
        dict(
            scale_embedding=True,
            static_position_embeddings=True,
            activation_function="swish",
            share_encoder_decoder_embeddings=True,
        ),
    ),  # fmt: skip
    "pegasus": (
        "PegasusConfig",
        ("pad", "eos", "pad", "pad", None),
        dict(scale_embedding=True, activation_function="relu"),
    ),
}


def _ids(tok: Any) -> dict[str, int | None]:
    return {
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
        "unk": tok.unk_token_id,
    }


def _config_and_generation(family: str, tok: Any) -> tuple[Any, dict[str, Any]]:
    """The model config and generation-config token ids (nothing but token ids) for a tiny family."""
    import transformers
    from transformers import GPT2Config, LlamaConfig, T5Config

    i = _ids(tok)
    vocab = len(tok)
    gen: dict[str, Any]
    if family in _BART_LIKE:
        cls, roles, arch = _BART_LIKE[family]
        i["lang"] = tok.convert_tokens_to_ids(MBART_TGT_LANG) if family == "mbart" else None
        ids = {name: i[role] for name, role in zip(_ROLE_NAMES, roles, strict=True) if role is not None}
        ids["forced_eos_token_id"] = i["eos"]
        extra = dict(decoder_vocab_size=vocab) if family == "marian" else {}
        cfg = getattr(transformers, cls)(
            vocab_size=vocab, max_position_embeddings=SEQ2SEQ_MAX_POSITIONS, **extra, **arch,
            **_BART_LIKE_SIZES, **ids,
        )  # fmt: skip
        gen = dict(ids, bad_words_ids=[[i["pad"]]]) if family == "marian" else ids
    elif family in ("t5", "flan-t5"):
        ids = dict(eos_token_id=i["eos"], pad_token_id=i["pad"], decoder_start_token_id=i["pad"])
        v11 = family == "flan-t5"
        cfg = T5Config(
            vocab_size=vocab,
            n_positions=SEQ2SEQ_MAX_POSITIONS,
            feed_forward_proj="gated-gelu" if v11 else "relu",
            tie_word_embeddings=not v11,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            **_T5_SIZES,
            **ids,
        )
        gen = ids
    elif family == "gpt2":
        ids = dict(bos_token_id=i["eos"], eos_token_id=i["eos"], pad_token_id=i["eos"])
        cfg = GPT2Config(vocab_size=vocab, n_positions=CAUSAL_MAX_POSITIONS, **_GPT2_SIZES, **ids)
        gen = ids
    elif family == "llama":
        ids = dict(bos_token_id=i["bos"], eos_token_id=i["eos"], pad_token_id=i["pad"])
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=D_MODEL,
            intermediate_size=FFN_DIM,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            num_key_value_heads=2,
            max_position_embeddings=CAUSAL_MAX_POSITIONS,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            initializer_range=INIT_STD,
            tie_word_embeddings=False,
            **ids,
        )
        gen = ids
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return cfg, gen


def _save_model(config: Any, gen_ids: dict[str, Any], causal: bool, dest: Path) -> None:
    """Seeded ``from_config`` + embedding rescale (see :data:`EMBED_SCALE`) + ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, GenerationConfig

    torch.manual_seed(SEED)
    auto = AutoModelForCausalLM if causal else AutoModelForSeq2SeqLM
    model = auto.from_config(config)
    scale = EMBED_SCALE.get(config.model_type)
    if scale is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(scale)  # tied heads scale along, which is harmless
    model.eval()
    model.generation_config = GenerationConfig(**gen_ids)
    model.save_pretrained(dest)
    if config.model_type == "t5" and not config.scale_decoder_outputs:
        _own_head(dest)  # v1.1: saved as flan-t5's checkpoints are


def _own_head(dest: Path) -> None:
    """Give a saved T5 v1.1 checkpoint the head flan-t5-base, mT5 and UMT5 checkpoints have: its own
    ``lm_head.weight`` (here the embedding's rows permuted, so outputs stay as varied) and ``tie_word_embeddings:
    false`` in config.json, which transformers 5 reads as tied while keeping the distinct head."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(dest / "model.safetensors"))
    shared = tensors["shared.weight"]
    rows = torch.randperm(shared.shape[0], generator=torch.Generator().manual_seed(SEED))
    tensors["lm_head.weight"] = shared[rows].contiguous()
    save_file(tensors, str(dest / "model.safetensors"), {"format": "pt"})
    config = json.loads((dest / "config.json").read_text(encoding="utf-8"))
    config["tie_word_embeddings"] = False
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def build(family: str, dest: Path) -> Path:
    """Write a tiny random checkpoint folder for ``family`` into ``dest`` (created) and return ``dest``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(family)
    cfg, gen = _config_and_generation(family, tok)
    _save_model(cfg, gen, family in CAUSAL_FAMILIES, dest)
    tok.save_pretrained(dest)
    return dest


# ----------------------------------------------------------------------------------------------------------
# Real tokenizers + real configs, shrunk
# ----------------------------------------------------------------------------------------------------------


class _SpmPiece(types.SimpleNamespace):
    piece: str
    score: float
    type: int


@contextlib.contextmanager
def _spm_without_protobuf() -> Iterator[None]:
    """Let transformers read ``.model`` sentencepiece files when ``protobuf`` is not installed.

    transformers 5 parses spm files with protobuf; this swaps in an extractor backed by the ``sentencepiece``
    library (no precompiled normaliser charsmap, so NFKC-type normalisation is skipped).
    """
    try:
        import google.protobuf  # noqa: F401

        yield
        return
    except ImportError:
        pass
    import importlib

    import sentencepiece as spm

    # not ``import transformers.convert_slow_tokenizer``: that name is shadowed by a function of the package
    cst = importlib.import_module("transformers.convert_slow_tokenizer")

    original = cst.SentencePieceExtractor

    class _Extractor(original):  # type: ignore[misc, valid-type]
        def __init__(self, model: str) -> None:
            sp = spm.SentencePieceProcessor(model_file=str(model))
            pieces = []
            for k in range(sp.get_piece_size()):
                kind = 2 if sp.is_unknown(k) else 3 if sp.is_control(k) else 5 if sp.is_unused(k) else 1
                if kind == 1 and hasattr(sp, "is_byte") and sp.is_byte(k):
                    kind = 6
                pieces.append(_SpmPiece(piece=sp.id_to_piece(k), score=sp.get_score(k), type=kind))
            self.proto = types.SimpleNamespace(
                pieces=pieces,
                trainer_spec=types.SimpleNamespace(unk_id=sp.unk_id(), model_type=1, byte_fallback=False),
                normalizer_spec=types.SimpleNamespace(precompiled_charsmap=b"", add_dummy_prefix=True),
            )

    cst.SentencePieceExtractor = _Extractor
    try:
        yield
    finally:
        cst.SentencePieceExtractor = original


_GEN_ID_KEYS = frozenset(
    {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "decoder_start_token_id",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "bad_words_ids",
    }
)


def _shrink_config(config: Any) -> Any:
    """Shrink width/depth of a real config in place, keeping vocab, special ids and architecture quirks."""
    mt = config.model_type
    if mt in ("bart", "mbart", "marian", "pegasus"):
        for k, v in _BART_LIKE_SIZES.items():
            setattr(config, k, v)
        config.num_hidden_layers = N_LAYERS
    elif mt == "t5":
        for k, v in _T5_SIZES.items():
            setattr(config, k, v)
    elif mt == "gpt2":
        for k, v in _GPT2_SIZES.items():
            setattr(config, k, v)
    else:
        raise ValueError(f"cannot shrink model_type {mt!r}")
    return config


def build_real_tokenizer(family: str, dest: Path) -> Path | None:
    """Tiny random model with a real tokenizer/config from ``shared/tokenizers``; None if not available.

    Keeps the real vocab size, special-token ids and architecture flags; widths and depths are shrunk. The
    generation config keeps only the real token-id fields (:data:`_GEN_ID_KEYS`), not search defaults such
    as bart-large-cnn's beam 4 / min 56 / no-repeat 3 (read those from ``shared/tokenizers/<name>``).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    shared = shared_dir()
    name = REAL_TOKENIZER_DIRS.get(family)
    if shared is None or name is None or not (shared / "tokenizers" / name).is_dir():
        return None
    src = shared / "tokenizers" / name
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok_kw: dict[str, Any] = {"padding_side": "left"} if family in CAUSAL_FAMILIES else {}
    with _spm_without_protobuf():
        tok = AutoTokenizer.from_pretrained(src, **tok_kw)  # padding_side set later is not saved (v5)
    config = _shrink_config(AutoConfig.from_pretrained(src))
    real_gen = GenerationConfig.from_pretrained(src).to_dict()
    gen = {k: v for k, v in real_gen.items() if k in _GEN_ID_KEYS and v is not None}
    if family == "gpt2":  # GPT-2 has no pad token: pad = eos for batching, as in the tiny gpt2
        gen["pad_token_id"] = config.pad_token_id = gen["eos_token_id"]
    _save_model(config, gen, family in CAUSAL_FAMILIES, dest)
    if family == "gpt2":
        tok.pad_token = tok.eos_token
    tok.save_pretrained(dest)
    # Only a tokenizer.json-based tokenizer should be loaded from dest (no spm/protobuf needed later).
    info = {"source": name, "vocab_size": config.vocab_size, "len_tokenizer": len(tok)}
    (dest / "TINY_REAL_TOKENIZER.json").write_text(json.dumps(info, indent=2) + "\n")
    return dest


#: the mBART-50 many-to-many config in ``shared/tokenizers`` (config and generation config; no tokenizer)
MBART50 = "mbart50"
MBART50_CONFIG_DIR = "mbart-large-50-many-to-many-mmt-config"


def build_mbart50(dest: Path) -> Path | None:
    """A tiny mBART-50-shaped checkpoint; None where ``shared/tokenizers/<MBART50_CONFIG_DIR>`` is absent.

    The real mBART-50 many-to-many config (shrunk as :func:`build_real_tokenizer` shrinks, vocabulary cut to the
    tokenizer's) and its generation config's token ids (no ``forced_bos_token_id``: the target language is
    the user's). The tokenizer is transformers' own ``MBart50Tokenizer`` over a tiny trained unigram vocab laid
    out as the real one: ``<s> <pad> </s> <unk>``, the pieces, the 52 language codes, ``<mask>``; source
    ``en_XX`` (``[en_XX] X </s>``)."""
    shared = shared_dir()
    src = None if shared is None else shared / "tokenizers" / MBART50_CONFIG_DIR
    if src is None or not (src / "config.json").is_file():
        return None
    from transformers import AutoConfig, GenerationConfig, MBart50Tokenizer
    from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    trained = _train_unigram(["<s>", "<pad>", "</s>", "<unk>"], unk="<unk>")
    pieces = json.loads(trained.to_str())["model"]["vocab"]
    vocab = [(p, s) for p, s in pieces] + [(c, 0.0) for c in FAIRSEQ_LANGUAGE_CODES] + [("<mask>", 0.0)]
    tok = MBart50Tokenizer(vocab=vocab, src_lang="en_XX", model_max_length=SEQ2SEQ_MAX_POSITIONS)
    config = _shrink_config(AutoConfig.from_pretrained(src))
    config.vocab_size = len(tok)
    config.max_position_embeddings = SEQ2SEQ_MAX_POSITIONS
    real_gen = GenerationConfig.from_pretrained(src).to_dict()
    gen = {k: v for k, v in real_gen.items() if k in _GEN_ID_KEYS and v is not None}
    _save_model(config, gen, False, dest)
    tok.save_pretrained(dest)
    return dest


def copy_checkpoint(src: Path, dest: Path) -> Path:
    """Copy a built checkpoint folder (for tests that want to modify one)."""
    shutil.copytree(src, dest, dirs_exist_ok=True)
    return dest


# ----------------------------------------------------------------------------------------------------------
# Cross-session cache
# ----------------------------------------------------------------------------------------------------------


def factory_hash() -> str:
    """Hash of this module's checkpoint builders (its source up to the loaded-fixture section: the in-memory
    fixtures below build no checkpoint) and the transformers/tokenizers versions (cache key). A new key builds
    every checkpoint again, and a tokenizer trained again is not bit-identical (the unigram trainer's scores differ
    in their last digits from run to run), so only a change to what builds a checkpoint changes it."""
    import hashlib

    import tokenizers
    import transformers

    source = Path(__file__).read_text(encoding="utf-8")
    h = hashlib.sha256(source[: source.index("\n# " + "A checkpoint loaded back")].encode())
    h.update(f"{transformers.__version__}/{tokenizers.__version__}".encode())
    return h.hexdigest()[:16]


def default_cache_root() -> Path:
    """``$SEQGEN_TEST_CACHE`` or ``~/.cache/seqgen-tests``, with :func:`factory_hash` appended."""
    root = Path(os.environ.get("SEQGEN_TEST_CACHE", Path.home() / ".cache" / "seqgen-tests"))
    return root / factory_hash()


def writable_cache_root() -> Path | None:
    """:func:`default_cache_root`, created, if this process may write there; else None."""
    root = default_cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-probe"
        probe.touch()
        probe.unlink()
    except OSError:
        return None
    return root


def checkpoint(family: str, cache_root: Path | None = None) -> Path:
    """The tiny checkpoint folder of ``family`` (one of :data:`FAMILIES`): built under ``cache_root`` once, then
    reused (:func:`cached_build`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    path = cached_build(family, cache_root=cache_root)
    assert path is not None
    return path


def cached_build(family: str, real: bool = False, cache_root: Path | None = None) -> Path | None:
    """Build (or reuse) ``<cache_root>/<family>`` (``real-<family>`` for real-tokenizer variants; ``real-mbart50``:
    :func:`build_mbart50`).

    Builds into a temporary sibling folder and renames it into place, so concurrent test sessions never see
    a half-written checkpoint. Returns None where :func:`build_real_tokenizer` does.
    """
    import tempfile

    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / (f"real-{family}" if real else family)
    if final.is_dir():
        return final
    if real and (family not in (*REAL_TOKENIZER_DIRS, MBART50) or shared_dir() is None):
        return None
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        if real:
            out = build_mbart50(tmp) if family == MBART50 else build_real_tokenizer(family, tmp)
        else:
            out = build(family, tmp)
        if out is None:
            return None
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # lost a race only if the winner's folder exists
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------------------
# A checkpoint loaded back: for the engine tests, EOS-tuned, with text batches
# ----------------------------------------------------------------------------------------------------------


def load_tiny(path: Path, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """A checkpoint's model (seq2seq or causal, as its config says; in eval mode; float32 unless ``dtype``) and
    tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype or torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class Loaded:
    model: Any  # a PreTrainedModel
    tokenizer: Any


@functools.cache
def load(path: Path) -> Loaded:
    """A fixture checkpoint in float32, its EOS bias tuned (``tests.equivalence.tune_eos``: the random fixtures
    rarely emit EOS, which would leave early stopping, finished hypotheses and inputs leaving untested); cached per
    path."""
    # (importing the harness holds torch to one intra-op thread, as the engine tests run)
    from tests.equivalence import tune_eos

    loaded = Loaded(*load_tiny(path))
    tune_eos(loaded.model, text_batch(loaded, 16, seed=99))
    return loaded


def text_batch(loaded: Loaded, n: int, seed: int = 0, max_tokens: int = 40) -> Batch:
    """``n`` sample texts of varied length, padded as generate() expects (right: enc-dec, left: decoder-only)."""
    from seqgen_cli.search import Batch

    tok = loaded.tokenizer
    tok.padding_side = "right" if loaded.model.config.is_encoder_decoder else "left"
    enc = tok(
        sample_texts(n, seed=seed), return_tensors="pt", padding=True, truncation=True, max_length=max_tokens
    )
    return Batch(enc["input_ids"], enc["attention_mask"])


# ----------------------------------------------------------------------------------------------------------
# In-memory models: every other fast family's config, tiny, and the decoder-only variants
# ----------------------------------------------------------------------------------------------------------

V = 97  # the in-memory models' vocabulary
SEQ2SEQ_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
T5_IDS = dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
CAUSAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
BART_SHAPE = dict(
    vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
    activation_dropout=0.0, **SEQ2SEQ_IDS,
)  # fmt: skip
T5_SHAPE = dict(
    vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
    **T5_IDS,
)  # fmt: skip
LLAMA_SHAPE = dict(
    vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
    num_hidden_layers=2, max_position_embeddings=64, **CAUSAL_IDS,
)  # fmt: skip
T5GEMMA_IDS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)
GEMMA_MODULE = dict(
    {k: v for k, v in LLAMA_SHAPE.items() if k not in CAUSAL_IDS}, **T5GEMMA_IDS, query_pre_attn_scalar=8,
    sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=5.0, dropout_rate=0.0,
)  # fmt: skip
GEMMA3_TEXT = dict(
    {k: v for k, v in GEMMA_MODULE.items() if "softcapping" not in k},
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
)  # fmt: skip
TINY_SIGLIP = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=16,
    patch_size=8,
)


def hf_config(cls: str, **fields: Any) -> Any:
    """``transformers.<cls>(**fields)`` (transformers imported when a fixture is built, not with this module)."""
    import transformers

    return getattr(transformers, cls)(**fields)


#: the fast families beyond the checkpoint fixtures, a tiny config each (``tests/models/test_families.py`` holds
#: each to ``generate()`` in a batch, in refill lanes, on the static step and in int8)
FAMILY_CONFIGS: dict[str, Callable[[], Any]] = {
    "m2m_100": lambda: hf_config(
        "M2M100Config", max_position_embeddings=64, scale_embedding=True, **BART_SHAPE
    ),
    "led": lambda: hf_config(
        "LEDConfig",
        max_encoder_position_embeddings=1024,
        max_decoder_position_embeddings=64,
        attention_window=8,
        **BART_SHAPE,
    ),
    "pegasus_x": lambda: hf_config(
        "PegasusXConfig",
        max_position_embeddings=64,
        num_global_tokens=4,
        block_size=8,
        stagger_local_blocks=True,
        scale_embedding=True,
        **{**BART_SHAPE, "encoder_attention_heads": 4},
    ),
    "mt5": lambda: hf_config("MT5Config", **T5_SHAPE),  # T5 v1.1's layers (gated GELU), its own head
    "longt5": lambda: hf_config(
        "LongT5Config",
        local_radius=4,
        global_block_size=4,
        encoder_attention_type="transient-global",
        feed_forward_proj="gated-gelu",
        **T5_SHAPE,
    ),
    "umt5": lambda: hf_config("UMT5Config", feed_forward_proj="gated-gelu", **T5_SHAPE),
    # a sliding window every output reaches; soft-capping low enough to bite
    "t5gemma": lambda: hf_config(
        "T5GemmaConfig",
        encoder=GEMMA_MODULE,
        decoder=GEMMA_MODULE,
        vocab_size=V,
        **T5GEMMA_IDS,
        decoder_start_token_id=2,
    ),
    # merged self+cross attention, q/k norms, RoPE per layer type, a window outputs reach; its encoder's vision tower
    # tiny; the end-of-image token inside the vocabulary (it embeds as its own vector)
    "t5gemma2": lambda: hf_config(
        "T5Gemma2Config",
        encoder=dict(
            text_config=GEMMA3_TEXT,
            vision_config=TINY_SIGLIP,
            mm_tokens_per_image=4,
            boi_token_index=V - 3,
            eoi_token_index=V - 2,
            image_token_index=V - 1,
        ),
        decoder=dict(GEMMA3_TEXT, eoi_token_index=V - 2),
        image_token_index=V - 1,
        decoder_start_token_id=2,
    ),
    "qwen3": lambda: hf_config("Qwen3Config", **LLAMA_SHAPE),
    "phi3": lambda: hf_config(
        "Phi3Config",
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        **LLAMA_SHAPE,
    ),
    # soft-capping low enough to bite on these weights; sliding windows every prompt and output reaches
    "gemma2": lambda: hf_config(
        "Gemma2Config",
        sliding_window=6,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        query_pre_attn_scalar=8,
        **LLAMA_SHAPE,
    ),
    "gemma3_text": lambda: hf_config(
        "Gemma3TextConfig",
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
        **LLAMA_SHAPE,
    ),
}


def sharpen(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights large enough that attention is far from uniform (so a wrong cache, position, norm or bias
    shows): matrices N(0, 0.3), vectors 1 + N(0, 0.1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1) + (p.dim() == 1) * 1.0)
    return model.eval()


def sources(config: Any, n: int = 12, seed: int = 0) -> Batch:
    """``n`` random inputs of 3-20 tokens for an in-memory model of ``config``: encoder-decoder sources
    right-padded ending in EOS, decoder-only prompts left-padded."""
    import torch

    from seqgen_cli.search import Batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 21, (n,), generator=g).tolist()
    width = max(lengths)
    ids = torch.full((n, width), config.pad_token_id)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, length in enumerate(lengths):
        tokens = torch.randint(4, V, (length,), generator=g)
        if config.is_encoder_decoder:
            tokens[-1] = config.eos_token_id
            ids[i, :length], mask[i, :length] = tokens, 1
        else:
            ids[i, width - length :], mask[i, width - length :] = tokens, 1
    return Batch(ids, mask)


@functools.cache
def family_model(name: str) -> torch.nn.Module:
    """The tiny model of ``FAMILY_CONFIGS[name]`` (float32, untied head, EOS tuned so outputs end at varied
    lengths; cached)."""
    import torch
    import transformers as tf

    from tests.equivalence import tune_eos

    torch.manual_seed(0)
    cfg = FAMILY_CONFIGS[name]()
    cfg.tie_word_embeddings = False
    auto = tf.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else tf.AutoModelForCausalLM
    m = sharpen(auto.from_config(cfg), seed=len(name))
    ids = {k: getattr(cfg, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    start = getattr(cfg, "decoder_start_token_id", None)
    m.generation_config = tf.GenerationConfig(decoder_start_token_id=start, **ids)
    return tune_eos(m, sources(cfg, 8, seed=99))


def t5_vocabulary(name: str, vocab: int) -> Any:
    """The config of ``name`` (UMT5, T5Gemma) over the tiny T5 checkpoint's vocabulary and special ids."""
    if name == "umt5":
        return hf_config("UMT5Config", **{**T5_SHAPE, "vocab_size": vocab, "feed_forward_proj": "gated-gelu"})
    cfg = FAMILY_CONFIGS[name]()
    for part in (cfg, cfg.encoder, cfg.decoder):
        part.vocab_size, part.bos_token_id = vocab, 0  # decoding starts at T5's pad, as T5's does
    cfg.decoder_start_token_id = 0
    return cfg


def gpt2_config(**fields: Any) -> Any:
    return hf_config("GPT2Config", vocab_size=V, n_embd=32, n_head=4, n_layer=2, n_positions=64, **fields)


def llama_config(cls: str = "LlamaConfig", **fields: Any) -> Any:
    """A tiny Llama-shaped config of ``cls`` (Mistral, Qwen2 alike): grouped-query K/V heads unless ``fields``
    say otherwise."""
    fields = {"num_key_value_heads": 2, **fields}
    shape = dict(hidden_size=32, num_attention_heads=4, intermediate_size=48, num_hidden_layers=2)
    return hf_config(cls, vocab_size=V, max_position_embeddings=64, **shape, **fields)


#: the decoder-only variants (``tests/models/test_decoder_only.py`` holds each step to the model's own
#: teacher-forced forward; ``tests/models/test_prompt_tree.py`` their prompt trees)
DECODER_ONLY_CONFIGS: dict[str, Callable[[], Any]] = {
    "gpt2": gpt2_config,
    "gpt2-layerscale": lambda: gpt2_config(scale_attn_by_inverse_layer_idx=True),
    "llama": llama_config,
    "llama-mha-bias": lambda: llama_config(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    "llama-rope-linear": lambda: llama_config(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    ),
    "llama-mqa": lambda: llama_config(num_key_value_heads=1, tie_word_embeddings=True),
    "mistral": lambda: llama_config("MistralConfig", sliding_window=None, head_dim=12),
    "qwen2": lambda: llama_config("Qwen2Config"),  # q/k/v biases
    # sliding windows the prompts and steps reach: every layer (Mistral), the second layer only (Qwen2)
    "mistral-window4": lambda: llama_config("MistralConfig", sliding_window=4, head_dim=12),
    "qwen2-window3": lambda: llama_config(
        "Qwen2Config", use_sliding_window=True, sliding_window=3, max_window_layers=1
    ),
}


def causal_model(cfg: Any) -> torch.nn.Module:
    """A decoder-only model of ``cfg``, sharpened (GPT-2: seed 0, the Llama kinds: seed 1)."""
    from transformers import AutoModelForCausalLM

    return sharpen(AutoModelForCausalLM.from_config(cfg), 0 if cfg.model_type == "gpt2" else 1)


def decoder_only_model(name: str) -> torch.nn.Module:
    """The model of ``DECODER_ONLY_CONFIGS[name]`` (a new one each call: tests change them)."""
    return causal_model(DECODER_ONLY_CONFIGS[name]())


# ----------------------------------------------------------------------------------------------------------
# The registry: which model types its fixtures cover
# ----------------------------------------------------------------------------------------------------------

#: the model type of each checkpoint fixture (flan-t5 is a T5 v1.1)
CHECKPOINT_MODEL_TYPES: dict[str, str] = {
    family: "t5" if family == "flan-t5" else family for family in FAMILIES
}


def fixture_model_types() -> dict[str, list[str]]:
    """``model_type`` -> the fixtures of it here: checkpoints (:data:`FAMILIES`), in-memory families
    (:data:`FAMILY_CONFIGS`) and decoder-only variants (:data:`DECODER_ONLY_CONFIGS`); builds configs only."""
    found: dict[str, list[str]] = {}
    for family, model_type in CHECKPOINT_MODEL_TYPES.items():
        found.setdefault(model_type, []).append(f"checkpoint {family}")
    for registry, configs in (
        ("FAMILY_CONFIGS", FAMILY_CONFIGS),
        ("DECODER_ONLY_CONFIGS", DECODER_ONLY_CONFIGS),
    ):
        for name, make in configs.items():
            found.setdefault(make().model_type, []).append(f"{registry}[{name!r}]")
    return found
