"""Fast encoder-decoder backends (``seqgen_cli.models.encoder_decoder``) against transformers' own forward.

Every step's logits must equal the HF model's teacher-forced full forward over the same (reordered,
dropped) histories, for every family.
"""

from __future__ import annotations

import pytest
import torch

from seqgen_cli.models import fast_backend
from seqgen_cli.search.protocol import Batch
from seqgen_cli.shapes import cross_width
from tests.equivalence import SUMMATION_ATOL, SUMMATION_RTOL
from tests.tiny_models import load_tiny

ENCDEC = ["bart", "mbart", "marian", "pegasus", "t5", "flan-t5"]


def _batch(model, lengths: list[int], seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    s = max(lengths)
    ids = torch.randint(4, cfg.vocab_size, (len(lengths), s), generator=g)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        ids[i, n:] = cfg.pad_token_id
    return Batch(input_ids=ids, attention_mask=mask)


def _reference(model, batch: Batch, inputs: list[int], r: int, hist: torch.Tensor) -> torch.Tensor:
    """HF full forward over histories ``hist`` [N, t] for the rows of ``inputs``: last-position logits [N, V]."""
    idx = torch.tensor(inputs).repeat_interleave(r)
    with torch.no_grad():
        out = model(
            input_ids=batch.input_ids[idx],
            attention_mask=batch.attention_mask[idx],
            decoder_input_ids=hist,
        )
    return out.logits[:, -1]


@pytest.mark.parametrize("family", ENCDEC)
def test_step_logits_match_hf_with_reorder_and_drop(tiny_models, family: str) -> None:
    model = load_tiny(tiny_models(family))[0]
    dec = fast_backend(model)
    r, steps = 3, 7
    batch = _batch(model, [5, 9, 2], seed=1)
    g = torch.Generator().manual_seed(2)
    state, first = dec.start(batch, rows_per_input=r, max_new_tokens=steps)
    assert first is None
    inputs = [0, 1, 2]
    start = model.config.decoder_start_token_id
    hist = torch.full((len(inputs) * r, 1), start, dtype=torch.long)  # [N, t]
    checked = 0
    for t in range(steps):
        logits = dec.step(state, hist[:, -1])
        assert logits.shape == (len(inputs) * r, dec.vocab_size)
        ref = _reference(model, batch, inputs, r, hist)
        scale = ref.abs().max().item()  # tiny random models have large logits
        # 2e-5 of the scale: against a float64 forward, transformers' float32 logits and ours are both off by
        # up to ~1e-4 of it on these models (pegasus, mbart); they just round differently (SDPA vs two GEMMs).
        torch.testing.assert_close(logits, ref, atol=2e-5 * max(scale, 1.0), rtol=1e-5)
        checked += 1
        if t == steps - 1:
            break
        n = hist.shape[0]
        if t >= 1:  # beam reorder: rows continue random rows of the same input (duplicates allowed)
            rows = (torch.arange(n) // r) * r + torch.randint(0, r, (n,), generator=g)
            dec.reorder(state, rows)
            hist = hist[rows]
        if t == 3:  # input 1 (the middle one) finishes
            keep = torch.tensor([0, 2])
            rows = (keep[:, None] * r + torch.arange(r)).reshape(-1)
            dec.keep(state, keep, rows)
            inputs = [inputs[i] for i in keep.tolist()]
            hist = hist[rows]
        nxt = torch.randint(4, dec.vocab_size, (hist.shape[0], 1), generator=g)
        hist = torch.cat([hist, nxt], dim=1)
    assert checked == steps
    with pytest.raises(ValueError, match="beyond the 7 positions"):
        dec.step(state, hist[:, -1])


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_cross_kv_stored_once_per_input(tiny_models, family: str) -> None:
    model = load_tiny(tiny_models(family))[0]
    dec = fast_backend(model)
    bsz, r, s = 2, 4, 6
    batch = _batch(model, [s, 3], seed=3)
    state, _ = dec.start(batch, rows_per_input=r, max_new_tokens=5)
    inner = dec.heads * dec.head_dim
    itemsize = torch.finfo(torch.float32).bits // 8
    sizes = dec.cache_nbytes(state)
    w = cross_width(s)  # whole cross-attention chunks
    assert sizes["cross"] == dec.n_layers * 2 * bsz * w * inner * itemsize  # B, not B * beams
    assert all(k.shape == (bsz, dec.heads, dec.head_dim, w) for k in state.cache.fixed.keys)  # keys transposed
    assert all(v.shape == (bsz, dec.heads, w, dec.head_dim) for v in state.cache.fixed.values)
    assert sizes["cross"] + sizes["self"] + sizes["bias"] == dec.cache_bytes(bsz, s, r, 5)
    # self-attention cache: preallocated once, N = B * R rows, max_new_tokens positions
    for cache in (state.cache.generated.keys, state.cache.generated.values):  # one tensor per layer (in place)
        assert len(cache) == dec.n_layers
        assert all(x.shape == (bsz, dec.heads, 5, r, dec.head_dim) for x in cache)
    dec.keep(state, torch.tensor([1]), torch.arange(r, 2 * r))
    assert dec.cache_nbytes(state)["cross"] == dec.n_layers * 2 * 1 * w * inner * itemsize


def test_fused_qkv_shares_the_model_weights(tiny_models) -> None:
    model = load_tiny(tiny_models("bart"))[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dec = fast_backend(model)
    lay = model.get_decoder().layers[0].self_attn
    fused = dec.layers[0].qkv_w
    assert fused.untyped_storage().data_ptr() == lay.q_proj.weight.untyped_storage().data_ptr()
    assert lay.v_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = fast_backend(model)  # a second backend reuses the fused storage
    assert again.layers[0].qkv_w.data_ptr() == fused.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["mbart", "t5"])
def test_half_precision_runs_and_tracks_hf(tiny_models, family: str, dtype: torch.dtype) -> None:
    model = load_tiny(tiny_models(family), dtype)[0]
    dec = fast_backend(model)
    r = 2
    batch = _batch(model, [4, 6], seed=5)
    state, _ = dec.start(batch, rows_per_input=r, max_new_tokens=3)
    hist = torch.full((2 * r, 1), model.config.decoder_start_token_id, dtype=torch.long)
    for _ in range(3):
        logits = dec.step(state, hist[:, -1])
        assert logits.dtype == dtype
        ref = _reference(model, batch, [0, 1], r, hist)
        scale = ref.float().abs().max().item()
        assert (logits.float() - ref.float()).abs().max().item() <= 0.05 * max(scale, 1.0)
        dec.reorder(state, torch.tensor([1, 1, 2, 3]))
        hist = torch.cat([hist[torch.tensor([1, 1, 2, 3])], hist[:, -1:] + 5], dim=1)


def test_encoder_runs_on_onednn_and_leaves_the_model_as_it_was(tiny_models) -> None:
    """Float32 on the CPU: the backend's encoder is a copy of the model's whose linears run oneDNN
    (``linear_maps.SourceLinear``), sharing every weight; the model's own encoder, which ``generate()`` runs,
    keeps its ``nn.Linear`` layers. Its output agrees with the model's encoder up to the products' summation
    order (``SUMMATION_RTOL``)."""
    from seqgen_cli.models.linear_maps import ONEDNN, SourceLinear

    if not ONEDNN:
        pytest.skip("torch without oneDNN")
    model = load_tiny(tiny_models("bart"))[0]
    dec = fast_backend(model)
    own = model.get_encoder()
    assert any(isinstance(m, SourceLinear) for m in dec.source.encoder.modules())
    assert not any(isinstance(m, SourceLinear) for m in own.modules())
    assert {p.data_ptr() for p in dec.source.encoder.parameters()} == {p.data_ptr() for p in own.parameters()}
    ids = torch.randint(4, model.config.vocab_size, (3, 24))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        ours = dec.source.run(ids, mask)
        theirs = own(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=SUMMATION_RTOL, atol=SUMMATION_ATOL)
