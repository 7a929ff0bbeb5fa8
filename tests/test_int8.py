"""``--dtype int8`` on the CPU (dynamic int8 quantization): the BART-family int8 backend, the generic fallback,
``generate()`` over the quantized model, the CUDA error, and ``seqgen bench --dtype int8``.

int8 is not exact: agreement with float32 is computed and printed (``-s`` / ``record_property``), never
required. No timing assertions (speed lives in docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import Generator
from seqgen_cli.models.bart import BartBackend
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
    assert all(isinstance(t, str) for t in gen.decode(out))
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
    assert isinstance(backend, BartBackend) and backend.int8
    assert gen.device_stats()["dtype"] == "int8" and gen.loaded.device.type == "cpu"
    assert is_quantized(backend.lm)  # LM head (final_logits_bias folded into its bias)
    lay = backend.dec_layers[0]
    assert all(is_quantized(f) for f in (lay.qkv, lay.o, lay.cq, lay.ckv, lay.co, lay.fc1, lay.fc2))
    encoder = gen.model.get_encoder()
    assert _linears(encoder) == (0, 6 * len(encoder.layers))  # q, k, v, out, fc1, fc2: quantized in place
    _agreement(family, _check_valid(gen, texts), fp32, record_property)


def test_int8_step_runs_quantized_kernels() -> None:
    """The int8 decoder step calls ``quantized::linear_dynamic`` for every linear map and the LM head; the
    float32 one never does; int8 logits stay close to float32's (a wrong scale, bias or weight would not).

    A BART with realistic initialisation (std 0.02): the tiny fixtures' std 1.0 makes attention nearly
    one-hot, where any rounding flips it."""
    import copy

    from transformers import BartConfig, BartForConditionalGeneration

    from seqgen_cli.search.protocol import Batch

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
        ("float32", BartBackend(model)),
        ("int8", BartBackend(copy.deepcopy(model), int8=True)),
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


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_generic_fallback_int8(tiny_models, texts: list[str], family: str, record_property) -> None:
    path = str(tiny_models(family))
    fp32 = _check_valid(Generator(path, dtype="float32", backend="fast", **SETTINGS), texts)
    gen = Generator(path, dtype="int8", backend="fast", **SETTINGS)
    assert isinstance(gen._model_backend, GenericBackend)
    floats, quantized = _linears(gen.model)
    assert floats == 0 and quantized > 0 and is_quantized(gen.model.get_output_embeddings())
    _agreement(family, _check_valid(gen, texts), fp32, record_property)


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
    from seqgen_cli.bench import BenchSettings, run_bench

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
    # [N, D]: two calls on the dense weight, then packed, any N, a single row as two; [B, S, D]: F.linear (MKL)
    assert calls == [("onednn", 3), ("mkl", 0), ("onednn", 2000), ("packed", 2), ("mkl", 0)]
    assert lin.packed is not None and lin.packed.is_mkldnn
    assert linear(w.double(), b.double())(torch.randn(2, 16, dtype=torch.float64)).dtype == torch.float64
