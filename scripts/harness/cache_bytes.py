"""KV-cache bytes: seqgen's fast BART backend vs transformers' ``generate()`` (beam search).

Measures bytes, not time. Analytic at the bart-large-cnn shape (batch 32 x beam 4, source 1024, 142 new
tokens, float32), verified by measuring real tensors at the same width with fewer layers and inputs (bytes
are linear in both): ``generate()``'s returned ``past_key_values`` vs the fast backend's preallocated cache
after ``start()``. Needs the bart-large-cnn config in the shared data folder. See docs/EXPERIMENTS.md
("KV-cache memory"). From the repository root, with the package installed (``pip install -e .``):

    python scripts/harness/cache_bytes.py
"""

from __future__ import annotations

import torch
from _common import random_model

from seqgen_cli.models import fast_backend
from seqgen_cli.search.protocol import Batch


def analytic(
    layers: int, d_model: int, batch: int, beams: int, src: int, new: int, itemsize: int = 4
) -> dict:
    """Bytes of keys + values. ``generate()``: cross K/V per beam row, self K/V grown to ``new`` positions."""
    rows = batch * beams
    hf_cross = layers * 2 * rows * src * d_model * itemsize
    hf_self = layers * 2 * rows * new * d_model * itemsize
    ours_cross = layers * 2 * batch * src * d_model * itemsize  # once per input
    ours_self = layers * 2 * rows * new * d_model * itemsize  # preallocated: max_new_tokens positions
    ours_ptrs = rows * new * 8  # back-pointers, int64
    return {
        "hf_cross": hf_cross,
        "hf_self": hf_self,
        "hf": hf_cross + hf_self,
        "ours_cross": ours_cross,
        "ours_self": ours_self + ours_ptrs,
        "ours": ours_cross + ours_self + ours_ptrs,
    }


def cache_tensor_bytes(cache) -> int:
    total = 0
    for sub in (cache.self_attention_cache, cache.cross_attention_cache):
        for layer in sub.layers:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


def measure(layers: int, batch: int, beams: int, src: int, new: int) -> tuple[int, int]:
    model, _ = random_model("bart-large-cnn", {"encoder_layers": 1, "decoder_layers": layers})
    ids = torch.randint(4, 1000, (batch, src))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            num_beams=beams,
            max_new_tokens=new,
            min_new_tokens=new,
            return_dict_in_generate=True,
            use_cache=True,
        )
    hf = cache_tensor_bytes(out.past_key_values)
    backend = fast_backend(model)
    state, _ = backend.start(Batch(ids, mask), rows_per_input=beams, max_new_tokens=new)
    ours = sum(backend.cache_nbytes(state).values())
    return hf, ours


def main() -> None:
    gb = 1e9
    full = analytic(12, 1024, 32, 4, 1024, 142)
    print(
        f"bart-large-cnn 32x4, src 1024, 142 new (analytic, fp32): generate() {full['hf'] / gb:.2f} GB "
        f"(cross {full['hf_cross'] / gb:.2f}, self {full['hf_self'] / gb:.2f}); "
        f"fast {full['ours'] / gb:.2f} GB (cross {full['ours_cross'] / gb:.2f}, self {full['ours_self'] / gb:.2f}); "
        f"ratio {full['hf'] / full['ours']:.2f}x"
    )
    layers, batch, beams, src, new = 2, 2, 4, 1024, 142
    hf, ours = measure(layers, batch, beams, src, new)
    small = analytic(layers, 1024, batch, beams, src, new)
    # generate() never feeds its last token, so its self cache holds new - 1 + 1 (start) = new positions
    print(
        f"measured ({layers} dec layers, {batch}x{beams}, src {src}, {new} new): generate() {hf} B "
        f"(analytic {small['hf']}), fast {ours} B (analytic {small['ours']}); ratio {hf / ours:.2f}x"
    )


if __name__ == "__main__":
    main()
