"""Fast decoder-only backends (GPT-2, Llama) against the HF model's own teacher-forced forward.

Every ``step`` is checked against a full forward of ``[left-padded prompt ; this row's history]`` with the
position ids ``generate()`` uses, through beam reorders and drops.
"""

from __future__ import annotations

import pytest
import torch

from seqgen_cli.models import fast_backend, get_backend
from seqgen_cli.models.decoder_only import DecoderOnlyBackend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.models.prefill import prompt_position_ids
from seqgen_cli.search.protocol import Batch
from tests.tiny_models import (
    DECODER_ONLY_CONFIGS,
    V,
    causal_model,
    decoder_only_model,
    llama_config,
)

PAD = 0


def fast(model) -> DecoderOnlyBackend:
    """The fast backend (never the generic fallback)."""
    backend = fast_backend(model)
    assert backend is not None and not isinstance(backend, GenericBackend)
    return backend


def left_pad(seqs: list[list[int]]) -> Batch:
    P = max(map(len, seqs))
    ids = torch.tensor([[PAD] * (P - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in seqs])
    return Batch(ids, mask)


@torch.no_grad()
def reference(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """HF teacher-forced last-position logits of left-padded ``seqs``: [len(seqs), V]."""
    b = left_pad(seqs)
    out = model(
        input_ids=b.input_ids,
        attention_mask=b.attention_mask,
        position_ids=prompt_position_ids(b.attention_mask),
    )
    return out.logits[:, -1].float()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def run_checked(model, prompts: list[list[int]], R: int, steps: int, seed: int = 0) -> dict:
    """Drive the backend with random tokens, reorders and one drop; check every step's logits."""
    dec = fast(model)
    g = torch.Generator().manual_seed(seed)
    state, first = dec.start(left_pad(prompts), rows_per_input=R, max_new_tokens=steps)
    close(first, reference(model, prompts))
    active = list(range(len(prompts)))  # original input of each active input
    hist: list[list[int]] = [[] for _ in range(len(prompts) * R)]
    for t in range(steps):
        N = len(active) * R
        if t % 2 == 1 and R > 1:  # beams jump to other beams of the same input
            rows = torch.arange(N) // R * R + torch.randint(R, (N,), generator=g)
            dec.reorder(state, rows)
            hist = [list(hist[r]) for r in rows.tolist()]
        if t == steps // 2 and len(active) > 1:  # the middle input finishes
            keep = [i for i in range(len(active)) if i != len(active) // 2]
            dec.keep(state, torch.tensor(keep), torch.tensor([i * R + k for i in keep for k in range(R)]))
            active = [active[i] for i in keep]
            hist = [hist[i * R + k] for i in keep for k in range(R)]
            N = len(active) * R
        tokens = torch.randint(1, V, (N,), generator=g)
        logits = dec.step(state, tokens)
        for n, tok in enumerate(tokens.tolist()):
            hist[n].append(tok)
        close(logits, reference(model, [prompts[active[n // R]] + hist[n] for n in range(N)]))
    return {"dec": dec, "state": state}


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [3]]


@pytest.mark.parametrize("name", list(DECODER_ONLY_CONFIGS))
@pytest.mark.parametrize("R", [1, 3])
def test_steps_match_teacher_forced_forward(name: str, R: int) -> None:
    run_checked(decoder_only_model(name), PROMPTS, R=R, steps=6)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_unpadded_prompts(name: str) -> None:
    run_checked(decoder_only_model(name), [[5, 6, 7, 8], [9, 10, 11, 12]], R=2, steps=4)


def test_check_can_fail() -> None:
    """A corrupted cache must be caught by the same check."""
    model = decoder_only_model("gpt2")
    dec = fast(model)
    state, _ = dec.start(left_pad(PROMPTS[:2]), rows_per_input=2, max_new_tokens=3)
    dec.step(state, torch.tensor([1, 2, 3, 4]))
    dec.reorder(state, torch.tensor([1, 1, 2, 3]))  # row 0 now continues row 1 (token 2)...
    logits = dec.step(state, torch.tensor([5, 5, 5, 5]))
    with pytest.raises(AssertionError):  # ...so its own old history [1, 5] no longer matches
        close(logits[:1], reference(model, [PROMPTS[0] + [1, 5]]))
    close(logits[:1], reference(model, [PROMPTS[0] + [2, 5]]))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cache_accounting(name: str) -> None:
    """Prompt K/V stored once per input (not per beam), only the K/V heads, generated K/V preallocated."""
    model = decoder_only_model(name)
    cfg = model.config
    B, R, T = 2, 4, 5
    dec = fast(model)
    batch = left_pad(PROMPTS[:B])
    P = batch.input_ids.shape[1]
    state, _ = dec.start(batch, rows_per_input=R, max_new_tokens=T)
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", H)
    d = cfg.hidden_size // H
    fixed, generated = state.cache.fixed, state.cache.generated
    assert all(k.shape == (B, Hkv, d, P) for k in fixed.keys)  # K stored transposed
    assert all(v.shape == (B, Hkv, P, d) for v in fixed.values)
    assert all(k.shape == (B, Hkv, d, T, R) for k in generated.keys)
    assert all(v.shape == (B, Hkv, T, R, d) for v in generated.values)
    ptrs = {k.data_ptr() for k in generated.tensors()}
    for _ in range(T):
        dec.step(state, torch.ones(B * R, dtype=torch.long))
        dec.reorder(state, torch.tensor([0, 0, 1, 1, 7, 6, 5, 4]))
    assert {k.data_ptr() for k in generated.tensors()} == ptrs  # written in place, never reallocated
    with pytest.raises(ValueError, match="beyond the 5 positions"):
        dec.step(state, torch.ones(B * R, dtype=torch.long))
    sizes = dec.cache_nbytes(state)
    assert fixed.bias.numel() == B * P  # the prompt's padding mask, float32
    assert sizes == {
        "fixed": 2 * L * B * Hkv * P * d * 4,
        "fixed_bias": B * P * 4,
        "generated": 2 * L * B * R * Hkv * T * d * 4,
        "pointers": B * R * T * 8,
    }
    assert dec.cache_bytes(B, P, R, T) == sum(sizes.values())
    if name == "llama":
        assert Hkv == 2 < H


def test_refused_variants() -> None:
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert fast_backend(causal_model(llama_config(rope_parameters=dynamic))) is None
    assert isinstance(fast_backend(decoder_only_model("llama")), DecoderOnlyBackend)
    windowed = causal_model(llama_config("MistralConfig", sliding_window=4))
    assert isinstance(fast_backend(windowed), DecoderOnlyBackend)
    refused = causal_model(llama_config(rope_parameters=dynamic))
    assert isinstance(get_backend(refused), GenericBackend)  # get_backend falls back


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_half_precision_close_to_hf(name: str, dtype: torch.dtype) -> None:
    """Half precision runs and stays near transformers' own forward in that dtype (loose: rounding differs)."""
    model = decoder_only_model(name).to(dtype)
    dec = fast(model)
    state, first = dec.start(left_pad(PROMPTS), rows_per_input=2, max_new_tokens=3)
    assert first.dtype == torch.float32
    fixed = state.cache.fixed
    assert fixed.keys[0].dtype == fixed.values[0].dtype == torch.float32  # the CPU attends half precision in float32
    hist = [[] for _ in range(8)]
    for t in range(3):
        tokens = torch.arange(8) + 3 * t + 1
        logits = dec.step(state, tokens)
        for n, tok in enumerate(tokens.tolist()):
            hist[n].append(tok)
    ref = reference(model, [PROMPTS[n // 2] + hist[n] for n in range(8)])
    err = (logits - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err
