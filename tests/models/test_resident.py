"""``models/resident.py``: the pages of replaced checkpoint weights go back, and nothing else is touched."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from seqgen_cli.models.resident import PAGE, PRESENT, _span, release

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.access("/proc/self/pagemap", os.R_OK), reason="Linux pagemap"
)


def resident_pages(t: torch.Tensor) -> int:
    """How many whole pages inside ``t`` are resident in this process."""
    start, stop = _span(t)
    if stop <= start:
        return 0
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        raw = os.pread(fd, (stop - start) // PAGE * 8, start // PAGE * 8)
    finally:
        os.close(fd)
    return int(((np.frombuffer(raw, dtype=np.uint64) >> PRESENT) & 1).sum())


def mapped(tmp_path: Path, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    """``tensors`` saved and read back as safetensors maps them (views of a private file mapping)."""
    save_file(tensors, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict


def test_file_pages_go_and_come_back_with_their_values(tmp_path: Path) -> None:
    w = torch.randn(64, PAGE)  # 64 pages of float32 rows
    m = mapped(tmp_path, w=w)["w"]
    assert torch.equal(m, w)  # read: resident
    assert resident_pages(m) >= 63
    assert release([m]) >= 63 * PAGE
    assert resident_pages(m) == 0
    assert torch.equal(m, w)  # faulted in again from the file


def test_anonymous_memory_is_never_dropped(tmp_path: Path) -> None:
    w = torch.randn(64, PAGE)
    kept = w.clone()
    assert release([w]) == 0
    assert torch.equal(w, kept)
    m = mapped(tmp_path, w=w)["w"]
    m.sum()  # every page resident
    m[17, 5] = 123.0  # a written page of a private file mapping is private memory now: dropping it would lose this
    assert release([m]) == 0
    assert m[17, 5].item() == 123.0 and resident_pages(m) >= 63


def test_int8_backend_gives_back_its_float32_decoder_pages(tmp_path: Path) -> None:
    """Every decoder weight (fused q|k|v and cross k|v included) and the tied LM head: no page resident once the
    int8 backend is built from a checkpoint transformers mapped."""
    from transformers import BartConfig, BartForConditionalGeneration

    from seqgen_cli.models import get_backend

    config = BartConfig(
        vocab_size=1024, d_model=256, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=64,
    )  # fmt: skip
    BartForConditionalGeneration(config).save_pretrained(tmp_path)  # 256 KB per attention weight: 64 pages
    model = BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    dec = model.get_decoder()
    weights = [p for p in dec.layers.parameters() if p.dim() == 2] + [model.get_output_embeddings().weight]
    for p in weights:
        p.sum()  # read: resident
    if any(_anonymous(p) for p in weights):
        pytest.skip("transformers did not map this checkpoint's weights from the file")
    assert all(resident_pages(p) > 0 for p in weights)
    backend = get_backend(model, int8=True)
    assert backend.int8
    assert [resident_pages(p) for p in weights] == [0] * len(weights)


def _anonymous(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is private anonymous (torch's allocator, or written pages)."""
    from seqgen_cli.models.resident import _only_file_pages

    start, stop = _span(t)
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        return not _only_file_pages(fd, start, stop)
    finally:
        os.close(fd)
