"""The graph-capturable decode step: ``backend.decode`` with static shapes, and the capture
path (``models/capture.py``), exercised on the CPU.

* ``decode`` compiles with ``torch.compile(fullgraph=True)`` (no graph breaks), once per shape: a step number
  never reaches the graph (no recompiles across steps), and its logits equal the eager static step's through
  a reorder and a drop, and the dynamic (CPU) step's to float32 rounding;
* the engine through :class:`CapturedBackend` (static step, padded buckets, idle rows, compaction) is token-
  identical to ``generate()`` under the equivalence harness, with the step run as traced and compiled by the
  real inductor (CPU), and adds no host sync;
* inputs leaving copy only the positions written so far; an eager step (CUDA too) attends only those;
* the fallbacks: CPU, ``--no-capture``, the generic backend, a compile failure, too many shapes; the path in
  ``Generator.device_stats``, ``--stats`` and the closing line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.generator import Generator
from seqgen_cli.models import capture as capture_mod
from seqgen_cli.models import get_backend
from seqgen_cli.models.capture import CapturedBackend, capture
from seqgen_cli.models.kv_cache import EncoderDecoderKVCache
from seqgen_cli.models.lane_table import Decode, run_step
from seqgen_cli.pipeline.stats import Summary
from seqgen_cli.search import generate
from tests.equivalence import MASKED_SUM_RTOL, SETTINGS, check_equivalence
from tests.helpers import seqgen
from tests.host_sync import BEAM, recording
from tests.tiny_models import load, text_batch


def eager(decode: Decode) -> Decode:
    """A "compiler" that keeps ``decode`` as it is: the capture wrapper's logic without compiling."""
    return decode


def counting_compiler(graphs: list[Any]) -> Any:
    """A ``torch.compile`` backend that runs the traced graph as is and records every compilation."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    return backend


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bart", "llama", "t5", "gpt2"])
def test_decode_compiles_fullgraph_once_per_shape(tiny_models, family: str) -> None:
    loaded = load(tiny_models(family))
    backend = get_backend(loaded.model)
    assert hasattr(backend, "decode") and not type(backend).__name__.startswith("Generic")
    batch = text_batch(loaded, 3, seed=2)
    r, steps = 2, 6
    torch._dynamo.reset()
    graphs: list[Any] = []
    compiled = torch.compile(backend.decode, fullgraph=True, dynamic=False, backend=counting_compiler(graphs))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        eager_state, _ = backend.start(batch, r, steps)
        compiled_state, _ = backend.start(batch, r, steps)
        dynamic_state, _ = backend.start(batch, r, steps)
        eager_state.cache.make_static()
        compiled_state.cache.make_static()
        assert not dynamic_state.cache.static, "the CPU default is the dynamic step"
        n = 3 * r
        for t in range(steps):
            tokens = torch.randint(4, backend.vocab_size, (n,), generator=g)
            expected = run_step(backend.decode, eager_state, tokens)
            got = run_step(compiled, compiled_state, tokens)
            assert torch.equal(got, expected), f"step {t}: compiled != eager static step"
            torch.testing.assert_close(backend.step(dynamic_state, tokens), expected, rtol=1e-5, atol=1e-5)
            if t == 1:  # beams continue other beams of their input
                rows = torch.tensor([1, 1, 2, 3, 5, 4])
                for state in (eager_state, compiled_state, dynamic_state):
                    backend.reorder(state, rows)
            if t == 3:  # input 1 finishes: a new shape
                keep, rows = torch.tensor([0, 2]), torch.tensor([0, 1, 4, 5])
                for state in (eager_state, compiled_state, dynamic_state):
                    backend.keep(state, keep, rows)
                n = 2 * r
                assert len(graphs) == 1, (
                    "recompiled within one shape: a step-dependent value reached the graph"
                )
        with pytest.raises(ValueError, match=f"beyond the {steps} positions"):
            run_step(compiled, compiled_state, tokens)
    assert len(graphs) == 2, f"{len(graphs)} graphs for 2 shapes"


class NanWatch(TorchDispatchMode):
    """Records every op whose float output holds a NaN (allocations and views aside: they read nothing, and
    fresh memory is unset)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        reads = not func.is_view and func.overloadpacket not in (
            torch.ops.aten.empty,
            torch.ops.aten.new_empty,
        )
        for x in out if isinstance(out, tuple | list) else [out]:
            if reads and isinstance(x, torch.Tensor) and x.is_floating_point() and x.isnan().any():
                self.seen.append(f"{func} -> {tuple(x.shape)}")
        return out


def position_views(cache: Any) -> list[tuple[torch.Tensor, int]]:
    """The self-attention K/V tensors a step writes, each with its position dimension."""
    kv = cache.generated  # decoder-only keys [B, Hkv, d, T, R]; values, encoder-decoder keys [B, H, T, R, d]
    return [(x, kv.key_dim) for x in kv.keys] + [(x, kv.value_dim) for x in kv.values]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("family", ["bart", "t5", "gpt2", "llama"])
def test_leaving_copies_only_the_written_positions(tiny_models, family: str, static: bool) -> None:
    """Inputs leaving (``keep``, as compaction calls it) copy the positions written so far, never the unwritten ones
    (poisoned with NaN here: no op may see them); on the static path the new unwritten positions are zeros."""
    loaded = load(tiny_models(family))
    backend = get_backend(loaded.model)
    r, positions, steps = 2, 7, 3
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        state, _ = backend.start(text_batch(loaded, 3, seed=2), r, positions)
        if static:
            state.cache.make_static()
        for _ in range(steps):
            backend.step(state, torch.randint(4, backend.vocab_size, (3 * r,), generator=g))
        written = []
        for x, dim in position_views(state.cache):
            x.narrow(dim, steps, positions - steps).fill_(float("nan"))  # never read: not even when leaving
            written.append(x.narrow(dim, 0, steps)[[0, 2]])
        with NanWatch() as watch:
            backend.keep(state, torch.tensor([0, 2]), torch.tensor([0, 1, 4, 5]))
        assert not watch.seen, f"unwritten positions read when inputs left: {watch.seen[:4]}"
        for (x, dim), kept in zip(position_views(state.cache), written, strict=True):
            assert torch.equal(x.narrow(dim, 0, steps), kept)
            if static:
                unwritten = x.narrow(dim, steps, positions - steps)
                assert not unwritten.any(), "static: unwritten positions must be zeros"
        assert (
            backend.step(state, torch.randint(4, backend.vocab_size, (2 * r,), generator=g)).isfinite().all()
        )


def self_attention_cache(
    layers: int, inputs: int, r: int, heads: int, max_len: int, d: int, dtype: torch.dtype, device: torch.device
) -> EncoderDecoderKVCache:
    """An encoder-decoder cache over a one-column source (zeros) whose self-attention is what a test looks at."""
    keys = [torch.zeros(inputs, heads, d, 1, dtype=dtype, device=device) for _ in range(layers)]
    values = [torch.zeros(inputs, heads, 1, d, dtype=dtype, device=device) for _ in range(layers)]
    mask = torch.zeros(inputs, 1, 1, 1, device=device)
    return EncoderDecoderKVCache(keys, values, mask, r, max_len)


def test_eager_cuda_step_attends_the_written_span() -> None:
    """Only capture (``make_static``) attends all preallocated positions; an eager step, CUDA too, attends the
    ``t + 1`` written so far (fake CUDA tensors: no device needed)."""
    with FakeTensorMode():
        cache = self_attention_cache(2, 3, 2, 4, 7, 8, torch.float16, torch.device("cuda"))
        assert cache.generated.keys[0].device.type == "cuda" and not cache.static
        cache.check(2)
        assert cache.span == 3
        cache.make_static()
        cache.check(2)
        assert cache.span == 7


EQUIVALENCE = [
    (family, setting)
    for family in ("bart", "marian", "llama")
    for setting in ("greedy", "beam4_ngram3_lp2_minmax_es", "beam4_nrs3")
]


@pytest.mark.parametrize(("family", "setting"), EQUIVALENCE)
def test_captured_backend_matches_generate(tiny_models, family: str, setting: str) -> None:
    """Static step, inputs padded to power-of-two lanes and 64-token widths, finished inputs idle, compaction:
    still token for token transformers' generate() (near-ties as the harness explains them)."""
    loaded = load(tiny_models(family))
    backends: list[CapturedBackend] = []

    def factory(model: torch.nn.Module) -> CapturedBackend:
        backends.append(CapturedBackend(get_backend(model), eager))
        return backends[-1]

    batch = text_batch(loaded, 20, seed=3)
    result = check_equivalence(loaded.model, factory, batch, SETTINGS[setting], rtol=MASKED_SUM_RTOL)
    print(f"{family} {setting} captured: {result.summary()}")
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    if SETTINGS[setting].get("num_beams", 1) == 1:
        assert result.identical == result.total
    assert len(backends[0].shapes) >= 2, "inputs finished, but the lanes were never compacted"


def inductor(decode: Decode) -> Decode:
    """The real compiler on the CPU: ``torch.compile``'s default backend (inductor), no CUDA graphs."""
    return torch.compile(decode, fullgraph=True, dynamic=False)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["greedy", "beam4_ngram3_lp2_minmax_es"])
@pytest.mark.parametrize("family", ["bart", "llama"])
def test_inductor_compiled_step_matches_generate(tiny_models, family: str, setting: str) -> None:
    """The step compiled by inductor (float32, CPU) through :class:`CapturedBackend`: every shape compiled, no
    fallback, token for token generate() (near-ties as the harness explains them)."""
    loaded = load(tiny_models(family))
    torch._dynamo.reset()  # torch's recompile limit counts the shapes of every backend's decode
    backends: list[CapturedBackend] = []

    def factory(model: torch.nn.Module) -> CapturedBackend:
        backends.append(CapturedBackend(get_backend(model), inductor))
        return backends[-1]

    result = check_equivalence(loaded.model, factory, text_batch(loaded, 8, seed=3), SETTINGS[setting])
    print(f"{family} {setting} inductor: {result.summary()}")
    assert backends[0].path == "captured", backends[0].path
    assert len(backends[0].shapes) >= 2, "inputs finished, but the lanes were never compacted"
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    if SETTINGS[setting].get("num_beams", 1) == 1:
        assert result.identical == result.total


def test_captured_backend_adds_no_host_sync(tiny_models) -> None:
    loaded = load(tiny_models("bart"))
    batch = text_batch(loaded, 6, seed=4)
    config = resolve_generation_config(loaded.model.generation_config, None, dict(BEAM, min_new_tokens=12))
    backend = CapturedBackend(get_backend(loaded.model), eager)
    with recording(backend) as rec:
        generate(backend, batch, config, sync_every=4)
    assert rec.iterations > 8 and rec.checks
    # A shape's first replay is checked against the eager step: one sync per shape, never per step.
    first_replay = [e for e in rec.violations() if "logits_differ" in e.where]
    assert 0 < len(first_replay) <= len(backend.shapes)
    others = [e for e in rec.violations() if e not in first_replay]
    assert not others, "\n".join(map(str, others))


def test_paths_and_reasons(tiny_models) -> None:
    model = load(tiny_models("bart")).model
    fast = get_backend(model)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert capture(fast, cpu, True) == (fast, "eager (cpu: no CUDA graphs)")
    assert capture(fast, cuda, False) == (fast, "eager (--no-capture)")
    generic = get_backend(model, generic=True)
    assert capture(generic, cuda, True) == (generic, "eager (GenericBackend has no static step)")
    wrapped, path = capture(fast, cuda, True, eager)
    assert isinstance(wrapped, CapturedBackend) and path == "captured" and wrapped.backend is fast


def _run(backend: Any, loaded: Any) -> list:
    config = resolve_generation_config(
        loaded.model.generation_config, None, dict(num_beams=3, max_new_tokens=10)
    )
    return generate(backend, text_batch(loaded, 5, seed=5), config).sequences


def test_compile_failure_falls_back_to_eager_with_the_reason(tiny_models) -> None:
    loaded = load(tiny_models("llama"))
    reference = _run(get_backend(loaded.model), loaded)

    def broken(decode: Decode) -> Decode:
        def fail(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no graph today\nsecond line")

        return fail

    backend = CapturedBackend(get_backend(loaded.model), broken)
    assert _run(backend, loaded) == reference
    assert backend.path == "eager (RuntimeError: no graph today)" and backend.decoder.compiled is None


def test_shapes_beyond_the_limit_run_eager(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load(tiny_models("bart"))
    calls: list[int] = []

    def counted(decode: Decode) -> Decode:
        def run(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            calls.append(tokens.shape[0])
            return decode(state, tokens)

        return run

    monkeypatch.setattr(capture_mod, "MAX_SHAPES", 1)
    backend = CapturedBackend(get_backend(loaded.model), counted)
    assert _run(backend, loaded) == _run(get_backend(loaded.model), loaded)
    assert set(calls) == {8 * 3} and len(backend.shapes) == 1, "5 inputs: 8 lanes of 3 rows, compiled once"
    assert backend.path == "captured (1 shapes; eager beyond)"


def test_generator_and_cli_report_the_step_path(tiny_models, tmp_path: Path) -> None:
    model = str(tiny_models("bart"))
    assert Generator(model, device="cpu").device_stats()["step_path"] == "eager (cpu: no CUDA graphs)"
    assert Generator(model, device="cpu", backend="hf").step_path == "generate()"
    src, stats = tmp_path / "in.txt", tmp_path / "stats.json"
    src.write_text("one line\nanother line\n")
    args = ["generate", "-m", model, "--device", "cpu", "--max-new-tokens", "3", "--no-capture", str(src)]
    res = seqgen(*args, "-o", str(tmp_path / "out.txt"), "--stats", str(stats))
    assert res.exit_code == 0, res.output
    assert json.loads(stats.read_text())["device"]["step_path"] == "eager (--no-capture)"
    assert res.stderr.rstrip().endswith("backend fast (bart decoder) on cpu float32, step eager (--no-capture)"), res.stderr
    line = Summary(
        backend="fast", device={"device": "cuda", "dtype": "bfloat16", "step_path": "captured"}
    ).line()
    assert line.endswith("backend fast on cuda bfloat16, step captured")


@pytest.mark.slow
def test_captured_backend_through_torch_compile(tiny_models) -> None:
    """The wrapper with a real ``torch.compile(fullgraph=True, dynamic=False)`` (CPU backend): the same tokens
    as the plain backend, one graph per shape (no recompiles across steps), static addresses marked."""
    loaded = load(tiny_models("bart"))
    torch._dynamo.reset()
    graphs: list[Any] = []

    def compiler(decode: Decode) -> Decode:
        return torch.compile(decode, fullgraph=True, dynamic=False, backend=counting_compiler(graphs))

    backend = CapturedBackend(get_backend(loaded.model), compiler)
    assert _run(backend, loaded) == _run(get_backend(loaded.model), loaded)
    assert backend.path == "captured" and len(backend.shapes) >= 2, backend.shapes
    assert len(graphs) == len(backend.shapes), f"{len(graphs)} graphs for {len(backend.shapes)} shapes"
    assert torch._dynamo.utils.get_static_address_type(backend.backend.layers[0].qkv_w) == "unguarded"


def _spans(max_len: int, steps: int, static: bool) -> list[int]:
    """The self-attention positions each step attends, as the cache decides them (``LaneTable.check``)."""
    cache = self_attention_cache(1, 1, 1, 1, max_len, 1, torch.float32, torch.device("cpu"))
    if static:
        cache.make_static()
    spans = []
    for t in range(steps):
        cache.check(t)
        spans.append(cache.span)
    return spans


# (layers, d_model, ffn, vocab, inputs, beams, source width, new tokens, preset's max new tokens)
CHECKPOINTS = {
    "marian wmt": (6, 512, 2048, 58101, 32, 4, 128, 30, 512),  # opus-mt, wmt-marian preset (max_length 512)
    "bart-large-cnn": (12, 1024, 4096, 50264, 32, 4, 1024, 142, 142),  # cnndm-bart preset
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_captured_step_reads_at_most_twice_what_the_dynamic_step_reads(name: str) -> None:
    """Bytes a decode step reads, counted from the shapes (half precision): the decoder's weights, the
    cross-attention K/V (once per input) and the self-attention K/V of the positions it attends. Over a whole
    generation the captured (static) step, attending span buckets of the preallocated positions, reads at most twice
    what the eager step (the positions written) reads; attending all positions (Marian: 512 for ~30 tokens) would
    not."""
    from seqgen_cli.shapes import graph_positions

    layers, d, ffn, vocab, inputs, beams, width, new, max_new = CHECKPOINTS[name]
    weights = layers * (8 * d * d + 2 * d * ffn) + vocab * d  # self q/k/v/o, cross q/o and k/v, ffn; lm head
    cross = inputs * width * d * 2 * layers
    per_position = inputs * beams * d * 2 * layers

    def read(spans: list[int]) -> int:
        return 2 * sum(weights + cross + per_position * span for span in spans)  # 2 bytes per half

    positions = graph_positions(max_new)
    dynamic, static = read(_spans(positions, new, False)), read(_spans(positions, new, True))
    assert dynamic < static <= 2 * dynamic, (name, static / dynamic)
    every = read([positions] * new)
    assert name != "marian wmt" or every > 2 * dynamic, "the case must tell buckets from all positions"
