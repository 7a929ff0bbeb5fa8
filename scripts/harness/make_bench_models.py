#!/usr/bin/env python
"""Build randomly initialised benchmark checkpoints with real configs and tokenizers.

    python scripts/harness/make_bench_models.py                      # all models into ~/.cache/seqgen-bench/
    python scripts/harness/make_bench_models.py bart-base marian-base --out /tmp/bench-models

Each model is ``from_config`` under a fixed seed, saved with ``save_pretrained`` (safetensors) next to
its tokenizer and generation config. The weights are random: the outputs are meaningless text, but the
shapes, vocabularies and token counts are the real ones, so speed measurements are realistic. Tokenizers
and configs come from ``../shared/tokenizers`` (or ``$SEQGEN_SHARED/tokenizers``); nothing is copied
into the repository.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path("~/.cache/seqgen-bench").expanduser()

T5GEMMA_MODULE = dict(
    vocab_size=32128, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64, sliding_window=4096, max_position_embeddings=8192,
    pad_token_id=0, eos_token_id=1, bos_token_id=0,
)  # fmt: skip
GEMMA3_270M = dict(
    vocab_size=32128, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    pad_token_id=0, eos_token_id=1, bos_token_id=0,
)  # fmt: skip

# name -> (tokenizer/config folder in shared/tokenizers, config overrides)
MODELS: dict[str, tuple[str, dict]] = {
    "bart-large-cnn": ("bart-large-cnn", {}),
    "distilbart-cnn-12-6": ("distilbart-cnn-12-6", {}),
    "t5-small": ("t5-small", {}),
    "gpt2": ("gpt2", {}),
    "opus-mt-tc-big-en-pt": ("opus-mt-tc-big-en-pt", {}),
    # bart-base shape (6+6 layers, d_model 768, 12 heads, ffn 3072) with the bart-large-cnn tokenizer and
    # generation settings.
    "bart-base": (
        "bart-large-cnn",
        {
            "encoder_layers": 6,
            "decoder_layers": 6,
            "num_hidden_layers": 6,
            "d_model": 768,
            "encoder_attention_heads": 12,
            "decoder_attention_heads": 12,
            "encoder_ffn_dim": 3072,
            "decoder_ffn_dim": 3072,
        },
    ),
    # Marian shape of the classic OPUS-MT models (e.g. opus-mt-en-de: 6+6 layers, d_model 512, 8 heads,
    # ffn 2048, swish) with the opus-mt-tc-big-en-pt tokenizer (vocabulary 54776).
    "marian-base": (
        "opus-mt-tc-big-en-pt",
        {
            "d_model": 512,
            "encoder_attention_heads": 8,
            "decoder_attention_heads": 8,
            "encoder_ffn_dim": 2048,
            "decoder_ffn_dim": 2048,
            "activation_function": "swish",
            "max_position_embeddings": 512,
        },
    ),
    # nllb-200-distilled-600M's shape (12+12 layers, ffn 4096; d_model 1024, 256,206-word vocabulary) over the
    # nllb-200-1.3B config, with a tokenizer built here (a BPE trained on the WMT text, the 202 language codes)
    "nllb-600m": (
        "nllb-200-1.3B-config",
        {
            "encoder_layers": 12,
            "decoder_layers": 12,
            "num_hidden_layers": 12,
            "encoder_ffn_dim": 4096,
            "decoder_ffn_dim": 4096,
        },
    ),
    # a Llama-style decoder of SmolLM-135M's published shape (30 layers, hidden 576, 9 heads over 3 K/V heads, MLP
    # 1536) over the GPT-2 tokenizer: no Llama config or tokenizer is in the shared folder, so the config is built
    "llama-135m": (
        "gpt2",
        {
            "config_class": "LlamaConfig",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
            "vocab_size": 50257,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
        },
    ),
    # Qwen2.5-0.5B-Instruct's shape (24 layers, hidden 896, 14 query heads over 2 K/V heads, MLP 4864, tied head)
    # over the GPT-2 tokenizer (no Qwen tokenizer in the shared folder: vocabulary 50,257, not 151,936) with a
    # ChatML chat template (its markers spelled out in GPT-2's tokens)
    "qwen2.5-0.5b": (
        "gpt2",
        {
            "config_class": "Qwen2Config",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "vocab_size": 50257,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "chat_template": (
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
            ),
        },
    ),
    # a T5Gemma built here (no T5Gemma config or tokenizer is in the shared folder): t5-base-like widths (12 + 12
    # layers, hidden 768, MLP 2048, head_dim 64) with the Gemma 2 decoder's grouped-query heads (12 over 4 K/V),
    # soft-capping (attention 50, logits 30) and a 4,096-position window on every other layer, over t5-small's
    # tokenizer (vocabulary 32,128; decoding starts at its pad token, as T5's does)
    "t5gemma-b": (
        "t5-small",
        {
            "config_class": "T5GemmaConfig",
            **{part: dict(T5GEMMA_MODULE) for part in ("encoder", "decoder")},
            "vocab_size": 32128,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 0,
        },
    ),
    # a T5Gemma 2 of t5gemma-2-270m-270m's text shape built here (Gemma 3 270M's decoder layers on both sides: 18 + 18
    # layers, hidden 640, 4 heads over 1 K/V head of 256, MLP 2048, five 512-position sliding layers to one full,
    # merged attention in the decoder) over t5-small's tokenizer (vocabulary 32,128; its last three extra ids as the
    # image tokens); the vision tower tiny: only text goes in
    "t5gemma2-270m": (
        "t5-small",
        {
            "config_class": "T5Gemma2Config",
            "encoder": {
                "text_config": dict(GEMMA3_270M),
                "vision_config": dict(
                    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                    patch_size=8,
                ),
                "mm_tokens_per_image": 4, "boi_token_index": 32125, "eoi_token_index": 32126, "image_token_index": 32127,
            },
            "decoder": dict(GEMMA3_270M, eoi_token_index=32126),
            "image_token_index": 32127,
        },
    ),
}
BPE_WORDS = 32000  # the built NLLB tokenizer's vocabulary (the codes and special tokens aside)


def nllb_tokenizer(source: Path, shared: Path) -> object:
    """An ``NllbTokenizer`` for a config folder without a tokenizer model: a Metaspace BPE of ``BPE_WORDS`` words
    trained on the WMT en-de text of the shared folder, ``<s> <pad> </s> <unk>`` at ids 0-3 as NLLB has them, and
    the language codes of ``special_tokens_map.json`` after the words."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import NllbTokenizer

    codes = json.loads((source / "special_tokens_map.json").read_text(encoding="utf-8"))["additional_special_tokens"]
    files = sorted(str(p) for p in (shared / "data" / "wmt").rglob("*") if p.is_file() and p.suffix in (".en", ".de"))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    bpe.train(files, trainers.BpeTrainer(vocab_size=BPE_WORDS, special_tokens=["<s>", "<pad>", "</s>", "<unk>"]))
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return NllbTokenizer(vocab=model["vocab"], merges=merges, additional_special_tokens=codes)


def shared_dir() -> Path:
    """``$SEQGEN_SHARED`` or ``../shared`` next to the repository root."""
    return Path(os.environ.get("SEQGEN_SHARED", REPO.parent / "shared"))


def build(
    name: str,
    out: Path,
    seed: int = 0,
    force: bool = False,
    overrides: dict | None = None,
    shared: Path | None = None,
    target_name: str | None = None,
) -> Path:
    """Build one checkpoint folder ``out/name`` (skipped when it already holds weights).

    ``overrides`` are applied on top of ``MODELS[name]``'s (e.g. tiny widths for a quick run, saved as
    ``out/target_name``); ``shared`` is the shared folder (default :func:`shared_dir`).
    """
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        GenerationConfig,
    )

    source_name, base_overrides = MODELS[name]
    overrides = {**base_overrides, **(overrides or {})}
    source = (shared or shared_dir()) / "tokenizers" / source_name
    if not source.is_dir():
        sys.exit(f"make_bench_models: {source} does not exist (set SEQGEN_SHARED to the shared folder)")
    target = out / (target_name or name)
    if (target / "model.safetensors").is_file() and not force:
        print(f"{name}: exists at {target} (use --force to rebuild)")
        return target
    chat_template = overrides.pop("chat_template", None)  # set on the tokenizer, not the config
    built = overrides.pop("config_class", None)  # a config of this class from the overrides, not the folder's
    if built is not None:
        import transformers

        config = getattr(transformers, built)(**overrides)
    else:
        config = AutoConfig.from_pretrained(source)
        for key, value in overrides.items():
            setattr(config, key, value)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = auto.from_config(config)
    model.eval()
    shared = shared or shared_dir()
    has_model = any((source / f).is_file() for f in ("tokenizer.json", "sentencepiece.bpe.model", "vocab.json"))
    tokenizer = AutoTokenizer.from_pretrained(source) if has_model else nllb_tokenizer(source, shared)
    if built is None and (source / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{name}: {params:.0f}M parameters, saved to {target} in {time.perf_counter() - start:.0f}s")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help=f"models to build (default: all): {', '.join(MODELS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"cache folder (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild existing models")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    out = args.out.expanduser().resolve()
    if out == REPO or REPO in out.parents:
        parser.error("--out must be outside the repository")
    for name in args.names or list(MODELS):
        build(name, out, seed=args.seed, force=args.force)


if __name__ == "__main__":
    main()
