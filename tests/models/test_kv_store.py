"""The keys and values both caches hold (``models/kv_store.py``), without a model: inputs leaving copy only the
positions written (zeros after them where asked), a kept buffer is filled in place, joiners go into their lanes'
first columns, a wider region is masked on the right, and a padding mask becomes the additive bias."""

from __future__ import annotations

import torch

from seqgen_cli.models.kv_store import KV, FixedKV, padding_bias

INF = float("-inf")


def generated(inputs: int = 3, positions: int = 4) -> KV:
    """Two layers of keys [B, H=1, d=2, T, R=1] and values [B, H=1, T, R=1, d=2]: ``b * 100 + t`` at every entry."""
    layers = [torch.arange(inputs)[:, None] * 100.0 + torch.arange(positions) for _ in range(2)]  # [B, T]
    keys = [x[:, None, None, :, None].expand(inputs, 1, 2, positions, 1).clone() for x in layers]
    values = [x[:, None, :, None, None].expand(inputs, 1, positions, 1, 2).clone() for x in layers]
    return KV(keys, values, key_dim=3, value_dim=2)


def test_leaving_keeps_the_written_positions_only() -> None:
    kv, inputs = generated(), torch.tensor([2, 0])
    kv.keep(inputs, used=2, zero=True)
    assert all(x.shape[0] == 2 for x in kv.tensors())
    assert kv.keys[0][:, 0, 0, :, 0].tolist() == [[200.0, 201.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert kv.values[1][:, 0, :, 0, 1].tolist() == [[200.0, 201.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    whole = generated()
    whole.keep(inputs)  # no positions given: the whole tensors
    assert whole.keys[0][:, 0, 0, :, 0].tolist() == [[200.0, 201.0, 202.0, 203.0], [0.0, 1.0, 2.0, 3.0]]
    assert kv.nbytes == whole.nbytes == 2 * 2 * (2 * 2 * 4) * 4  # layers x (K, V) x B' * d * T floats


def test_a_kept_buffer_is_filled_in_place() -> None:
    kv, into = generated(), generated(inputs=2)
    addresses = [x.data_ptr() for x in into.tensors()]
    kv.keep_into(into, torch.tensor([1, 2]), used=3)
    assert [x.data_ptr() for x in into.tensors()] == addresses
    assert into.keys[1][:, 0, 1, :, 0].tolist() == [[100.0, 101.0, 102.0, 0.0], [200.0, 201.0, 202.0, 0.0]]


def test_joiners_fill_their_lanes_first_columns_and_widening_masks_the_rest() -> None:
    """Lanes of 3 columns; a joiner of 2 goes into lane 1's columns 0-1 (its bias all 3); widened to 5, every lane's
    new columns are masked zeros."""
    keys, values = [torch.zeros(2, 1, 2, 3)], [torch.zeros(2, 1, 3, 2)]  # [L, Hkv, d, W], [L, Hkv, W, d]
    fixed = FixedKV(keys, values, padding_bias(torch.zeros(2, 3, dtype=torch.long), 3))
    assert fixed.width == 3 and fixed.bias.shape == (2, 1, 1, 3) and fixed.bias.isinf().all()
    k, v = torch.ones(1, 1, 2, 2), torch.full((1, 1, 2, 2), 2.0)  # [J, Hkv, d, w], [J, Hkv, w, d]
    fixed.put(torch.tensor([1]), [k], [v], padding_bias(torch.tensor([[0, 1]]), 3))
    assert fixed.keys[0][1, 0].tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    assert fixed.bias[:, 0, 0].tolist() == [[INF] * 3, [INF, 0.0, INF]]
    fixed.widen(5)
    fixed.widen(4)  # never narrower
    assert fixed.width == 5 and fixed.keys[0].shape == (2, 1, 2, 5) and fixed.values[0].shape == (2, 1, 5, 2)
    assert fixed.bias[1, 0, 0].tolist() == [INF, 0.0, INF, INF, INF]
    assert fixed.values[0][1, 0].tolist() == [[2.0, 2.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]


def test_a_fixed_region_restarts_and_is_kept_in_place() -> None:
    fixed = FixedKV([torch.zeros(2, 1, 2, 3)], [torch.zeros(2, 1, 3, 2)], torch.zeros(2, 1, 1, 3))
    addresses = [x.data_ptr() for x in [*fixed.tensors(), fixed.bias]]
    new = torch.arange(12.0).view(2, 1, 2, 3)  # [B, Hkv, d, W]
    fixed.restart([new], [new.transpose(-1, -2)], padding_bias(torch.tensor([[1, 1, 0], [0, 1, 1]]), 3))
    assert [x.data_ptr() for x in [*fixed.tensors(), fixed.bias]] == addresses
    into = FixedKV(*fixed.zeros(1))
    assert into.keys[0].shape == (1, 1, 2, 3) and not into.bias.any()
    fixed.keep_into(into, torch.tensor([1]))
    assert torch.equal(into.keys[0][0], new[1]) and into.bias.view(-1).tolist() == [INF, 0.0, 0.0]
    fixed.keep(torch.tensor([1, 1]))
    assert fixed.keys[0].shape == (2, 1, 2, 3) and fixed.bias.view(2, 3).tolist() == [[INF, 0.0, 0.0]] * 2


def test_a_padding_mask_as_a_bias() -> None:
    """As transformers masks padding: 0 where a column is attended, -inf where not (and past the mask's width)."""
    bias = padding_bias(torch.tensor([[0, 1], [1, 1]]), 4)
    assert bias.dtype == torch.float32 and bias.shape == (2, 1, 1, 4)
    assert bias.view(2, 4).tolist() == [[INF, 0.0, INF, INF], [0.0, 0.0, INF, INF]]
