"""In-memory tiny random models for the engine tests (one per family), EOS-tuned to stop at varied lengths."""

from __future__ import annotations

import functools

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    GPT2Config,
    LlamaConfig,
    MarianConfig,
    MBartConfig,
    PegasusConfig,
    PreTrainedModel,
    T5Config,
)

from tests.equivalence import tune_eos

FAMILIES = ("bart", "mbart", "marian", "pegasus", "t5", "flan-t5", "gpt2", "llama")
VOCAB = 320

_ENC_DEC = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=128,
    init_std=0.3,  # larger than default so that outputs depend on the input
)


def _config(family: str):
    if family == "bart":
        return BartConfig(**_ENC_DEC, forced_eos_token_id=2)
    if family == "mbart":
        return MBartConfig(**_ENC_DEC, forced_bos_token_id=250 % VOCAB, forced_eos_token_id=2)
    if family == "marian":
        return MarianConfig(**_ENC_DEC, pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1, eos_token_id=0)
    if family == "pegasus":
        return PegasusConfig(**_ENC_DEC, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if family in ("t5", "flan-t5"):
        return T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu" if family == "flan-t5" else "relu",
            tie_word_embeddings=family == "t5",
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            initializer_factor=3.0,
        )
    if family == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0, initializer_range=0.3
        )
    if family == "llama":
        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=0.3,
        )
    raise ValueError(family)


@functools.cache
def tiny_model(family: str) -> PreTrainedModel:
    torch.manual_seed(0)
    config = _config(family)
    cls = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = cls.from_config(config).eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = model.generation_config.eos_token_id
    return tune_eos(model)
