"""``--dtype int8`` on the CPU (dynamic int8 quantization): the BART-family int8 backend, the generic fallback,
``generate()`` over the quantized model, the CUDA error, and ``seqgen bench --dtype int8``.

int8 is not exact: agreement with float32 is computed and printed (``-s`` / ``record_property``), never
required. No timing assertions (speed lives in docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import Generator
from seqgen_cli.models import DecoderOnlyBackend, EncoderDecoderBackend, fast_backend, linear_maps
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.models.linear_maps import is_quantized, linear
from tests.helpers import seqgen
from tests.tiny_models import sample_texts

N_NEW = 6
SETTINGS = {"num_beams": 3, "max_new_tokens": N_NEW, "min_new_tokens": N_NEW, "no_repeat_ngram_size": 2}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return sample_texts(6)


class _Ops(TorchDispatchMode):
    """Records the name of every op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _linears(module: nn.Module) -> tuple[int, int]:
    """(float ``nn.Linear`` count, dynamic-quantized linear count) inside ``module``."""
    mods = list(module.modules())
    return sum(type(m) is nn.Linear for m in mods), sum(is_quantized(m) for m in mods)


def _check_valid(gen: Generator, texts: list[str]) -> list[list[int]]:
    """One batch through ``generate_ids``: every output exactly N_NEW in-vocabulary ids; texts decode."""
    ids = [e.ids for e in gen.encode(texts)]
    out = [seqs[0] for seqs in gen.generate_ids(ids)]
    vocab = gen.model.config.get_text_config(decoder=True).vocab_size
    for seq in out:
        assert len(seq) == N_NEW and all(0 <= t < vocab for t in seq)
    assert all(isinstance(t, str) for t in gen.detokenise(out))
    return out


def _agreement(name: str, int8: list[list[int]], fp32: list[list[int]], record_property) -> float:
    rate = 100.0 * sum(a == b for a, b in zip(int8, fp32, strict=True)) / len(fp32)
    print(f"\n{name}: int8 outputs token-identical to float32: {rate:.0f} % of {len(fp32)}")
    record_property(f"agreement_{name}", rate)
    return rate


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_bart_family_int8_backend(tiny_models, texts: list[str], family: str, record_property) -> None:
    path = str(tiny_models(family))
    fp32 = _check_valid(Generator(path, dtype="float32", backend="fast", **SETTINGS), texts)
    gen = Generator(path, dtype="int8", backend="fast", **SETTINGS)
    backend = gen._model_backend
    assert isinstance(backend, EncoderDecoderBackend) and backend.int8
    assert gen.device_stats()["dtype"] == "int8" and gen.loaded.device.type == "cpu"
    assert is_quantized(backend.lm)  # LM head (final_logits_bias folded into its bias)
    lay = backend.layers[0]
    assert sorted(lay.maps) == ["ckv", "co", "cq", "fc1", "fc2", "o", "qkv"]
    assert all(is_quantized(f) for f in lay.maps.values())
    encoder = gen.model.get_encoder()
    assert _linears(encoder) == (0, 6 * len(encoder.layers))  # q, k, v, out, fc1, fc2: quantized in place
    _agreement(family, _check_valid(gen, texts), fp32, record_property)


VNNI = {"avx512_vnni", "avx_vnni", "amx_int8"}  # oneDNN's int8 engine assumes 8-bit products without saturation


@pytest.fixture
def int8_engine():
    """Sets torch's quantized engine for one test (``linear_maps.use_int8_engine``) and puts the old one back."""
    old = torch.backends.quantized.engine
    yield linear_maps.use_int8_engine
    torch.backends.quantized.engine = old


def test_int8_engine_follows_the_cpus_int8_tiles(int8_engine) -> None:
    """oneDNN's quantized engine where the CPU has AMX's int8 tiles, fbgemm's (torch's ``x86``) everywhere else, and
    ``--stats`` names the one in use with the reason."""
    onednn = "onednn" in torch.backends.quantized.supported_engines
    assert linear_maps.int8_engine(set()) == "x86"
    assert linear_maps.int8_engine({"avx2", "avx512_vnni", "avx512_bf16"}) == "x86"
    assert linear_maps.int8_engine({"amx_int8", "amx_bf16", "avx512_vnni"}) == ("onednn" if onednn else "x86")
    here = linear_maps.int8_engine()
    assert here == ("onednn" if onednn and "amx_int8" in linear_maps.cpu_flags() else "x86")
    assert int8_engine() == here == torch.backends.quantized.engine
    assert linear_maps.kernel(torch.float32, True).startswith(
        "int8 oneDNN (AMX int8 tiles;" if here == "onednn" else "int8 fbgemm (no AMX int8 tiles;"
    )


@pytest.mark.parametrize("engine", ["x86", "onednn"])
def test_int8_step_runs_quantized_kernels(engine: str, int8_engine) -> None:
    """The int8 decoder step calls ``quantized::linear_dynamic`` for every linear map and the LM head, on either
    engine ``int8_engine`` picks; the float32 one never does; int8 logits stay close to float32's (a wrong scale,
    bias or weight would not).

    A BART with realistic initialisation (std 0.02): the tiny fixtures' std 1.0 makes attention nearly
    one-hot, where any rounding flips it."""
    import copy

    from transformers import BartConfig, BartForConditionalGeneration

    from seqgen_cli.search.protocol import Batch

    if engine not in torch.backends.quantized.supported_engines or (engine == "onednn" and not VNNI & linear_maps.cpu_flags()):
        pytest.skip(f"torch's {engine} engine cannot run int8 here")
    int8_engine(engine)
    torch.manual_seed(0)
    cfg = BartConfig(
        vocab_size=200, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
    )  # fmt: skip
    model = BartForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_()  # folded into the int8 head's bias: must still be added
    input_ids = torch.randint(4, 200, (2, 12))
    mask = torch.ones_like(input_ids)
    counts, logits_of = {}, {}
    for dtype, backend in (
        ("float32", fast_backend(model)),
        ("int8", fast_backend(copy.deepcopy(model), int8=True)),
    ):
        state, _ = backend.start(Batch(input_ids, mask), 1, 2)
        with _Ops() as ops:
            logits = backend.step(state, torch.full((2,), cfg.decoder_start_token_id))
        assert logits.shape == (2, 200) and logits.dtype == torch.float32
        counts[dtype] = ops.names.count("quantized.linear_dynamic")
        logits_of[dtype] = logits
    assert counts == {"float32": 0, "int8": 6 * 2 + 1}  # qkv, o, cq, co, fc1, fc2 per layer + LM head
    similarity = torch.cosine_similarity(logits_of["int8"], logits_of["float32"], dim=-1)
    print(f"\nfirst-step logits, int8 vs float32: cosine similarity {similarity.min().item():.5f}")
    assert similarity.min() > 0.99


# the fast families beside the BART family: (shared decoder, a layer's linear maps, all int8)
INT8_FAMILIES = {
    "t5": (EncoderDecoderBackend, ("ckv", "co", "cq", "o", "qkv", "wi", "wo")),
    "gpt2": (DecoderOnlyBackend, ("c_attn", "c_fc", "c_proj", "mlp_proj")),
    "llama": (DecoderOnlyBackend, ("down", "gate", "k", "o", "q", "up", "v")),
}


@pytest.mark.parametrize("family", list(INT8_FAMILIES))
def test_fast_int8_backend(tiny_models, texts: list[str], family: str, record_property) -> None:
    """Every fast backend has its int8 variant: each layer's maps and the LM head int8 copies; an encoder is
    quantized in place (T5), a decoder-only prefill stays the model's own float32 forward."""
    cls, names = INT8_FAMILIES[family]
    path = str(tiny_models(family))
    fp32 = _check_valid(Generator(path, dtype="float32", backend="fast", **SETTINGS), texts)
    gen = Generator(path, dtype="int8", backend="fast", **SETTINGS)
    backend = gen._model_backend
    assert isinstance(backend, cls) and backend.int8 and is_quantized(backend.lm)
    for layer in _layers(backend):
        assert tuple(sorted(layer.maps)) == names and all(is_quantized(m) for m in layer.maps.values())
    if gen.is_encoder_decoder:
        floats, quantized = _linears(gen.model.get_encoder())
        assert floats == 0 and quantized > 0
    _agreement(family, _check_valid(gen, texts), fp32, record_property)


def test_generic_int8_quantizes_the_model_in_place(tiny_models) -> None:
    """A model without a fast backend (here: asked for the generic one) runs int8 over its own modules, every
    linear layer quantized in place."""
    from seqgen_cli.loading import load
    from seqgen_cli.models import get_backend

    model = load(str(tiny_models("llama")), device="cpu", dtype="float32").model
    backend = get_backend(model, generic=True, int8=True)
    assert isinstance(backend, GenericBackend)
    floats, quantized = _linears(model)
    assert floats == 0 and quantized > 0 and is_quantized(model.get_output_embeddings())


def test_hf_backend_int8_runs_generate_over_the_quantized_model(tiny_models, texts: list[str]) -> None:
    gen = Generator(str(tiny_models("bart")), dtype="int8", backend="hf", **SETTINGS)
    assert gen.backend == "hf" and gen._model_backend is None
    assert _linears(gen.model)[0] == 0
    _check_valid(gen, texts)


def test_float32_linear_is_f_linear_up_to_rounding() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    x = torch.randn(5, 16)
    assert torch.allclose(linear(lin.weight, lin.bias)(x), lin(x), rtol=1e-5, atol=1e-6)
    q = linear(lin.weight, lin.bias, int8=True)
    assert is_quantized(q) and q.weight().qscheme() == torch.per_channel_affine  # one scale per output row
    assert torch.allclose(q(x), lin(x), atol=0.1) and not torch.equal(q(x), lin(x))


def test_int8_linear_is_torchs_from_float() -> None:
    """``linear(..., int8=True)`` and ``quantize_linears`` build what torch's ``from_float`` builds (same int8
    values, scales, bias, repr and outputs), without its extra ``nn.Linear`` and all-zero packing."""
    import warnings

    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    from seqgen_cli.models.linear_maps import quantize_linears

    torch.manual_seed(0)
    for out_f, in_f, bias in [(48, 32, True), (40, 16, False)]:
        lin = nn.Linear(in_f, out_f, bias=bias)
        lin.qconfig = per_channel_dynamic_qconfig
        with warnings.catch_warnings():  # torch's deprecation of torch.ao.quantization
            warnings.simplefilter("ignore")
            ref = DynamicLinear.from_float(lin)
        new = linear(lin.weight, lin.bias, int8=True)
        quantized_in_place = quantize_linears(nn.Sequential(lin))[0]
        x = torch.randn(5, in_f) * 3
        for q in (new, quantized_in_place):
            assert repr(q) == repr(ref) and torch.equal(q(x), ref(x))
            assert torch.equal(q.weight().int_repr(), ref.weight().int_repr())
            assert torch.equal(q.weight().q_per_channel_scales(), ref.weight().q_per_channel_scales())


def test_int8_on_cuda_is_a_one_line_error(tiny_models, tmp_path: Path) -> None:
    from seqgen_cli.loading import resolve_dtype

    with pytest.raises(SeqgenError, match="CPU only"):
        resolve_dtype("int8", torch.device("cuda"))
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    result = seqgen(
        "generate", "-m", str(tiny_models("bart")), str(src), "--dtype", "int8", "--device", "cuda"
    )
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "int8" in lines[0] and "CPU only" in lines[0], result.output


def test_cli_generate_int8(tiny_models, tmp_path: Path) -> None:
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(sample_texts(3)) + "\n")
    args = ["generate", "-m", str(tiny_models("marian")), str(src), "-o", str(out), "--dtype", "int8", "-q"]
    result = seqgen(*args, "--num-beams", "2", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 3


def test_bench_int8_with_ct2(tiny_models, texts: list[str], tmp_path: Path) -> None:
    """``seqgen bench --dtype int8 --compare hf,ct2``: seqgen int8, CTranslate2 int8, float32 generate() as the
    reference; agreement and BLEU against it per system."""
    pytest.importorskip("ctranslate2")
    from seqgen_cli.bench.run import run_bench
    from seqgen_cli.bench.settings import BenchSettings

    out = tmp_path / "bench"
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(texts) + "\n")
    s = BenchSettings(
        model=str(tiny_models("bart")), input=str(inp), n=4, batch_sizes=[2], num_beams=[2],
        compare=["hf", "ct2"], repeats=1, warmup=False, fixed_new_tokens=16, dtype="int8",
        out=str(out), ct2_cache=str(tmp_path / "ct2"), generation={"no_repeat_ngram_size": 2},
    )  # fmt: skip
    report = run_bench(s, log=lambda _: None)
    data = json.loads((out / "bench.json").read_text())
    assert data["dtype"] == "int8" and "ct2_skipped" not in data
    runs = {r["system"]: r for r in data["runs"]}
    assert set(runs) == {"seqgen", "hf", "ct2"}
    assert runs["hf"]["backend"] == "transformers float32" and runs["hf"]["bleu_vs_hf"] == 100.0
    assert runs["ct2"]["backend"].endswith("int8") and runs["seqgen"]["backend"] == "fast int8"
    for name in ("seqgen", "ct2"):
        r = runs[name]
        assert r["generated_tokens"] == 4 * 16  # enough words for 4-grams: BLEU of hf against itself is 100
        assert 0.0 <= r["agreement_vs_hf"] <= 100.0 and 0.0 <= r["bleu_vs_hf"] <= 100.0
        print(
            f"\nbench int8 {name}: same as float32 {r['agreement_vs_hf']:.0f} %, BLEU {r['bleu_vs_hf']:.1f}"
        )
    assert "| ct2 | ctranslate2" in report["table"] and "BLEU vs hf" in report["table"]
    assert "float32 generate()" in report["table"]  # the note under the table


def test_packed_linear_runs_onednn_for_any_row_count_and_packs_late(monkeypatch) -> None:
    from seqgen_cli.models import linear_maps

    if not linear_maps.ONEDNN:
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)
    w, b = torch.randn(40, 16), torch.randn(40)
    lin = linear(w, b)
    assert isinstance(lin, linear_maps.PackedLinear) and lin.packed is None  # nothing packed at build time
    calls: list[tuple[str, int]] = []
    onednn, f_linear = torch.ops.mkldnn._linear_pointwise, linear_maps.F.linear

    def spy_onednn(x: torch.Tensor, weight: torch.Tensor, *rest: object) -> torch.Tensor:
        calls.append(("packed" if weight.is_mkldnn else "onednn", x.numel() // x.shape[-1]))
        return onednn(x, weight, *rest)

    monkeypatch.setattr(linear_maps, "PACK_AFTER", 2)
    monkeypatch.setattr(linear_maps.torch.ops.mkldnn, "_linear_pointwise", spy_onednn)
    monkeypatch.setattr(linear_maps.F, "linear", lambda *a: calls.append(("mkl", 0)) or f_linear(*a))
    for shape in [(3, 16), (2, 4, 16), (2000, 16), (1, 16), (1, 1, 16)]:
        x = torch.randn(*shape)
        out = lin(x)
        assert out.shape == (*shape[:-1], 40)
        assert torch.allclose(out, x @ w.T + b, rtol=1e-5, atol=1e-5)
    # two calls on the dense weight, then packed, any N, a single row as two; [B, S, D] as one [B * S, D] product
    assert calls == [("onednn", 3), ("onednn", 8), ("packed", 2000), ("packed", 2), ("packed", 2)]
    assert lin.packed is not None and lin.packed.is_mkldnn
    assert linear(w.double(), b.double())(torch.randn(2, 16, dtype=torch.float64)).dtype == torch.float64


# -- the disk cache of quantized weights (seqgen_cli/models/int8_cache.py) --------------------------------------


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test of this file caches int8 weights in a folder of its own, never in the user's cache."""
    folder = tmp_path / "seqgen-cache"
    monkeypatch.setenv("SEQGEN_CACHE", str(folder))
    return folder


@pytest.fixture
def quantize_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the weights ``linear_maps.quantize_weight`` quantizes (the cache's misses), in order."""
    from seqgen_cli.models import linear_maps

    calls: list[tuple[int, ...]] = []
    quantize = linear_maps.quantize_weight

    def counting(weight: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(weight.shape))
        return quantize(weight)

    monkeypatch.setattr(linear_maps, "quantize_weight", counting)
    return calls


def _cached_generator(path: Path, backend: str = "fast") -> Generator:
    """An int8 :class:`Generator` built inside a cache session for ``path``."""
    from seqgen_cli.models import int8_cache

    with int8_cache.session(str(path)):
        return Generator(str(path), dtype="int8", backend=backend, **SETTINGS)


def _layers(backend: Any) -> list[Any]:
    """A fast backend's per-layer maps: ``layers``."""
    return backend.layers


def _int8_weights(gen: Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(int8 values, scales, bias) of every quantized map of the generator: model modules, then the fast
    backend's own maps."""
    maps = [m for m in gen.model.modules() if is_quantized(m)]
    backend = gen._model_backend
    if backend is not None and not isinstance(backend, GenericBackend):  # a fast backend's own maps: per layer (block), then the head
        maps += [backend.lm] + [m for lay in _layers(backend) for m in lay.maps.values()]
    out = []
    for m in maps:
        w = m.weight()
        out.append((w.int_repr(), w.q_per_channel_scales(), m.bias()))
    return out


def _same_weights(a: Generator, b: Generator) -> bool:
    wa, wb = _int8_weights(a), _int8_weights(b)
    return len(wa) == len(wb) > 0 and all(
        torch.equal(x[0], y[0])
        and torch.equal(x[1], y[1])
        and ((x[2] is None and y[2] is None) or torch.equal(x[2], y[2]))
        for x, y in zip(wa, wb, strict=True)
    )


def _cache_files(folder: Path) -> list[Path]:
    return sorted((folder / "int8").glob("*.safetensors")) if (folder / "int8").is_dir() else []


@pytest.mark.parametrize(
    ("family", "backend"),
    [("bart", "fast"), ("marian", "fast"), ("t5", "fast"), ("gpt2", "fast"), ("bart", "hf")],
)
def test_int8_cache_second_build_loads_from_disk(
    tiny_models, texts: list[str], _cache_in_tmp: Path, quantize_calls: list, family: str, backend: str
) -> None:
    """The first build quantizes and writes one file; the second quantizes nothing and gets the very same int8
    weights, scales, biases and outputs (as a build without any cache session)."""
    from seqgen_cli.models import int8_cache

    path = tiny_models(family)
    with pytest.MonkeyPatch.context() as mp:  # the reference: no readable cache, nothing written
        mp.setattr(int8_cache, "cache_dir", lambda: Path(os.devnull) / "no-cache")
        plain = Generator(str(path), dtype="int8", backend=backend, **SETTINGS)
    reference = _check_valid(plain, texts)
    quantize_calls.clear()
    first = _cached_generator(path, backend)
    n_quantized = len(quantize_calls)
    assert n_quantized > 0 and len(_cache_files(_cache_in_tmp)) == 1
    second = _cached_generator(path, backend)
    assert len(quantize_calls) == n_quantized  # nothing quantized again: every weight from the file
    assert _same_weights(first, second) and _same_weights(plain, second)
    assert _check_valid(first, texts) == _check_valid(second, texts) == reference


def test_int8_cache_one_file_serves_fast_and_hf(
    tiny_models, _cache_in_tmp: Path, quantize_calls: list
) -> None:
    """``--backend hf`` quantizes the whole model (q, k, v apart, the plain LM head): it finds the fast
    backend's encoder and shared weights, adds its own to the same file, and the fast build still loads all."""
    path = tiny_models("bart")
    _cached_generator(path, "fast")
    fast_calls = len(quantize_calls)
    _cached_generator(path, "hf")
    hf_calls = len(quantize_calls) - fast_calls
    assert 0 < hf_calls < fast_calls + 4 * 2  # only the decoder's separate q/k/v (and such) are new
    _cached_generator(path, "fast")
    _cached_generator(path, "hf")
    assert len(quantize_calls) == fast_calls + hf_calls and len(_cache_files(_cache_in_tmp)) == 1


def _damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        file.write_bytes(bytes(range(256)) * 40)
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "flipped byte":  # a valid file whose last tensor's bytes changed: its entry's CRC fails
        file.write_bytes(data[:-1] + bytes([data[-1] ^ 0x55]))
    elif how == "other key":  # a valid file that says it is for another checkpoint
        from safetensors import safe_open
        from safetensors.torch import save_file

        from seqgen_cli.models.int8_cache import META

        with safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
            info = json.loads(f.metadata()[META])
        info["key"]["checkpoint"]["config"] = "0" * 64
        save_file(tensors, str(file), metadata={META: json.dumps(info)})
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "flipped byte", "other key"])
def test_int8_cache_damaged_file_is_rebuilt(
    tiny_models, texts: list[str], _cache_in_tmp: Path, quantize_calls: list, how: str
) -> None:
    path = tiny_models("marian")
    first = _cached_generator(path)
    n_quantized = len(quantize_calls)
    (file,) = _cache_files(_cache_in_tmp)
    _damage(file, how)
    rebuilt = _cached_generator(path)  # no error, whatever the file holds
    again = len(quantize_calls) - n_quantized
    assert again == (1 if how == "flipped byte" else n_quantized)  # the damaged entry, or all of them
    assert _same_weights(first, rebuilt)
    assert _check_valid(first, texts) == _check_valid(rebuilt, texts)
    assert _cache_files(_cache_in_tmp) == [file] and not list(file.parent.glob(".*.tmp"))
    _cached_generator(path)  # the file was rewritten whole: nothing quantized now
    assert len(quantize_calls) == n_quantized + again


def _copy_checkpoint(src: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(src, dest)
    return dest


def test_int8_cache_changed_checkpoint_gets_a_new_entry(
    tiny_models, texts: list[str], tmp_path: Path, _cache_in_tmp: Path, quantize_calls: list
) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(tiny_models("bart"), tmp_path / "bart")
    _cached_generator(path)
    n_quantized = len(quantize_calls)
    # the config changes: another key, another file; everything quantized again
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "seqgen_test_note": "changed"}, indent=2))
    _cached_generator(path)
    assert len(quantize_calls) == 2 * n_quantized and len(_cache_files(_cache_in_tmp)) == 2
    # the weights change (one decoder feed-forward matrix), and so the file's time: a third file
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("decoder.layers.0.fc1.weight"))
    tensors[name] = tensors[name] * 0.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = _cached_generator(path)
    assert len(quantize_calls) == 3 * n_quantized and len(_cache_files(_cache_in_tmp)) == 3
    # they change again, keeping the file's name, size and time: the same key, but no stale weight is used,
    # only the changed matrix is quantized again
    tensors[name] = tensors[name] * 3.0
    stat = weights.stat()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    rechanged = _cached_generator(path)
    assert quantize_calls[3 * n_quantized :] == [tuple(tensors[name].shape)]
    assert len(_cache_files(_cache_in_tmp)) == 3
    plain = Generator(str(path), dtype="int8", backend="fast", **SETTINGS)  # no session: quantizes
    assert _same_weights(plain, rechanged) and not _same_weights(changed, rechanged)
    assert _check_valid(plain, texts) == _check_valid(rechanged, texts)


def test_int8_cache_unwritable_folder_still_runs(
    tiny_models,
    texts: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantize_calls: list,
    caplog,
) -> None:
    """A cache folder that cannot be created (below a file: refused even to root): the run quantizes, as
    without the cache, and says nothing above debug level."""
    import logging

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SEQGEN_CACHE", str(blocker / "cache"))
    path = tiny_models("marian")
    with caplog.at_level(logging.DEBUG, logger="seqgen_cli.models.int8_cache"):
        first = _cached_generator(path)
        n_quantized = len(quantize_calls)
        second = _cached_generator(path)
    assert n_quantized > 0 and len(quantize_calls) == 2 * n_quantized
    assert _same_weights(first, second) and _check_valid(first, texts) == _check_valid(second, texts)
    assert all(r.levelno <= logging.DEBUG for r in caplog.records) and len(caplog.records) <= 1


def test_int8_cache_folder_and_key(tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from seqgen_cli.models import int8_cache

    monkeypatch.setenv("SEQGEN_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert int8_cache.cache_dir() == tmp_path / "a"
    monkeypatch.setenv("SEQGEN_CACHE", "")
    assert int8_cache.cache_dir() == tmp_path / "xdg" / "seqgen"
    monkeypatch.delenv("SEQGEN_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert int8_cache.cache_dir() == tmp_path / "home" / ".cache" / "seqgen"

    path = tiny_models("bart")
    checkpoint = int8_cache.checkpoint_key(path)
    assert checkpoint is not None and [f[0] for f in checkpoint["files"]] == ["model.safetensors"]
    key = int8_cache.cache_key(checkpoint)
    assert key["torch"] == torch.__version__ and key["cpu"] == torch.backends.cpu.get_cpu_capability()
    assert "qint8" in key["scheme"] and "per_channel" in key["scheme"]
    name = int8_cache.Session(tmp_path, key).path.name
    monkeypatch.setattr(torch, "__version__", "0.0.0-another")
    assert int8_cache.Session(tmp_path, int8_cache.cache_key(checkpoint)).path.name != name
    # no checkpoint folder (a model built in memory, a name that is no folder): no session, no cache
    with int8_cache.session(tmp_path / "missing") as s:
        assert s is None
    empty = tmp_path / "empty"
    empty.mkdir()
    with int8_cache.session(empty) as s:
        assert s is None


def test_int8_cache_concurrent_writers_leave_one_whole_file(tiny_models, _cache_in_tmp: Path) -> None:
    """Two sessions of one checkpoint writing at the same time: one whole file stays, readable, no temporary
    files left."""
    import threading

    from seqgen_cli.models import int8_cache
    from seqgen_cli.models.linear_maps import quantize_weight

    path = tiny_models("marian")
    torch.manual_seed(0)
    weights = [torch.randn(64, 32) for _ in range(8)]
    key = int8_cache.cache_key(int8_cache.checkpoint_key(path))
    sessions = [int8_cache.Session(_cache_in_tmp / "int8", key) for _ in range(4)]
    for s in sessions:
        for w in weights:
            s.quantized(w, quantize_weight)
    barrier = threading.Barrier(len(sessions))

    def save(s: int8_cache.Session) -> None:
        barrier.wait()
        s.save()

    threads = [threading.Thread(target=save, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (file,) = _cache_files(_cache_in_tmp)
    assert not list(file.parent.glob(".*.tmp"))
    with int8_cache.session(path) as s:
        for w in weights:
            assert torch.equal(s.quantized(w, quantize_weight).int_repr(), quantize_weight(w).int_repr())
    assert s.hits == len(weights) and s.misses == 0


def test_generator_uses_the_int8_cache_by_itself(
    tiny_models, _cache_in_tmp: Path, quantize_calls: list
) -> None:
    """Once ``Generator._quantize`` opens ``int8_cache.session(self.model)``, a plain int8 Generator caches."""
    path = str(tiny_models("bart"))
    Generator(path, dtype="int8", backend="fast", **SETTINGS)
    if not _cache_files(_cache_in_tmp):
        pytest.skip("Generator._quantize does not open an int8_cache.session (yet)")
    n_quantized = len(quantize_calls)
    Generator(path, dtype="int8", backend="fast", **SETTINGS)
    assert len(quantize_calls) == n_quantized


def _int8_cli(model: Path, src: Path, out: Path) -> str:
    """``seqgen generate --dtype int8`` in-process; returns what it printed (stdout and stderr)."""
    args = ["generate", "-m", str(model), str(src), "-o", str(out), "--dtype", "int8", "-q"]
    result = seqgen(*args, "--num-beams", "2", "--max-new-tokens", "6", "--min-new-tokens", "6")
    assert result.exit_code == 0, result.output
    return result.output


def _coarser(weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` quantized on twice its per-row steps: every value within half of its own (wider) step."""
    scales = scales * 2
    return torch.round(weight.double() / scales[:, None]).clamp(-128, 127).to(torch.int8), scales


@pytest.mark.parametrize("how", ["other weight", "values a step off", "coarser steps"])
def test_int8_cache_self_consistent_other_values_are_not_used(
    tiny_models,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    _cache_in_tmp: Path,
    quantize_calls: list,
    how: str,
) -> None:
    """A cache file rewritten with other int8 values (its CRC-32s recomputed, so it is self-consistent) is
    caught by the check against the float32 weights: every entry is quantized again, one warning line, the
    outputs are the fresh run's, and the file is rewritten (the next run is quiet and quantizes nothing)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from seqgen_cli.models import int8_cache
    from seqgen_cli.models.int8_cache import META, PARTS
    from seqgen_cli.models.linear_maps import quantize_weight

    model = tiny_models("marian")
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(sample_texts(4)) + "\n")
    weights: dict[str, torch.Tensor] = {}  # entry name -> the float32 weight it quantizes
    entry_name = int8_cache.entry_name

    def naming(weight: torch.Tensor) -> str:
        name = entry_name(weight)
        weights.setdefault(name, weight.clone())
        return name

    monkeypatch.setattr(int8_cache, "entry_name", naming)
    assert "warning" not in _int8_cli(model, src, out)  # the fresh run writes the file
    fresh = out.read_text()
    n_quantized = len(quantize_calls)
    (file,) = _cache_files(_cache_in_tmp)
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        info = json.loads(f.metadata()[META])
    torch.manual_seed(0)
    for name in info["entries"]:
        values, scales, zero_points = (tensors[f"{name}.{p}"] for p in PARTS)
        w = weights[name]
        if how == "other weight":  # the quantization of another weight of that shape and spread
            other = quantize_weight(torch.randn_like(w) * w.std())
            values, scales = other.int_repr(), other.q_per_channel_scales()
        elif how == "values a step off":
            values = torch.where(values < 127, values + 1, values - 1)
        else:  # within half a step of the float32 weight everywhere, but of a step twice too wide
            values, scales = _coarser(w, scales)
        parts = (values.contiguous(), scales.contiguous(), zero_points)
        tensors.update({f"{name}.{p}": t for p, t in zip(PARTS, parts, strict=True)})
        info["entries"][name] = int8_cache._payload_crc(parts)
    save_file(tensors, str(file), metadata={META: json.dumps(info, sort_keys=True)})
    quantize_calls.clear()
    output = _int8_cli(model, src, out)
    assert out.read_text() == fresh
    assert len(quantize_calls) == n_quantized == len(info["entries"])  # every entry quantized again
    warnings = [line for line in output.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "int8" in warnings[0] and str(file) in warnings[0], output
    assert "warning" not in _int8_cli(model, src, out)  # the file was rewritten: quiet, nothing quantized
    assert len(quantize_calls) == n_quantized and out.read_text() == fresh


def test_int8_cache_check_tolerates_quantization_error_only() -> None:
    """The check passes torch's own quantization of wide, narrow, zero and single-column rows, and fails a
    single value two steps off among the sampled ones, or a row quantized on a twice wider step."""
    from seqgen_cli.models.int8_cache import _agrees, _parts, _sample
    from seqgen_cli.models.linear_maps import quantize_weight

    torch.manual_seed(0)
    for shape in [(300, 64), (7, 5), (40, 1), (3, 100)]:
        w = torch.randn(shape) * torch.logspace(-6, 3, shape[0])[:, None]
        w[1] = 0.0  # an all-zero row: its scale is the observer's floor
        values, scales, zero_points = _parts(quantize_weight(w))
        assert _agrees(w, values, scales, zero_points)
        sampled = _sample(np.arange(w.numel()).reshape(shape))  # [rows, k] flat indices: each row's own run
        assert sampled.shape[0] == shape[0] and (sampled // shape[1] == np.arange(shape[0])[:, None]).all()
        assert (np.diff(sampled, axis=1) == 1).all()
        if shape == (300, 64):  # the run moves along the row from one row to the next: all columns seen
            assert set((sampled[:4] % 64).ravel()) == set(range(64))
        off = values.clone().view(-1)
        i = int(sampled[2, -1])
        off[i] = off[i] + 2 if off[i] < 126 else off[i] - 2
        assert not _agrees(w, off.view(shape), scales, zero_points)
        assert not _agrees(w, *_coarser(w, scales), zero_points)


def _temp_files(folder: Path) -> set[str]:
    return {p.name for p in (folder / "int8").iterdir() if p.name.startswith(".") and "tmp" in p.name}


def test_int8_cache_dead_writers_temp_files_are_removed_live_ones_kept(
    tiny_models, tmp_path: Path, _cache_in_tmp: Path
) -> None:
    """A writer stopped while it writes the cache (in another process): a run beside it leaves its temporary
    files; once it is SIGKILLed, the next run removes them."""
    import signal
    import subprocess
    import sys

    model = tiny_models("marian")
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(sample_texts(2)) + "\n")
    writer = (
        "import sys, time, torch, safetensors.torch as st\n"
        "from pathlib import Path\n"
        "from seqgen_cli.models import int8_cache\n"
        "from seqgen_cli.models.linear_maps import quantize_weight\n"
        "def stuck(tensors, filename, metadata=None):\n"  # as safetensors' own writer, half-way
        "    (Path(filename).parent / '.tmpAb3xYz').write_bytes(b'partial')\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(600)\n"
        "st.save_file = stuck\n"
        "with int8_cache.session(sys.argv[1]) as s:\n"
        "    s.quantized(torch.randn(8, 8), quantize_weight)\n"
    )
    env = {**os.environ, "SEQGEN_CACHE": str(_cache_in_tmp)}
    proc = subprocess.Popen(
        [sys.executable, "-c", writer, str(model)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
        temps = _temp_files(_cache_in_tmp)
        assert len(temps) == 2  # its own temporary file (empty yet) and safetensors' half-written one
        _int8_cli(model, src, out)  # a run beside the live writer
        assert _temp_files(_cache_in_tmp) == temps
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _temp_files(_cache_in_tmp) == temps  # nothing removes them on its own
    _int8_cli(model, src, out)
    assert _temp_files(_cache_in_tmp) == set() and len(_cache_files(_cache_in_tmp)) == 1


def test_a_long_int8_weight_runs_in_blocks_with_the_same_bits(int8_engine) -> None:
    """Under fbgemm an int8 weight of more than ``BLOCK_BYTES`` (an LM head) is packed and run as blocks of
    ``block_rows`` rows: the very bits of one product (the input is quantized once per block with the same scale),
    its weight and bias whole as before (the int8 cache and the tests read them). oneDNN's engine runs it as one
    product."""
    from seqgen_cli.models.linear_maps import (
        BLOCK_BYTES,
        block_rows,
        dynamic_linear,
        int8_linear,
        quantize_weight,
    )

    int8_engine("x86")
    g = torch.Generator().manual_seed(0)
    cols = 64
    rows = BLOCK_BYTES // cols + 1000
    w, b = torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)
    blocked, whole = int8_linear(w, b), dynamic_linear(quantize_weight(w), b)
    assert is_quantized(blocked) and len(blocked.blocks) == -(-rows // block_rows(cols))
    for x in (torch.randn(1, cols, generator=g), torch.randn(7, cols, generator=g), torch.randn(2, 3, cols, generator=g)):
        assert torch.equal(blocked(x), whole(x))
    assert torch.equal(blocked.weight().int_repr(), whole.weight().int_repr()) and torch.equal(blocked.bias(), b)
    assert not hasattr(int8_linear(w[: BLOCK_BYTES // cols], None), "blocks")  # up to the limit: one product
    if "onednn" in torch.backends.quantized.supported_engines:
        int8_engine("onednn")
        one = int8_linear(w, b)
        assert not hasattr(one, "blocks") and torch.equal(one.weight().int_repr(), whole.weight().int_repr())


@pytest.fixture
def threads():
    """Sets torch's thread count for one test and puts the old one back."""
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def _prepack_spy(
    monkeypatch, packers: list[str], fail_rows: int | None = None, held: tuple[int, Any] | None = None
) -> None:
    """``quantized::linear_prepack`` recording the thread of every pack of a real weight (not DynamicLinear's 1 x 1
    placeholder) in ``packers``; a weight of ``fail_rows`` rows fails; a weight of ``held[0]`` rows waits up to a
    second for the event ``held[1]`` before it packs."""
    import threading

    prepack = torch.ops.quantized.linear_prepack

    def spy(weight, bias=None):  # noqa: ANN001, ANN202
        if weight.numel() > 1:
            packers.append(threading.current_thread().name)
        if weight.shape[0] == fail_rows:
            raise RuntimeError("cannot pack this one")
        if held is not None and weight.shape[0] == held[0]:
            held[1].wait(timeout=1.0)
        return prepack(weight, bias)

    monkeypatch.setattr(torch.ops.quantized, "linear_prepack", spy)


def test_int8_weights_are_packed_by_a_pool_of_threads_with_the_same_bits(int8_engine, threads, monkeypatch) -> None:
    """Inside ``packing_in_threads`` every int8 weight (blocks of a long one included) is packed by the pool's
    threads (torch's count), none by the caller, and all are packed when the block ends: each module
    gives the bits of the same weight packed one at a time. At one thread, and outside the block, a weight is packed
    where it is built. The warnings filters are as they were."""
    import threading
    import warnings
    from contextlib import nullcontext

    from seqgen_cli.models.linear_maps import BLOCK_BYTES, block_rows, int8_linear, packing_in_threads

    int8_engine("x86")
    packers: list[str] = []
    _prepack_spy(monkeypatch, packers)
    g = torch.Generator().manual_seed(0)
    cols = 64
    weights = [torch.randn(n, cols, generator=g) for n in (16, 48, 32, 40, BLOCK_BYTES // cols + 100)]
    biases = [torch.randn(w.shape[0], generator=g) for w in weights]
    filters = list(warnings.filters)
    threads(3)
    with packing_in_threads():
        pooled = [int8_linear(w, b) for w, b in zip(weights, biases, strict=True)]
    assert len(packers) == 4 + -(-weights[-1].shape[0] // block_rows(cols))
    assert {name.rsplit("_", 1)[0] for name in packers} == {"seqgen-int8-pack"} and len(set(packers)) <= 3
    assert warnings.filters == filters
    caller = threading.current_thread().name
    for n in (1, 3):
        packers.clear()
        threads(n)
        with packing_in_threads() if n == 1 else nullcontext():  # one thread, then no block
            alone = [int8_linear(w, b) for w, b in zip(weights, biases, strict=True)]
        assert packers and set(packers) == {caller}
    x = torch.randn(5, cols, generator=g)
    for p, a in zip(pooled, alone, strict=True):
        assert torch.equal(p(x), a(x))


def test_an_int8_packing_error_is_raised_at_the_blocks_end(int8_engine, threads, monkeypatch) -> None:
    """A weight the pool fails to pack raises its error when ``packing_in_threads`` ends (nothing half-packed is
    handed on); an error of the block itself wins."""
    from seqgen_cli.models.linear_maps import int8_linear, packing_in_threads

    int8_engine("x86")
    _prepack_spy(monkeypatch, [], fail_rows=7)
    threads(2)
    with pytest.raises(RuntimeError, match="cannot pack this one"), packing_in_threads():
        for rows in (8, 7, 9, 10, 11):
            int8_linear(torch.randn(rows, 16), None)
    with pytest.raises(ValueError, match="the block's own"), packing_in_threads():
        int8_linear(torch.randn(7, 16), None)
        raise ValueError("the block's own")


@pytest.mark.parametrize("fast", [True, False])
def test_to_int8_packs_in_threads_before_a_backend_reads_its_maps(
    tiny_models, int8_engine, threads, monkeypatch, fast: bool
) -> None:
    """``to_int8`` packs its weights in the pool, the fast backend's and the generic one's alike, and builds the
    generic backend only once every weight is packed: it reads the head's width (its ``vocab_size``), which an
    unpacked module does not have yet. The head's pack waits for the backend to be built (up to a second), so a
    backend built before the packs end would see it unpacked."""
    import threading

    from seqgen_cli import models
    from seqgen_cli.loading import load

    int8_engine()
    events: list[str] = []
    building = threading.Event()
    model = load(str(tiny_models("llama")), device="cpu", dtype="float32").model
    _prepack_spy(monkeypatch, events, held=(model.config.vocab_size, building))
    generic_init = GenericBackend.__init__

    def built(self, *a, **k):  # noqa: ANN001, ANN202
        building.set()
        events.append("generic backend built")
        generic_init(self, *a, **k)

    monkeypatch.setattr(GenericBackend, "__init__", built)
    if not fast:
        monkeypatch.setattr(models, "_fast_or_reason", lambda model, int8: (None, "asked for"))
    threads(2)
    backend = models.to_int8(model, fast=True)
    assert {e.rsplit("_", 1)[0] for e in events[:-1]} == {"seqgen-int8-pack"}
    if fast:
        assert isinstance(backend, DecoderOnlyBackend) and "generic backend built" not in events
    else:
        assert isinstance(backend, GenericBackend) and events[-1] == "generic backend built"
        assert backend.vocab_size == model.config.vocab_size
