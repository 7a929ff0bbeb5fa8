"""bfloat16 on the CPU (``--dtype bfloat16``): the fast backends' linear maps run oneDNN's bf16 products on weights
packed once (``linear_maps.PackedLinear``), where the CPU has them; the outputs are no noisier than ``generate()``'s
own in bfloat16."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from seqgen_cli.generator import Generator
from seqgen_cli.models import backend_stats, layers, linear_maps
from tests.tiny_models import shared_dir

BF16 = torch.bfloat16 in linear_maps.ONEDNN_DTYPES


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_bfloat16_maps_run_packed_onednn_products(tiny_models, family: str, monkeypatch) -> None:
    """The op trace of a bf16 run: the fast backend's products (decoder, LM head, and the encoder's copy) run on
    bf16 activations, on oneDNN's packed weights once each map has run ``PACK_AFTER`` times (every decoder map of the
    last steps), none on ``F.linear`` but a decoder-only prompt's prefill (transformers' forward). Where the CPU has
    no bf16 products: ``F.linear``, said by ``--stats``."""
    calls: list[tuple[torch.dtype, bool]] = []
    linear_calls: list[int] = []  # the bf16 products that went to F.linear instead: their inputs' dimensions
    f_linear, onednn = linear_maps.F.linear, torch.ops.mkldnn._linear_pointwise

    def spy_onednn(x: torch.Tensor, weight: torch.Tensor, *rest: object) -> torch.Tensor:
        calls.append((x.dtype, weight.is_mkldnn))
        return onednn(x, weight, *rest)

    def spy_linear(x: torch.Tensor, weight: torch.Tensor, *rest: object) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            linear_calls.append(x.dim())
        return f_linear(x, weight, *rest)

    gen = Generator(str(tiny_models(family)), dtype="bfloat16", max_new_tokens=8, min_new_tokens=8, num_beams=2)
    monkeypatch.setattr(linear_maps, "PACK_AFTER", 2)
    monkeypatch.setattr(linear_maps.torch.ops.mkldnn, "_linear_pointwise", spy_onednn)
    monkeypatch.setattr(linear_maps.F, "linear", spy_linear)
    outs = gen.generate(["one two three four", "five six"])
    assert len(outs) == 2 and all(isinstance(o[0], str) for o in outs)
    stats = backend_stats(gen.model_backend())
    if not BF16:
        assert stats["linear_maps"] == "bfloat16 F.linear" and linear_calls and not calls
        return
    # a decoder-only prompt's prefill is transformers' forward ([B, W, D] inputs: its nn.Linear, whose bf16 products
    # torch hands to oneDNN's matmul on the dense weight); every decode step's product ([N, D]) is the backend's
    assert set(linear_calls) <= ({3} if family == "llama" else set()), f"bf16 F.linear over {set(linear_calls)}-d inputs"
    assert stats["linear_maps"] == "bfloat16 oneDNN (weights packed once)"
    assert stats["cpu_isa"] == linear_maps.cpu_isa()
    assert calls and {dtype for dtype, _ in calls} == {torch.bfloat16}, "a bf16 product left oneDNN"
    packed = sum(p for _, p in calls)
    # 8 steps of every decoder map: the last 8 - PACK_AFTER of each run packed
    assert packed >= len(gen.model_backend().layers) * (8 - 2), (packed, len(calls))


def test_cpu_isa_names_the_matrix_units(monkeypatch) -> None:
    """``cpu_isa`` reads the CPU's flags: AMX before AVX-512 BF16 before torch's own name; the oneDNN cap is said."""
    isa = linear_maps.cpu_isa()
    assert isa in ("AMX", "AVX-512 BF16") or isa == torch.backends.cpu.get_cpu_capability()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert linear_maps.cpu_isa() == f"{isa} (ONEDNN_MAX_CPU_ISA=AVX2)"
    assert linear_maps.kernel(torch.float32, True).startswith("int8 ")


def test_bfloat16_agrees_with_float32_as_generate_in_bfloat16_does() -> None:
    """On the one real trained model (../shared/models/aren-transliteration), seqgen in bfloat16 gives float32
    ``generate()``'s outputs at least as often as ``generate()`` in bfloat16 does (the issue's bar: no noisier)."""
    shared = shared_dir()
    model = shared / "models" / "aren-transliteration" if shared else None
    if model is None or not model.is_dir():
        pytest.skip("../shared/models/aren-transliteration absent")
    letters = "ابتثجحخدذرزسشصضطظعغفقكلمنهوي"
    rng = random.Random(0)
    names = [" ".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(64)]
    settings = dict(num_beams=4, max_new_tokens=24)
    ref = Generator(str(model), backend="hf", dtype="float32", **settings).generate(names)
    hf16 = Generator(str(model), backend="hf", dtype="bfloat16", **settings).generate(names)
    ours = Generator(str(model), dtype="bfloat16", **settings).generate(names)
    same_hf = sum(a == b for a, b in zip(hf16, ref, strict=True))
    same_ours = sum(a == b for a, b in zip(ours, ref, strict=True))
    print(f"\nbf16 outputs equal to float32 generate(): seqgen {same_ours}/64, generate() {same_hf}/64")
    assert same_ours >= same_hf


def test_bfloat16_on_a_cpu_without_bf16_products_says_it_is_slow(tiny_models, tmp_path, monkeypatch) -> None:
    """Without bf16 products (an AVX2-only CPU: oneDNN's cap, or no AVX-512) ``--dtype bfloat16`` runs several
    times float32's time: the run says so once; with them, or in float32, nothing is said."""
    from tests.helpers import seqgen, write_lines

    src = write_lines(tmp_path / "in.txt", ["one two three", "four five"])
    args = ["generate", "-m", str(tiny_models("bart")), str(src), "--max-new-tokens", "4"]
    has_bf16 = torch.bfloat16 in linear_maps.ONEDNN_DTYPES  # this CPU's (an AVX2-only one has none)
    monkeypatch.setattr(linear_maps, "ONEDNN_DTYPES", (torch.float32,))
    res = seqgen(*args, "--dtype", "bfloat16", "-o", str(tmp_path / "a.txt"))
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("has no bfloat16 products: --dtype bfloat16 runs several times slower") == 1
    res = seqgen(*args, "--dtype", "float32", "-o", str(tmp_path / "b.txt"))
    assert "bfloat16 products" not in res.stderr
    if has_bf16:  # oneDNN makes no bf16 product on a CPU without them: the "with them" half needs such a CPU
        monkeypatch.setattr(linear_maps, "ONEDNN_DTYPES", (torch.float32, torch.bfloat16))
        res = seqgen(*args, "--dtype", "bfloat16", "-o", str(tmp_path / "c.txt"))
        assert res.exit_code == 0 and "bfloat16 products" not in res.stderr


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_bfloat16_caches_hold_keys_and_values_in_float32_on_the_cpu(tiny_models, family: str) -> None:
    """The CPU attends bfloat16 in float32 (``attention.kv_dtype``): the caches hold every key and value in float32
    (the fixed region's and the generated ones, written once), so no step widens the cache, and attention's output
    goes back to the layers in bfloat16; the bytes the batcher counts are those held. The bits are the bf16
    values' (exact in float32)."""
    gen = Generator(str(tiny_models(family)), dtype="bfloat16", max_new_tokens=6, num_beams=2)
    backend = gen.model_backend()
    ids = [e.ids for e in gen.encode(["one two three four", "five six"])]
    state, _ = backend.start(gen.pad(ids), rows_per_input=2, max_new_tokens=6)
    cache = state.cache
    outputs: list[torch.dtype] = []

    def recorded(fn):  # attention's output dtype, as the layers get it
        return lambda *a, **k: outputs.append((out := fn(*a, **k)).dtype) or out

    with (
        mock.patch.object(layers, "attention", recorded(layers.attention)),
        mock.patch.object(layers, "attend_blocks", recorded(layers.attend_blocks)),
    ):
        for _ in range(3):
            backend.step(state, torch.ones(4, dtype=torch.long))
    assert outputs and set(outputs) == {torch.bfloat16}
    held = cache.fixed.keys + cache.generated.keys + cache.fixed.values + cache.generated.values
    assert {x.dtype for x in held} == {torch.float32}
    for part in (cache.generated.keys[0], cache.generated.values[0]):
        written = part.select(-2 if family == "llama" and part is cache.generated.keys[0] else 2, 0)  # position 0
        assert torch.equal(written, written.bfloat16().float())  # bf16 values, held in float32
    width = gen.pad(ids).input_ids.shape[1]
    counted = backend.cache_bytes(2, width, 2, 6)
    assert counted == sum(backend.cache_nbytes(state).values())
