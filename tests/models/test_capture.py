"""The capture path's bookkeeping, on the CPU with fake compilers standing in for
CUDA's failures:

* shapes from a small fixed set: power-of-two widths capped at the model's limit; a cap per instance, torch's
  recompile limit raised to it, and a hit of that limit reported, not silent;
* fallbacks that hold: a failure on any compiled call (the 1st compiles, the 2nd records a CUDA graph, the 3rd
  replays) falls back to eager with the reason and the same tokens; an out-of-memory error stays one (the batch
  is split) and the shape runs eagerly afterwards; inductor's ``cudagraph_skips`` read after every call;
* what ran reaches ``--stats`` and the closing line: shapes compiled, compile seconds, steps captured / eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from seqgen_cli.batching import Generated, Item, generate_split
from seqgen_cli.config import resolve_generation_config
from seqgen_cli.generator import Generator
from seqgen_cli.models import amortized, capture, compiled_calls, get_backend, linear_maps
from seqgen_cli.models.capture import (
    CapturedBackend,
    Decode,
    compile_decode,
)
from seqgen_cli.pipeline.stats import Summary
from seqgen_cli.search import Batch, generate
from seqgen_cli.search.refill import RefillStats, generate_refill
from seqgen_cli.search.settings import rows_per_input
from seqgen_cli.shapes import MIN_WIDTH, compacted, graph_width
from tests.equivalence import MASKED_SUM_RTOL
from tests.helpers import beam_config, failing_on, run_beam
from tests.tiny_models import load, text_batch


def eager(decode: Decode) -> Decode:
    """A "compiler" that keeps ``decode`` as it is: the capture wrapper's logic without compiling."""
    return decode


def _steps(backend: CapturedBackend) -> int:
    return backend.steps["captured"] + backend.steps["eager"]


def test_widths_are_powers_of_two_capped_at_the_model_limit() -> None:
    assert [graph_width(n) for n in (1, 64, 65, 129, 1000)] == [MIN_WIDTH, 64, 128, 256, 1024]
    assert {graph_width(n, 1024) for n in range(1, 1025)} == {64, 128, 256, 512, 1024}
    assert graph_width(520, 600) == 600 and graph_width(600, 600) == 600  # the model's limit, not 1024
    assert graph_width(700, 600) == 700, "longer than the limit: not padded further (the backend reports it)"
    assert graph_width(100, None) == 128  # no position limit (T5)


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_batches_are_padded_to_the_graph_width(tiny_models, family: str) -> None:
    loaded = load(tiny_models(family))
    base = text_batch(loaded, 3, seed=1)
    reps = -(-130 // base.input_ids.shape[1])
    ids, mask = base.input_ids.repeat(1, reps)[:, :130], base.attention_mask.repeat(1, reps)[:, :130]
    if not loaded.model.config.is_encoder_decoder:  # left padding: every row ends with a real token
        mask = torch.ones_like(mask)
    batch = Batch(ids, mask)  # [3, 130]
    backend = CapturedBackend(get_backend(loaded.model), eager)
    state, _ = backend.start(batch, 2, 10)
    assert state.shape == (4 * 2, 256, 64), "3 inputs -> 4 lanes x 2 rows, 130 tokens -> 256, 10 new -> 64"
    assert run_beam(backend, loaded, batch) == run_beam(get_backend(loaded.model), loaded, batch)


def test_compaction_stops_two_halvings_below_the_start(tiny_models) -> None:
    """A batch runs at most 3 row shapes: 16 lanes -> 8 -> 4, then finished inputs idle (a GPU step over 4
    idle lanes costs less than compiling another shape)."""
    assert [compacted(n, 32) for n in (32, 17, 16, 9, 8, 5, 4, 1)] == [32, 32, 16, 16, 8, 8, 8, 8]
    assert [compacted(n, 2) for n in (2, 1)] == [2, 1] and compacted(1, 1) == 1
    loaded = load(tiny_models("bart"))
    backend = CapturedBackend(get_backend(loaded.model), eager)
    state, _ = backend.start(text_batch(loaded, 16, seed=6), 1, 4)
    seen = [state.shape[0]]
    for running in (9, 8, 4, 3, 1):  # inputs finish; one row each, so rows = inputs
        keep = torch.arange(running)
        backend.keep(state, keep, keep)
        seen.append(state.shape[0])
    assert seen == [16, 16, 8, 4, 4, 4]


def test_the_shape_cap_is_per_instance_and_reported(tiny_models) -> None:
    loaded = load(tiny_models("bart"))
    reference = run_beam(get_backend(loaded.model), loaded)
    capped = CapturedBackend(get_backend(loaded.model), eager, max_shapes=1)
    free = CapturedBackend(get_backend(loaded.model), eager)
    assert run_beam(capped, loaded) == reference and run_beam(free, loaded) == reference
    assert len(capped.shapes) == 1 and capped.steps["eager"] > 0
    assert capped.path == "captured (1 shapes; eager beyond)"
    assert len(free.shapes) > 1 and free.steps["eager"] == 0 and free.path == "captured"


def counting(graphs: list[Any]) -> Any:
    """A ``torch.compile`` backend that runs the traced graph as is and records every compilation."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    return backend


def test_torch_recompile_limit_is_raised_to_the_instance_cap(tiny_models) -> None:
    """torch's global limit (here 1) does not cut an instance's shapes short: its compiling calls run under a
    limit of ``max_shapes``."""
    loaded = load(tiny_models("bart"))
    torch._dynamo.reset()
    graphs: list[Any] = []

    def compiler(decode: Decode) -> Decode:
        return torch.compile(decode, fullgraph=True, dynamic=False, backend=counting(graphs))

    backend = CapturedBackend(get_backend(loaded.model), compiler, max_shapes=4)
    with torch._dynamo.config.patch(recompile_limit=1):
        assert run_beam(backend, loaded) == run_beam(get_backend(loaded.model), loaded)
    assert backend.path == "captured" and len(backend.shapes) >= 2 and len(graphs) == len(backend.shapes)
    assert backend.steps["eager"] == 0


def test_every_compiled_call_runs_under_the_instance_limit(tiny_models) -> None:
    """Not only a shape's settling calls: a guard that misses on a known shape later recompiles under the same
    limit (and fails loudly at it); torch's own setting is back after each call."""
    loaded = load(tiny_models("bart"))
    seen: list[tuple[int, bool]] = []

    def recording(decode: Decode) -> Decode:
        def run(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            cfg = torch._dynamo.config
            seen.append((cfg.recompile_limit, cfg.fail_on_recompile_limit_hit))
            return decode(state, tokens)

        return run

    backend = CapturedBackend(get_backend(loaded.model), recording, max_shapes=8)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=False):
        assert run_beam(backend, loaded, min_new_tokens=10) == run_beam(
            get_backend(loaded.model), loaded, min_new_tokens=10
        )
        assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit) == (
            1,
            False,
        )
    assert len(seen) > 3 and set(seen) == {(8, True)}


def test_a_recompile_limit_hit_is_reported_not_silent(tiny_models) -> None:
    """A step value that reaches the graph recompiles every step: torch's limit is hit and the step path says
    so (torch alone would raise mid-run under fullgraph, or run eagerly and silently without it)."""
    loaded = load(tiny_models("bart"))
    torch._dynamo.reset()

    def compiler(decode: Decode) -> Decode:
        def leaky(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            return decode(state, tokens) + 0 * state.t  # a host int in the graph: one graph per step

        return torch.compile(leaky, fullgraph=True, dynamic=False, backend=counting([]))

    backend = CapturedBackend(get_backend(loaded.model), compiler, max_shapes=2)
    with torch._dynamo.config.patch(recompile_limit=2):
        assert run_beam(backend, loaded) == run_beam(get_backend(loaded.model), loaded)
    assert backend.path.startswith("captured, then eager (FailOnRecompileLimitHit"), backend.path
    assert backend.decoder.compiled is None and backend.steps["eager"] > 0


@pytest.mark.parametrize("after", [False, True], ids=["before-decode", "after-decode"])
@pytest.mark.parametrize("call", [1, 2, 3, 7])
def test_a_failure_on_any_call_falls_back_to_eager(tiny_models, call: int, after: bool) -> None:
    """Call 1 compiles (and warms up), 2 records the CUDA graph, 3 replays it, 7 is a later replay: each
    failure reruns the step eagerly, the same tokens come out and the path names the error."""
    loaded = load(tiny_models("llama"))
    reference = run_beam(get_backend(loaded.model), loaded, min_new_tokens=10)  # 10 steps: call 7 comes
    error = RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    backend = CapturedBackend(get_backend(loaded.model), failing_on(call, error, after))
    assert run_beam(backend, loaded, min_new_tokens=10) == reference
    reason = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert backend.path == ("eager" if call == 1 else "captured, then eager") + f" ({reason})"
    assert backend.decoder.compiled is None
    assert backend.steps["captured"] == call - 1 and _steps(backend) > call


class _Gen:
    """``generate_ids`` over a backend, for ``generate_split``."""

    def __init__(self, backend: Any, loaded: Any) -> None:
        self.backend, self.loaded = backend, loaded

    def generate_output(self, batch: list[list[int]], indices: Any = None, grammars: Any = ()) -> Generated:
        width = max(map(len, batch))
        ids = torch.tensor([b + [1] * (width - len(b)) for b in batch])
        mask = torch.tensor([[1] * len(b) + [0] * (width - len(b)) for b in batch])
        return Generated(generate(self.backend, Batch(ids, mask), beam_config(self.loaded)).sequences)


@pytest.mark.parametrize("message", ["CUDA out of memory. Tried to allocate 2.00 GiB", "out of memory"])
@pytest.mark.parametrize("call", [1, 2])
def test_out_of_memory_while_compiling_stays_an_oom(tiny_models, call: int, message: str) -> None:
    """An OOM while compiling or recording is re-raised (not taken for a compile failure), so the batch is
    retried (split if it runs out again); the shape that ran out runs on the plain backend from then on (no kept
    state), the others stay captured."""
    loaded = load(tiny_models("bart"))
    batch = text_batch(loaded, 5, seed=5)
    items = [
        Item(i, ids[m.bool()].tolist(), f"in:{i + 1}")
        for i, (ids, m) in enumerate(zip(batch.input_ids, batch.attention_mask, strict=True))
    ]
    plain = generate_split(_Gen(get_backend(loaded.model), loaded), items)
    backend = CapturedBackend(get_backend(loaded.model), failing_on(call, RuntimeError(message)))
    with pytest.raises(RuntimeError, match="out of memory"):
        _Gen(backend, loaded).generate_output([it.ids for it in items])
    (oom_shape,) = backend.decoder.oom_keys
    assert oom_shape[0] == 8 * 3, "5 inputs: 8 lanes of 3 rows"
    retried = generate_split(_Gen(backend, loaded), items)
    assert [r.sequences for r in retried] == [r.sequences for r in plain]
    assert not backend.kept and not backend.shapes, "the shape that ran out runs on the plain backend's state"
    two = [it.ids for it in items[:2]]  # another shape (2 lanes): captured
    expected = _Gen(get_backend(loaded.model), loaded).generate_output(two).sequences
    assert _Gen(backend, loaded).generate_output(two).sequences == expected
    assert backend.decoder.failure is None and backend.shapes and oom_shape not in backend.shapes
    assert backend.path == "captured (1 eager: out of memory while compiling)"


def test_an_oom_on_a_replay_is_raised_and_the_shape_stays_captured(tiny_models) -> None:
    loaded = load(tiny_models("bart"))
    backend = CapturedBackend(get_backend(loaded.model), failing_on(3, torch.OutOfMemoryError("CUDA OOM")))
    with pytest.raises(torch.OutOfMemoryError):
        run_beam(backend, loaded)
    assert not backend.decoder.oom_keys and backend.path == "captured"
    assert run_beam(backend, loaded) == run_beam(get_backend(loaded.model), loaded)


def test_an_oom_in_a_plain_batch_releases_the_kept_states_and_is_raised(tiny_models, monkeypatch) -> None:
    """A batch on the plain backend (its shape not paid yet) that runs out of memory: the kept states of other
    shapes are released (the split halves find their memory) and the error reaches ``generate_split``."""
    loaded = load(tiny_models("bart"))
    # fake clocks: eager steps take no time and each compiling call a second, so only the shape paid below pays,
    # however busy the machine (on the real clock a slow step could pay for the 2-lane shape, which then ran kept)
    policy = amortized.Amortized(clock=lambda: 0.0)
    backend = CapturedBackend(get_backend(loaded.model), eager, amortized=policy)
    backend.decoder.clock = Ticks(1.0)
    backend.amortized.forgone[(8 * 3, 64, 64, 64)] = 1e9  # 5 inputs: paid, runs on a kept state
    run_beam(backend, loaded)
    kept = len(backend.kept)  # 8 lanes and the shapes its compactions moved into
    assert kept >= 1 and backend.plain_batches == 0
    monkeypatch.setattr(
        backend.backend, "step", failing_on(1, torch.OutOfMemoryError("CUDA OOM"))(backend.backend.step)
    )
    with pytest.raises(torch.OutOfMemoryError):
        run_beam(backend, loaded, batch=text_batch(loaded, 2, seed=5))  # 2 lanes: not paid, plain
    assert backend.plain_batches == 1 and not backend.kept and backend.pool.released == kept


def test_inductor_skipping_cuda_graphs_is_read_from_its_counter(tiny_models) -> None:
    """Inductor may run a compiled graph without CUDA graphs (``cudagraph_skips``, on a recording or later): that
    shape runs eagerly from then on, and the step path says so."""
    loaded = load(tiny_models("bart"))

    def skipping(decode: Decode) -> Decode:
        calls = 0

        def run(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 2:  # cudagraph trees record on the 2nd call, and skip there
                counters["inductor"]["cudagraph_skips"] += 1
            return decode(state, tokens)

        return run

    backend = CapturedBackend(get_backend(loaded.model), skipping)
    assert run_beam(backend, loaded) == run_beam(get_backend(loaded.model), loaded)
    assert backend.path == "captured (1 eager: inductor skipped CUDA graphs)"  # later shapes: another count
    assert len(backend.decoder.skipped_keys) == 1 and backend.steps["eager"] > 0


def test_a_cuda_graph_skip_turns_only_its_shape_eager(tiny_models) -> None:
    """``cudagraph_skips`` is one counter for the process: a rise during one shape's call is that shape's, and the
    other shapes keep their graphs."""
    loaded = load(tiny_models("bart"))
    small = text_batch(loaded, 2, seed=8)  # 2 inputs: 2 x 3 rows, another shape than 5 inputs' 8 x 3

    def skipping_small(decode: Decode) -> Decode:
        def run(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            if tokens.shape[0] == 2 * 3:
                counters["inductor"]["cudagraph_skips"] += 1
            return decode(state, tokens)

        return run

    backend = CapturedBackend(get_backend(loaded.model), skipping_small)
    plain = get_backend(loaded.model)
    assert run_beam(backend, loaded) == run_beam(plain, loaded)
    assert run_beam(backend, loaded, small) == run_beam(plain, loaded, small)
    assert run_beam(backend, loaded) == run_beam(plain, loaded)  # the first shape: still captured
    assert len(backend.decoder.skipped_keys) == 1 and backend.shapes and backend.decoder.compiled is not None
    assert backend.path == "captured (1 eager: inductor skipped CUDA graphs)"


@pytest.mark.slow
def test_the_real_compiler_on_the_cpu_skips_cuda_graphs_and_the_path_says_so(
    tiny_models, monkeypatch
) -> None:
    """``compile_decode`` itself (inductor, ``reduce-overhead``) on the CPU: inductor compiles the step, skips
    CUDA graphs (no CUDA device here) and counts it in ``cudagraph_skips``, where the wrapper reads it: the step
    runs eagerly, the path says why and the compile seconds are counted (about 40 s on a busy 2-core box)."""
    monkeypatch.setattr(
        linear_maps, "ONEDNN", False
    )  # oneDNN's fused linear does not lower in inductor on the CPU
    torch._dynamo.reset()
    loaded = load(tiny_models("bart"))
    backend = CapturedBackend(get_backend(loaded.model), compile_decode)
    assert run_beam(backend, loaded) == run_beam(get_backend(loaded.model), loaded)
    assert backend.path == "eager (inductor skipped CUDA graphs: cudagraph_skips)"
    assert backend.stats()["compile_seconds"] > 0 and backend.steps["captured"] == 0


def test_a_shape_compiling_is_noted_above_the_bar(tiny_models, capsys) -> None:
    """Compiling pauses the run (~14 s a shape on a GPU): while the progress bar shows, each shape's first compiled
    call says so above it; without the bar (``-q``, output to a file from a script) nothing is added."""
    from seqgen_cli.pipeline.progress import Progress

    loaded = load(tiny_models("bart"))
    backend = CapturedBackend(get_backend(loaded.model), eager)
    with Progress(True).notes():
        run_beam(backend, loaded, min_new_tokens=70, max_new_tokens=70)  # two span buckets
    notes = [line for line in capsys.readouterr().err.splitlines() if "compiling the decode step" in line]
    assert len(notes) == len(backend.shapes) == 2 and notes[0].startswith("seqgen: compiling"), notes
    with Progress(False).notes():
        run_beam(CapturedBackend(get_backend(loaded.model), eager), loaded)
    assert "compiling" not in capsys.readouterr().err


def test_stats_reach_device_stats_and_the_closing_line(tiny_models) -> None:
    gen = Generator(str(tiny_models("bart")), device="cpu", num_beams=2, max_new_tokens=6)
    gen.generate(["one input"])
    assert "shapes_compiled" not in gen.device_stats(), "no CUDA graphs on the CPU: nothing to report"
    backend = CapturedBackend(gen.model_backend(), eager, max_shapes=1)
    gen._model_backend = backend
    gen.generate(["one short input", "a second, longer input of a few more words", "three"])
    stats = gen.device_stats()
    assert stats["step_path"] == backend.path
    assert stats["shapes_compiled"] == len(backend.shapes) == 1
    assert stats["max_shapes"] == 1 and stats["span_buckets"] == [64]  # 6 new tokens: the first bucket
    assert stats["captured_steps"] == backend.steps["captured"] > 0
    assert stats["eager_steps"] == backend.steps["eager"]
    assert stats["compile_seconds"] >= 0
    line = Summary(backend="fast", device=stats).line()
    steps = stats["captured_steps"] + stats["eager_steps"]
    share = round(100 * stats["captured_steps"] / steps)
    assert f", step {backend.path} (1 shapes compiled in 0s, {share}% of {steps} steps captured)" in line


def _skipping_guards() -> bool:
    """Whether compiled calls now run only dynamo's differentiating guards (``compiled_calls.unguarded``)."""
    return bool(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)


def test_a_settled_shape_runs_only_the_differentiating_guards(tiny_models) -> None:
    """Per key (batch shape and span bucket for ``decode``; kept state's shape and search settings for the search step):
    its first ``SETTLING_CALLS`` calls run every guard (a new span is a new host value: it must recompile), every
    later one only the differentiating guards; nothing outside a compiled call runs so."""
    loaded = load(tiny_models("bart"))
    decodes: list[tuple[int, bool]] = []  # (span, skipping) per compiled decode call
    searches: list[bool] = []

    def spying_decode(decode: Decode) -> Decode:
        def run(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            decodes.append((state.cache.span, _skipping_guards()))
            return decode(state, tokens)

        return run

    def spying_search(step: Any) -> Any:
        def run(state: Any, logits: torch.Tensor) -> Any:
            searches.append(_skipping_guards())
            return step(state, logits)

        return run

    backend = CapturedBackend(get_backend(loaded.model), spying_decode, search_compiler=spying_search)
    kwargs = dict(min_new_tokens=70, max_new_tokens=70)  # 128 positions: spans 64, then 128
    assert run_beam(backend, loaded, **kwargs) == run_beam(get_backend(loaded.model), loaded, **kwargs)
    assert backend.steps["eager"] == 0 and not _skipping_guards()
    spans = sorted({span for span, _ in decodes})
    assert spans == [64, 128], spans
    settled = compiled_calls.SETTLING_CALLS
    for span in spans:
        flags = [skipping for s, skipping in decodes if s == span]
        assert len(flags) > settled and flags == [False] * settled + [True] * (len(flags) - settled), span
    # the checked first replay calls the step a second time, eagerly (not through the spy)
    assert len(searches) > settled and searches == [False] * settled + [True] * (len(searches) - settled)


def test_a_settled_call_that_no_entry_fits_runs_with_every_guard(tiny_models) -> None:
    """Where no compiled entry passes the differentiating guards (here: dynamo's caches dropped), torch refuses to
    compile under the stance; the call is made again with every guard, compiles, and the shape stays captured."""
    loaded = load(tiny_models("bart"))
    torch._dynamo.reset()

    def dynamo_only(fn: Any) -> Any:  # dynamo's guards and caches, no inductor
        return torch.compile(fn, fullgraph=True, dynamic=False, backend="eager")

    backend = CapturedBackend(get_backend(loaded.model), dynamo_only, search_compiler=dynamo_only)
    plain = run_beam(get_backend(loaded.model), loaded, max_new_tokens=8)
    assert run_beam(backend, loaded, max_new_tokens=8) == plain
    torch._dynamo.reset()  # every key settled, no entry left
    assert run_beam(backend, loaded, max_new_tokens=8) == plain
    stats = backend.stats()
    assert backend.path == "captured" and stats["eager_steps"] == 0, stats
    assert stats["search_path"] == "compiled" and stats["search_eager_steps"] == 0, stats


@pytest.mark.slow  # inductor compiles two spans and the search step: about a minute on a loaded 2-core box
def test_settled_shapes_through_the_real_compiler_stay_captured_and_exact(tiny_models, monkeypatch) -> None:
    """Inductor (``fullgraph=True, dynamic=False``, CPU) over two span buckets, model and search compiled: with
    only the differentiating guards on settled keys, every step still runs its own span's graph (a call under
    that stance that needed another graph raises, which would turn the step eager), and the eager tokens."""
    monkeypatch.setattr(linear_maps, "ONEDNN", False)  # oneDNN's fused linear does not lower in inductor
    loaded = load(tiny_models("bart"))
    torch._dynamo.reset()
    unguarded, entered = compiled_calls.unguarded, [0]

    def counting() -> Any:
        entered[0] += 1
        return unguarded()

    monkeypatch.setattr(compiled_calls, "unguarded", counting)

    def inductor(fn: Any) -> Any:
        return torch.compile(fn, fullgraph=True, dynamic=False)

    backend = CapturedBackend(get_backend(loaded.model), inductor, search_compiler=inductor)
    kwargs = dict(min_new_tokens=70, max_new_tokens=70)
    assert run_beam(backend, loaded, **kwargs) == run_beam(get_backend(loaded.model), loaded, **kwargs)
    stats = backend.stats()
    assert backend.path == "captured" and stats["span_buckets"] == [64, 128], stats
    assert stats["eager_steps"] == 0 and stats["search_eager_steps"] == 0, stats
    assert entered[0] > stats["captured_steps"], "settled calls of both steps ran under the stance"


class Ticks:
    """A clock that moves ``dt`` seconds each time it is read."""

    def __init__(self, dt: float) -> None:
        self.now, self.dt = 0.0, dt

    def __call__(self) -> float:
        self.now += self.dt
        return self.now


def test_compile_seconds_are_read_from_the_guards_clock() -> None:
    """``Guarded.compile_seconds``, which :class:`Amortized` weighs against a shape's forgone savings, come from
    its ``clock``: a test's fake one fixes them (each settling call one tick), whatever the machine's load."""
    guard = compiled_calls.Guarded(eager, 4, lambda *args: None, clock=Ticks(0.5))
    for _ in range(compiled_calls.SETTLING_CALLS + 2):
        assert torch.equal(guard("key", torch.neg, torch.ones(2)), -torch.ones(2))
    assert guard.compile_seconds == (compiled_calls.SETTLING_CALLS - 1) * 0.5, "compile + recording calls"
    assert guard.steps["compiled"] == compiled_calls.SETTLING_CALLS + 2


def test_a_shape_compiles_once_its_eager_steps_would_have_paid_for_it() -> None:
    """Rent, then buy: the seconds capture would have saved (``1 - 1/speedup`` of each step, timed between two
    consecutive steps of the shape) reach the compile cost: the default guess first, then this backend's mean."""
    policy = amortized.Amortized(compile_seconds=1.0, speedup=2.0, clock=Ticks(0.1))  # saves 0.05 s a step
    none = (0, 0.0)
    assert [policy.ready("a", t, none) for t in range(22)] == [False] * 20 + [True] * 2  # 20 intervals: 1.0 s
    assert not policy.ready("b", 0, none) and not policy.ready("b", 5, none), (
        "not consecutive: nothing counts"
    )
    assert policy.forgone["b"] == 0
    fast = (2, 0.2)  # two shapes compiled in 0.2 s: 0.1 s each, two steps' worth
    assert [policy.ready("c", t, fast) for t in range(4)] == [False, False, True, True]
    assert policy.waiting(["a"]) == 2


def test_amortized_capture_runs_plain_until_compiling_pays_then_captured(tiny_models) -> None:
    """Through :class:`CapturedBackend`: a batch whose first shape has not paid for compiling runs on the wrapped
    backend's own state, as ``--no-capture`` runs it (no kept state; beam search as over any backend), its steps
    counted for that shape; once their forgone savings reach the compile cost, the next batch of the shape runs on
    a kept state, compiled (and checked) from its first step. The eager engine's tokens either way."""
    loaded = load(tiny_models("bart"))
    compiled: list[int] = []

    def counting(decode: Decode) -> Decode:
        def run(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            compiled.append(state.t)
            return decode(state, tokens)

        return run

    policy = amortized.Amortized(
        compile_seconds=1.0, speedup=2.0, clock=Ticks(0.1)
    )  # pays after 20 intervals
    backend = CapturedBackend(get_backend(loaded.model), counting, search_compiler=eager, amortized=policy)
    backend.decoder.clock = Ticks(0.1)  # compile seconds too, not the loaded machine's
    kwargs = dict(min_new_tokens=30, max_new_tokens=30)  # one batch shape, one span bucket
    expected = run_beam(get_backend(loaded.model), loaded, **kwargs)
    assert run_beam(backend, loaded, **kwargs) == expected
    assert not compiled and not backend.kept and backend.steps == {"eager": 30, "captured": 0}
    assert backend.search is not None and not backend.search.calls, "beam search ran as over any backend"
    ((shape, forgone),) = policy.forgone.items()
    assert shape == (8 * 3, 64, 64, 64), "5 inputs: 8 lanes of 3 beams"
    assert forgone == pytest.approx(29 * 0.05), "steps 1-29: 0.1 s each, half of it saved"
    assert backend.path == "captured (1 eager until compiling them pays)"
    assert run_beam(backend, loaded, **kwargs) == expected
    assert backend.stats()["plain_batches"] == 1
    assert compiled[0] == 0 and backend.steps == {"eager": 30, "captured": 30}, backend.steps
    assert backend.search.steps == {"compiled": 30 - 1, "eager": 0}, "every step but BeamSearch's first"
    assert backend.path == "captured" and backend.stats()["compile_when"] == "once it pays"


def test_a_short_run_compiles_nothing_by_default(tiny_models) -> None:
    """``capture(..., enabled=None)`` (the CLI's default): ~14 s of compiling against a tiny model's millisecond
    steps never pays in a short run, which runs eagerly and says so; ``True`` compiles at once, ``False`` never."""
    loaded = load(tiny_models("bart"))
    cuda = torch.device("cuda")  # capture() decides by the device's type; nothing here runs on it
    lazy, path = capture.capture(get_backend(loaded.model), cuda, None, compiler=eager, search_compiler=eager)
    assert isinstance(lazy, CapturedBackend) and lazy.amortized is not None and path == "captured"
    assert lazy.amortized.saves == pytest.approx(1 - 1 / 1.33), "float32: capture saves a quarter of a step"
    at_once, _ = capture.capture(get_backend(loaded.model), cuda, True, compiler=eager, search_compiler=eager)
    assert isinstance(at_once, CapturedBackend) and at_once.amortized is None
    never, path = capture.capture(get_backend(loaded.model), cuda, False)
    assert not isinstance(never, CapturedBackend) and path == "eager (--no-capture)"
    assert run_beam(lazy, loaded) == run_beam(get_backend(loaded.model), loaded) == run_beam(at_once, loaded)
    assert lazy.steps["captured"] == 0 and lazy.steps["eager"] > 0 and not lazy.shapes
    waiting = len(
        lazy.amortized.forgone.keys() | lazy.amortized._last.keys()
    )  # the batch and its compactions
    assert waiting >= 1 and lazy.path == f"captured ({waiting} eager until compiling them pays)", lazy.path
    assert at_once.steps["eager"] == 0 and at_once.steps["captured"] > 0


# -- the refill engine (search/refill.py) through the capture path ---------------------------------------------

REFILL = {  # family, settings, longest source/prompt: enc-dec runs past 64 steps (two spans), dec-only widens
    "bart-beam": ("bart", dict(num_beams=3, max_new_tokens=72, min_new_tokens=60), 40),
    "bart-greedy": ("bart", dict(num_beams=1, max_new_tokens=72, min_new_tokens=60), 40),
    "t5-beam": ("t5", dict(num_beams=3, max_new_tokens=72, min_new_tokens=60), 40),
    "gpt2-beam": ("gpt2", dict(num_beams=3, max_new_tokens=40), 300),
    "llama-sample": ("llama", dict(do_sample=True, num_return_sequences=2, max_new_tokens=40), 300),
}


def _refill_case(tiny_models, case: str) -> tuple[Any, Batch, Any, list[int]]:
    """The model, 10 inputs, the settings and a join order by length (as the batcher sorts a window: a
    decoder-only run's prompt regions widen through each width bucket)."""
    family, kwargs, max_tokens = REFILL[case]
    loaded = load(tiny_models(family))
    batch = text_batch(loaded, 10, seed=3, max_tokens=max_tokens)
    config = resolve_generation_config(loaded.model.generation_config, None, kwargs)
    order = sorted(range(10), key=lambda i: int(batch.attention_mask[i].sum()))
    return loaded, batch, config, order


def _refill(
    backend: Any, batch: Batch, config: Any, order: list[int], stats: RefillStats | None = None
) -> Any:
    return generate_refill(backend, batch, config, lanes=3, seed=11, order=order, stats=stats)


@pytest.mark.parametrize("case", list(REFILL))
def test_refill_runs_captured(tiny_models, case: str) -> None:
    """The refill engine's steps through :class:`CapturedBackend`: every step captured (each shape's first
    replay matched the eager rerun, so the lane step is idempotent), the plain engine's tokens and scores bit for
    bit, one shape per (rows, width, span, generated positions): two spans (64, then all 72) encoder-decoder;
    decoder-only one span and a prompt width per join's bucket."""
    loaded, batch, config, order = _refill_case(tiny_models, case)
    plain = _refill(get_backend(loaded.model), batch, config, order)
    backend, stats = CapturedBackend(get_backend(loaded.model), eager), RefillStats()
    out = _refill(backend, batch, config, order, stats)
    assert out.sequences == plain.sequences and out.scores == plain.scores
    assert backend.path == "captured"
    assert backend.steps == {"captured": stats.steps, "eager": 0} and stats.joins >= 3
    rows = 3 * rows_per_input(config)  # 3 lanes of beams or samples
    if loaded.model.config.is_encoder_decoder:
        assert backend.shapes == {(rows, MIN_WIDTH, 72, 64), (rows, MIN_WIDTH, 72, 72)}
    else:  # a join runs at its widest joiner's bucket: the first (the 3 shortest prompts) and the last (the longest)
        lengths = batch.attention_mask.sum(dim=1).tolist()
        widths = {graph_width(n) for n in lengths}
        seen = {shape[1] for shape in backend.shapes}
        assert {(r, t, span) for r, _, t, span in backend.shapes} == {(rows, 39, 39)}
        assert {graph_width(lengths[order[2]]), max(widths)} <= seen <= widths


@pytest.mark.parametrize("case", ["bart-beam", "gpt2-beam"])
def test_refill_traces_one_graph_per_shape(tiny_models, case: str) -> None:
    """Through ``torch.compile(fullgraph=True, dynamic=False)``: one graph per shape, none per step, join or
    window (no step number, lane or new lane state reaches a guard), every step captured."""
    loaded, batch, config, order = _refill_case(tiny_models, case)
    plain = _refill(get_backend(loaded.model), batch, config, order)
    torch._dynamo.reset()
    graphs: list[Any] = []

    def compiler(decode: Decode) -> Decode:
        return torch.compile(decode, fullgraph=True, dynamic=False, backend=counting(graphs))

    backend, stats = CapturedBackend(get_backend(loaded.model), compiler), RefillStats()
    out = _refill(backend, batch, config, order, stats)
    assert out.sequences == plain.sequences and out.scores == plain.scores
    assert backend.path == "captured" and backend.steps == {"captured": stats.steps, "eager": 0}
    assert len(graphs) == len(backend.shapes) >= 2, (len(graphs), backend.shapes)
    again = _refill(backend, batch, config, order)  # the next window: new lane tensors, the same shapes
    assert again.sequences == plain.sequences and len(graphs) == len(backend.shapes)


def test_a_refill_join_that_widens_marks_the_new_tensors_static(tiny_models) -> None:
    """The lanes' prompt regions are static addresses after ``open_lanes``; a wider joiner makes new ones,
    marked too (CUDA graphs read them in place)."""
    from torch._dynamo.utils import get_static_address_type

    from seqgen_cli.search.refill import _columns

    loaded = load(tiny_models("gpt2"))
    batch = text_batch(loaded, 10, seed=3, max_tokens=300)  # prompts of up to 147 tokens
    backend = CapturedBackend(get_backend(loaded.model), eager)
    with torch.inference_mode():
        state = backend.open_lanes(2, 1, 8)
        assert get_static_address_type(state.cache.fixed.keys[0]) == "unguarded"
        longest = batch.attention_mask.sum(dim=1).argmax().view(1)
        backend.join(state, [0], _columns(batch, longest, batch.input_ids.shape[1], left=True))
    assert backend.backend.lane_width(state) > MIN_WIDTH, "widened"
    assert get_static_address_type(state.cache.fixed.keys[0]) == "unguarded"
    assert get_static_address_type(state.cache.fixed.bias) == "unguarded"


@pytest.mark.parametrize("call", [1, 3, 7])
def test_a_refill_failure_falls_back_to_eager(tiny_models, call: int) -> None:
    """A compile (1), first replay (3) or later (7) failure in a refill run: that step reruns eagerly, the rest
    run eagerly, the same tokens and scores come out, and the path names the error."""
    loaded, batch, config, order = _refill_case(tiny_models, "bart-beam")
    plain = _refill(get_backend(loaded.model), batch, config, order)
    error = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    backend, stats = CapturedBackend(get_backend(loaded.model), failing_on(call, error)), RefillStats()
    out = _refill(backend, batch, config, order, stats)
    assert out.sequences == plain.sequences and out.scores == plain.scores
    assert backend.path == ("eager" if call == 1 else "captured, then eager") + f" (RuntimeError: {error})"
    assert backend.steps == {"captured": call - 1, "eager": stats.steps - call + 1}


def test_a_refill_step_that_differs_from_eager_switches_to_eager(tiny_models) -> None:
    """A compiled lane step off by a logit's size from its first replay (as a stale cache would be): caught by
    the first-replay check, eager from then on, the plain engine's tokens."""
    from tests.helpers import off_by

    loaded, batch, config, order = _refill_case(tiny_models, "gpt2-beam")
    plain = _refill(get_backend(loaded.model), batch, config, order)
    backend = CapturedBackend(get_backend(loaded.model), off_by(5.0))
    out = _refill(backend, batch, config, order)
    assert out.sequences == plain.sequences and out.scores == plain.scores
    assert backend.path.startswith("captured, then eager (compiled step differs from eager: max |diff| 5")
    assert backend.steps["captured"] == 2 and backend.decoder.compiled is None


def test_refill_stats_count_captured_steps(tiny_models) -> None:
    """``Generator`` with ``refill`` runs its lane steps through the capture path: ``--stats`` counts them."""
    gen = Generator(str(tiny_models("bart")), device="cpu", refill=True, num_beams=2, max_new_tokens=6)
    backend = CapturedBackend(gen.model_backend(), eager)
    gen._model_backend = backend
    gen.generate(["one short input", "a second, longer input of a few more words", "three"], batch_size=2)
    stats = gen.device_stats()
    assert stats["refill"]["steps"] > 0 and stats["step_path"] == "captured"
    assert stats["captured_steps"] == stats["refill"]["steps"] and stats["eager_steps"] == 0
    assert stats["shapes_compiled"] == len(backend.shapes) == 1


@pytest.mark.slow  # inductor compiles each shape: about a minute on a loaded 2-core box
@pytest.mark.parametrize("case", ["bart-beam", "gpt2-beam"])
def test_refill_through_the_real_compiler(tiny_models, monkeypatch, case: str) -> None:
    """The refill engine through :class:`CapturedBackend` with ``decode`` compiled whole by inductor
    (``fullgraph=True, dynamic=False``, CPU): every shape compiled, every step captured, the eager tokens."""
    monkeypatch.setattr(linear_maps, "ONEDNN", False)  # oneDNN's fused linear does not lower in inductor
    loaded, batch, config, order = _refill_case(tiny_models, case)
    plain = _refill(get_backend(loaded.model), batch, config, order)
    torch._dynamo.reset()

    def inductor(decode: Decode) -> Decode:
        return torch.compile(decode, fullgraph=True, dynamic=False)

    backend, stats = CapturedBackend(get_backend(loaded.model), inductor), RefillStats()
    out = _refill(backend, batch, config, order, stats)
    assert backend.path == "captured" and len(backend.shapes) >= 2, (backend.path, backend.shapes)
    assert backend.steps == {"captured": stats.steps, "eager": 0}
    assert out.sequences == plain.sequences
    for ours, theirs in zip(out.scores, plain.scores, strict=True):
        assert ours == pytest.approx(theirs, rel=MASKED_SUM_RTOL)


@pytest.mark.parametrize("flag, enabled", [([], None), (["--capture"], True), (["--no-capture"], False)])
def test_the_capture_flag_reaches_the_capture_path(
    tiny_models, tmp_path, monkeypatch: pytest.MonkeyPatch, flag: list[str], enabled: bool | None
) -> None:
    """``seqgen generate``: no flag compiles a shape once it pays (``None``), ``--capture`` at once, ``--no-capture``
    never; the engine's backend goes through :func:`capture.capture` with that setting."""
    from tests.helpers import seqgen

    seen: list[bool | None] = []
    real = capture.capture

    def recording(backend: Any, device: torch.device, on: bool | None, *args: Any, **kwargs: Any) -> Any:
        seen.append(on)
        return real(backend, device, on, *args, **kwargs)

    monkeypatch.setattr(capture, "capture", recording)
    src = tmp_path / "in.txt"
    src.write_text("one input\n", encoding="utf-8")
    args = ["generate", "-m", str(tiny_models("bart")), str(src), "--max-new-tokens", "3", "-q", *flag]
    result = seqgen(*args, "-o", str(tmp_path / "out.txt"))
    assert result.exit_code == 0, result.stderr
    assert seen == [enabled]


@pytest.mark.slow  # inductor compiles two model steps and the search step: ~40 s on a loaded 2-core box
def test_amortized_capture_through_the_real_compiler_keeps_the_tokens(tiny_models, monkeypatch) -> None:
    """The amortized policy through inductor: a first batch runs on the plain backend and pays for its shapes;
    the next batch of the shape runs compiled (model and search) on a kept state, and meets a span bucket that has
    not paid (what the first batch counted for it forgotten): that step eager on the kept state, the next compiled,
    mid-batch. The eager engine's tokens throughout."""
    monkeypatch.setattr(linear_maps, "ONEDNN", False)  # oneDNN's fused linear does not lower in inductor
    loaded = load(tiny_models("bart"))
    torch._dynamo.reset()

    def inductor(fn: Any) -> Any:
        return torch.compile(fn, fullgraph=True, dynamic=False)

    policy = amortized.Amortized(compile_seconds=1e-12, clock=Ticks(1e3))  # one interval pays for any compile
    backend = CapturedBackend(get_backend(loaded.model), inductor, search_compiler=inductor, amortized=policy)
    backend.decoder.clock = Ticks(1e-3)  # inductor's compile seconds, fixed: not the loaded machine's
    kwargs = dict(min_new_tokens=70, max_new_tokens=70)  # span buckets 64 and 128
    expected = run_beam(get_backend(loaded.model), loaded, **kwargs)
    assert run_beam(backend, loaded, **kwargs) == expected
    assert backend.steps == {"eager": 70, "captured": 0} and sorted(s[-1] for s in policy.forgone) == [
        64,
        128,
    ]
    later = next(shape for shape in policy.forgone if shape[-1] == 128)
    del policy.forgone[later], policy._last[later]
    assert run_beam(backend, loaded, **kwargs) == expected
    stats = backend.stats()
    assert stats["span_buckets"] == [64, 128] and backend.path == "captured", (stats, backend.path)
    assert stats["eager_steps"] == 70 + 1 and stats["captured_steps"] == 70 - 1, (
        "step 64 eager, then compiled"
    )
    assert stats["search_compiled_steps"] == 70 - 1, stats


def test_amortized_capture_over_a_run_of_batches_gives_the_same_outputs(tiny_models) -> None:
    """A ``Generator`` run of several batches (mixed widths, inputs leaving, compactions) through a
    :class:`CapturedBackend` that compiles each shape after 3 eager steps' worth of savings: some steps eager, the
    rest captured, every output the plain engine's; the closing figures count both."""
    texts = [("a rather long input " * (i % 5 + 1)).strip() for i in range(11)]
    settings = dict(num_beams=2, min_new_tokens=4, max_new_tokens=12)
    plain = Generator(str(tiny_models("bart")), device="cpu", **settings)
    expected = plain.generate(texts, batch_size=4)
    gen = Generator(str(tiny_models("bart")), device="cpu", **settings)
    policy = amortized.Amortized(compile_seconds=0.3, speedup=2.0, clock=Ticks(0.2))  # 0.1 s a step: 3 steps
    backend = CapturedBackend(gen.model_backend(), eager, search_compiler=eager, amortized=policy)
    backend.decoder.clock = Ticks(0.15)  # a shape's compile + recording calls: 0.3 s, whatever the load
    gen._model_backend = backend
    assert gen.generate(texts, batch_size=4) == expected
    stats = gen.device_stats()
    assert stats["captured_steps"] > 0 and stats["eager_steps"] >= 3, stats
    assert stats["compile_when"] == "once it pays" and stats["shapes_compiled"] == len(backend.shapes) >= 1
