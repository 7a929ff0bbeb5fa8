"""Beam search over fixed lanes (``search/static.py``): the search step with static shapes and addresses that the
capture path compiles like the model's step (``models/capture.py``: ``CapturedBackend.search_call``).

* run eagerly, the static step is ``BeamSearch`` bit for bit (tokens and scores) on the same captured backend, for
  every family and processor (n-gram blocking, min / max length, forced BOS / EOS, EOS, length penalty, early
  stopping True / False / "never", repetition penalty, bad words, suppression, renormalised logits, several
  returned sequences), also while inputs leave and the rows move into fewer lanes; the equivalence harness gives
  ``generate()``'s tokens through it for every family and beam setting;
* the static processors are the dynamic pipeline bit for bit at every step of random histories (beams reordered,
  prompts left-padded with ids beyond the vocabulary, n-gram keys packed or not), in both of their orders;
* its state is kept with its shape's kept state: a later batch of the shape refills it in place (the same addresses);
* no host sync inside a step; the loop checks every ``sync_every`` steps as before;
* a compiled search step is guarded as the model's: a failure on any call, inductor skipping CUDA graphs or a
  first replay that differs from the eager step fall back to the eager step for good (same tokens, the reason in
  the path), an out-of-memory error is re-raised;
* (slow) with the real inductor, model and search compiled give the eager engine's tokens, the compiled search
  alone ``generate()``'s (equivalence harness), and the compiled search step runs at most a third of the kernels
  the eager search dispatches as ATen ops.
"""

from __future__ import annotations

import re
from typing import Any
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig

import tests.equivalence  # noqa: F401  (single intra-op thread)
from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import get_backend, linear_maps
from seqgen_cli.models.capture import CapturedBackend, Decode, compile_search
from seqgen_cli.models.compiled_calls import SKIPPED
from seqgen_cli.models.kept import held_bytes, tensors_of
from seqgen_cli.search import Batch, generate, ngram
from seqgen_cli.search.beam import BeamSearch
from seqgen_cli.search.history import StaticHistory, StepLimits, TokenHistory
from seqgen_cli.search.processors import LogitsPipeline, Processors, append, process, process_split
from seqgen_cli.search.settings import resolve_settings
from seqgen_cli.search.static import StaticBeamSearch, StaticState, static_beam_step
from tests.equivalence import MASKED_SUM_RTOL, check_equivalence
from tests.equivalence import SETTINGS as EQUIVALENCE
from tests.helpers import failing_on
from tests.host_sync import recording
from tests.tiny_models import FAMILIES as ENGINE_FAMILIES
from tests.tiny_models import load, text_batch

SETTINGS: dict[str, dict[str, Any]] = {
    "ngram-minlen-lp-forced": dict(
        num_beams=4, no_repeat_ngram_size=3, min_new_tokens=5, max_new_tokens=24, length_penalty=2.0,
        early_stopping=True,
    ),
    "never-rep-badwords-nrs": dict(
        num_beams=3, early_stopping="never", repetition_penalty=1.3, bad_words_ids=[[5], [7, 8]],
        num_return_sequences=2, max_new_tokens=20,
    ),
    "heuristic-renormalize-ngram": dict(
        num_beams=3, early_stopping=False, renormalize_logits=True, no_repeat_ngram_size=2, length_penalty=0.6,
        max_new_tokens=20,
    ),
    "suppress-forced-bos": dict(
        num_beams=2, suppress_tokens=[3, 4], begin_suppress_tokens=[5, 6], forced_bos_token_id=9,
        forced_eos_token_id=10, max_new_tokens=12, length_penalty=-0.5,
    ),
}  # fmt: skip
FAMILIES = ["bart", "t5", "gpt2", "llama"]


def eager(fn: Any) -> Any:
    """A "compiler" that keeps the function as it is: the wrapper's logic without compiling."""
    return fn


def beam_only(loaded: Any) -> CapturedBackend:
    """The captured backend without a search compiler: ``BeamSearch`` over its rows (the reference)."""
    return CapturedBackend(get_backend(loaded.model), eager)


def static_backend(loaded: Any, search_compiler: Any = eager) -> CapturedBackend:
    """The captured backend with the static search, its step "compiled" by ``search_compiler``."""
    return CapturedBackend(get_backend(loaded.model), eager, search_compiler=search_compiler)


def run(backend: Any, loaded: Any, batch: Batch, settings: dict[str, Any], **kwargs: Any) -> Any:
    config = resolve_generation_config(loaded.model.generation_config, None, settings)
    return generate(backend, batch, config, **kwargs)


def searches(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every search ``make_search`` builds (which kind ran)."""
    made: list[Any] = []
    for cls in (BeamSearch, StaticBeamSearch):
        init = cls.__init__

        def record(self: Any, *args: Any, _init: Any = init, **kwargs: Any) -> None:
            _init(self, *args, **kwargs)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", record)
    return made


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_the_eager_static_step_is_beam_search_bit_for_bit(
    tiny_models, monkeypatch, family: str, setting: str
) -> None:
    loaded = load(tiny_models(family))
    batch = text_batch(loaded, 5, seed=5)
    made = searches(monkeypatch)
    reference = run(beam_only(loaded), loaded, batch, SETTINGS[setting])
    assert [type(s) for s in made] == [BeamSearch]
    out = run(static_backend(loaded), loaded, batch, SETTINGS[setting])
    assert type(made[-1]) is StaticBeamSearch, (
        "with a search compiler, the captured backend runs the static search"
    )
    assert out.sequences == reference.sequences
    assert out.scores == reference.scores  # bit for bit
    plain = run(get_backend(loaded.model), loaded, batch, SETTINGS[setting])
    assert out.sequences == plain.sequences, "and the eager engine's tokens (another model step)"


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_inputs_leave_and_the_rows_move_to_fewer_lanes(tiny_models, family: str) -> None:
    """Batches of 16 inputs that end at different steps, checked every step: finished inputs idle in their lanes;
    once no more than 8 run, the rows move to 8 lanes, the search state into the kept one of that shape. Which
    batch gets there depends on the model's and tokenizer's outputs (real or offline tokenizers), so ten batches
    run and each must equal the reference; at least one must have moved."""
    loaded = load(tiny_models(family))
    settings = dict(num_beams=3, max_new_tokens=30, length_penalty=1.5, no_repeat_ngram_size=2)
    moved_batches = 0
    for seed in range(3, 13):
        batch = text_batch(loaded, 16, seed=seed)
        reference = run(beam_only(loaded), loaded, batch, settings, sync_every=1)
        backend = static_backend(loaded)
        out = run(backend, loaded, batch, settings, sync_every=1)
        assert (out.sequences, out.scores) == (reference.sequences, reference.scores), seed
        shapes = sorted(kept.key[0] for kept in backend.kept.values() if kept.search is not None)
        assert shapes[-1] == 16, shapes
        moved_batches += len(shapes) >= 2
    assert moved_batches >= 1, "no batch moved its rows to fewer lanes"


def test_a_kept_search_state_keeps_its_addresses(tiny_models) -> None:
    """Three batches of one shape: the same search state, its tensors where they were (CUDA graphs read them in
    place), refilled by each batch, its bytes counted in the kept state's; the outputs are a fresh backend's."""
    loaded = load(tiny_models("bart"))
    settings = SETTINGS["ngram-minlen-lp-forced"]
    backend = static_backend(loaded)
    states, addresses = [], []
    for seed in (1, 2, 3):
        batch = text_batch(loaded, 7, seed=seed)
        out = run(backend, loaded, batch, settings)
        fresh = run(static_backend(loaded), loaded, batch, settings)
        assert (out.sequences, out.scores) == (fresh.sequences, fresh.scores)
        kept = backend.kept[(8, 4, 64, 64)]
        state: StaticState = kept.search[1]  # type: ignore[index]
        states.append(state)
        addresses.append([t.data_ptr() for t in [*state.buffers(), *state.history.buffers()]])
        model_bytes = held_bytes([*tensors_of(kept.inner), kept.tokens])
        assert (
            kept.nbytes
            == held_bytes([*tensors_of(kept.inner), kept.tokens, *tensors_of(state)])
            > model_bytes
        )
        assert backend.stats()["kept_bytes"] >= kept.nbytes  # what the kept states hold against the budget
    assert states[0] is states[1] is states[2]
    assert addresses[0] == addresses[1] == addresses[2]


def recording_static(backend: CapturedBackend) -> Any:
    """``tests/host_sync.py``'s recorder, following the static search's loop: an iteration starts with its search
    step (``StaticBeamSearch.advance``) and continues with the backend's ``step``."""
    return recording(backend, first=(StaticBeamSearch, "advance"), step_name="step")


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_a_static_step_never_syncs(tiny_models, family: str) -> None:
    """Every search and model step queues work only; the loop reads the device at its checks (every 3 steps)
    and after the loop, and a search shape's first compiled call is checked against the eager step once (one sync
    per shape, never per step). (The model's own first-replay check, one sync per shape, is skipped.)"""
    loaded = load(tiny_models(family))
    backend = static_backend(loaded)
    backend.decoder.differs = lambda *args: None
    settings = dict(SETTINGS["ngram-minlen-lp-forced"], repetition_penalty=1.2, bad_words_ids=[[5], [7, 8]])
    with recording_static(backend) as rec:
        run(backend, loaded, text_batch(loaded, 8, seed=4), settings, sync_every=3)
    assert rec.iterations > 6 and rec.checks, "too short to see two checks"
    first_replay = [e for e in rec.violations() if "outputs_differ" in e.where]
    assert first_replay and len(first_replay) <= len(backend.search.calls), first_replay  # type: ignore[union-attr]
    # before the first iteration the batch starts (the decoder start token's step, then the search: a kept search
    # state's first allocation copies its processors' ids from the host, once per shape)
    others = [e for e in rec.violations() if e not in first_replay and e.iteration >= 0]
    assert not others, "host syncs inside decode steps:\n" + "\n".join(map(str, others))
    assert all((i + 1) % 3 == 0 for i in rec.checks), rec.checks
    assert any(e.phase == "check" for e in rec.events), "the check itself was not seen: the recorder is blind"


@pytest.mark.parametrize("after", [False, True], ids=["before-step", "after-step"])
@pytest.mark.parametrize("call", [1, 2, 3, 7])
def test_a_search_failure_on_any_call_falls_back_to_eager(tiny_models, call: int, after: bool) -> None:
    loaded = load(tiny_models("llama"))
    batch, settings = text_batch(loaded, 5, seed=5), SETTINGS["ngram-minlen-lp-forced"]
    reference = run(beam_only(loaded), loaded, batch, settings)
    error = RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    backend = static_backend(loaded, failing_on(call, error, after))
    out = run(backend, loaded, batch, settings)
    assert (out.sequences, out.scores) == (reference.sequences, reference.scores)
    reason = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert backend.search is not None and backend.search.failure == reason
    assert backend.path == f"captured (search eager ({reason}))"
    stats = backend.stats()
    assert stats["search_compiled_steps"] == call - 1 and stats["search_eager_steps"] > 1


def test_an_out_of_memory_in_the_search_step_is_raised(tiny_models) -> None:
    loaded = load(tiny_models("bart"))
    batch, settings = text_batch(loaded, 5, seed=5), SETTINGS["ngram-minlen-lp-forced"]
    failing = failing_on(2, torch.OutOfMemoryError("CUDA out of memory"))
    backend = static_backend(loaded, failing)
    with pytest.raises(torch.OutOfMemoryError):
        run(backend, loaded, batch, settings)
    assert backend.search is not None and backend.search.failure is None


def test_inductor_skipping_cuda_graphs_turns_the_search_eager(tiny_models) -> None:
    loaded = load(tiny_models("bart"))
    batch, settings = text_batch(loaded, 5, seed=5), SETTINGS["ngram-minlen-lp-forced"]

    def skipping(step: Any) -> Any:
        def run_step(search: Any, logits: torch.Tensor) -> Any:
            counters["inductor"]["cudagraph_skips"] += 1
            return step(search, logits)

        return run_step

    backend = static_backend(loaded, skipping)
    out = run(backend, loaded, batch, settings)
    assert out.sequences == run(beam_only(loaded), loaded, batch, settings).sequences
    assert backend.search is not None and backend.search.failure == SKIPPED
    assert backend.stats()["search_path"] == f"eager ({SKIPPED})"


def test_a_compiled_step_that_differs_is_caught_on_its_first_replay(tiny_models) -> None:
    """A compiled step whose scores are off (a stale input, say): the shape's first replay is checked against the
    eager step, which wins, and the search runs eagerly from then on."""
    loaded = load(tiny_models("bart"))
    batch, settings = text_batch(loaded, 5, seed=5), SETTINGS["ngram-minlen-lp-forced"]

    def off(step: Any) -> Any:
        def run_step(search: Any, logits: torch.Tensor) -> Any:
            out = step(search, logits)
            return [out[0] + 0.5, *out[1:]]  # running scores

        return run_step

    backend = static_backend(loaded, off)
    out = run(backend, loaded, batch, settings)
    reference = run(beam_only(loaded), loaded, batch, settings)
    assert (out.sequences, out.scores) != (reference.sequences, reference.scores), (
        "the first two steps were off"
    )
    assert backend.search is not None
    assert backend.search.failure == "compiled search step differs from eager: output 0 of 11"
    assert backend.stats()["search_compiled_steps"] == 2


BEAM_SETTINGS = [name for name, kwargs in EQUIVALENCE.items() if kwargs.get("num_beams", 1) > 1]


@pytest.mark.parametrize(
    ("family", "setting"),
    [
        pytest.param(f, s, marks=() if s == "beam4_ngram3_lp2_minmax_es" else pytest.mark.slow, id=f"{f}-{s}")
        for f in ENGINE_FAMILIES
        for s in BEAM_SETTINGS
    ],
)
def test_the_static_search_is_generate(tiny_models, family: str, setting: str) -> None:
    """The equivalence harness through the capture path with the static search (both steps eager): every family and
    beam setting gives ``generate()``'s tokens (near-ties aside, at the static step's tolerance)."""
    loaded = load(tiny_models(family))
    result = check_equivalence(
        loaded.model, static_over, text_batch(loaded, 32), EQUIVALENCE[setting], rtol=MASKED_SUM_RTOL,
        tie_noise=MASKED_SUM_RTOL,
    )  # fmt: skip
    assert not result.mismatches, "\n".join(result.mismatches[:5])


def static_over(model: Any) -> CapturedBackend:
    return CapturedBackend(get_backend(model), eager, search_compiler=eager)


# -- the processors, step by step against the dynamic pipeline --------------------------------------------------

VOCAB = 12  # small: n-grams repeat, bans hit forced and suppressed tokens


def _pipelines(
    encoder_decoder: bool, renormalize: bool, n: int, seed: int
) -> tuple[TokenHistory, LogitsPipeline, StaticHistory, Processors, StepLimits, Any]:
    """A random starting history (decoder-only: left-padded prompts with ids beyond the vocabulary, rows in
    groups of 3 beams) and both processor pipelines over it (no-repeat ``n``-grams)."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt_len, new_tokens = 6, 1 if encoder_decoder else 7, 16
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=6, eos_token_id=[2, 11], decoder_start_token_id=0,
        repetition_penalty=1.3, no_repeat_ngram_size=n, bad_words_ids=[[5], [3, 4], [7, 8, 9], [4, 4, 7]],
        forced_bos_token_id=9 if seed == 0 else None, forced_eos_token_id=10, suppress_tokens=[6],
        begin_suppress_tokens=[1, 3], renormalize_logits=renormalize,
    )  # fmt: skip
    s = resolve_settings(config, is_encoder_decoder=encoder_decoder, prompt_len=prompt_len)
    prompt = torch.randint(0, VOCAB + 3 * (not encoder_decoder), (rows, prompt_len), generator=g)
    if encoder_decoder:
        prompt.fill_(4)  # the decoder start: [4, 4, 7] must not match a history of one 4
    pads = None if encoder_decoder else torch.tensor([0, 0, 0, 2, 2, 2])  # two inputs of 3 rows
    history = TokenHistory(prompt, s.max_length, pads)
    pipeline = LogitsPipeline(s, history, VOCAB, torch.device("cpu"))
    static = StaticHistory.empty(
        rows, prompt_len + new_tokens + 5, pipeline.ngram.keys is not None, torch.device("cpu")
    )
    static.restart(history, pipeline.ngram.keys, torch.arange(rows))
    limits = StepLimits.zeros(torch.device("cpu"))
    limits.restart(s)
    return history, pipeline, static, pipeline.proc.static(torch.device("cpu")), limits, s


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "columns"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renormalize"])
@pytest.mark.parametrize("encoder_decoder", [True, False], ids=["enc-dec", "dec-only"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_static_processors_are_the_pipeline_at_every_step(
    monkeypatch, encoder_decoder: bool, renormalize: bool, packed: bool, n: int, seed: int
) -> None:
    """Every step of a generation (beams reordered within inputs, random tokens appended), the static processors give
    the dynamic pipeline's scores bit for bit: in its order (``process``) and, with the running scores added, in
    the order that compiles into one pass (``process_split``)."""
    monkeypatch.setattr(ngram, "_INT64_LIMIT", 2**63 if packed else 1)
    history, pipeline, static, proc, limits, s = _pipelines(encoder_decoder, renormalize, n, seed)
    g = torch.Generator().manual_seed(100 + seed)
    for t in range(s.max_new_tokens):
        scores = torch.randn(6, VOCAB, generator=g).log_softmax(-1)  # [N, V]
        add = torch.randn(6, 1, generator=g)
        expected = pipeline(history, scores.clone())
        torch.testing.assert_close(process(proc, static, limits, scores.clone()), expected, rtol=0, atol=0)
        if not renormalize:
            split = process_split(proc, static, limits, scores.clone(), add)
            torch.testing.assert_close(split, expected + add, rtol=0, atol=0)
        rows = (torch.arange(2)[:, None] * 3 + torch.randint(0, 3, (2, 3), generator=g)).view(
            -1
        )  # within inputs
        tokens = torch.randint(0, VOCAB, (6,), generator=g)
        history.select(rows)
        pipeline.select(rows)
        history.append(tokens)
        pipeline.appended(history)
        static.tokens, *keys = append(proc, static, rows, tokens, limits.prompt_len + limits.t)
        static.keys = keys[0] if keys else None
        limits.t.fill_(t + 1)
        width = history.tokens.shape[1]
        assert torch.equal(static.tokens[:, :width], history.tokens) and not static.tokens[:, width:].any()


# -- the real compiler (inductor on the CPU) -------------------------------------------------------------------


def inductor(fn: Decode) -> Decode:
    return torch.compile(fn, fullgraph=True, dynamic=False)


def eager_search_ops(backend: Any, loaded: Any, batch: Batch, settings: dict[str, Any]) -> float:
    """ATen ops the eager ``BeamSearch`` dispatches per step (its reorder of the backend included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    advance, steps = BeamSearch.advance, []

    def counted(self: BeamSearch, logits: torch.Tensor) -> Any:
        with Count():
            steps.append(1)
            return advance(self, logits)

    with mock.patch.object(BeamSearch, "advance", counted):
        run(backend, loaded, batch, settings)
    return Count.ops / len(steps)


# a call in inductor's generated ``call()``: a fused kernel, an extern one (GEMMs) or an ATen fallback, its result
# perhaps assigned (``buf9 = torch.ops.aten.topk.default(...)``)
KERNEL_CALL = re.compile(
    r"^\s+(?:\w+ = )?"
    r"(?:cpp_fused_\w+|extern_kernels\.\w+|(?:torch\.ops\.)?aten\.\w+(?:\.\w+)?|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(",
    re.M,
)


def compiled_search_kernels(state: StaticState, logits: torch.Tensor) -> int:
    """Kernel calls in inductor's code for the static step (as EXPERIMENTS.md, "Compiled step on the CPU" counts
    them)."""
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(inductor(static_beam_step), state, logits)
    return sum(len(KERNEL_CALL.findall(code[code.index("def call(") :])) for code in codes)


@pytest.mark.slow  # inductor compiles the model step and the search step: about a minute on a loaded 2-core box
@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_model_and_search_through_the_real_compiler(tiny_models, monkeypatch, family: str) -> None:
    """Both steps compiled whole by inductor (``fullgraph=True, dynamic=False``, CPU): every search step after a
    batch's first compiled, the eager engine's tokens, and at most a third of the eager search's ATen ops run as
    kernels (a proxy for the launches a CUDA graph saves)."""
    monkeypatch.setattr(linear_maps, "ONEDNN", False)  # oneDNN's fused linear does not lower in inductor
    loaded = load(tiny_models(family))
    batch = text_batch(loaded, 8, seed=4)
    settings = dict(SETTINGS["ngram-minlen-lp-forced"], repetition_penalty=1.2)
    torch._dynamo.reset()
    backend = CapturedBackend(get_backend(loaded.model), inductor, search_compiler=inductor)
    out = run(backend, loaded, batch, settings)
    plain = run(get_backend(loaded.model), loaded, batch, settings)
    assert out.sequences == plain.sequences
    for ours, theirs in zip(out.scores, plain.scores, strict=True):
        assert ours == pytest.approx(theirs, rel=MASKED_SUM_RTOL)
    assert backend.path == "captured" and backend.search is not None and backend.search.failure is None
    assert backend.stats()["search_compiled_steps"] > 0 and backend.stats()["search_eager_steps"] == 0
    kept = next(kept for kept in backend.kept.values() if kept.search is not None)
    state: StaticState = kept.search[1]  # type: ignore[index]
    logits = torch.randn(state.history.tokens.shape[0], state.spec.vocab)
    kernels = compiled_search_kernels(state, logits)
    ops = eager_search_ops(get_backend(loaded.model), loaded, batch, settings)
    assert 0 < kernels <= ops / 3, (kernels, ops)


@pytest.mark.slow  # inductor compiles the search step per family: ~10 s each on a loaded 2-core box
@pytest.mark.parametrize(
    "setting", ["beam4_ngram3_lp2_minmax_es", "beam4_rep1.2", "beam4_ngram3_renormalize"]
)
@pytest.mark.parametrize("family", ["bart", "marian", "t5", "gpt2", "llama"])
def test_the_compiled_search_is_generate(tiny_models, family: str, setting: str) -> None:
    """The equivalence harness with the search step compiled by inductor (the model's step eager): ``generate()``'s
    tokens, every search step after a batch's first compiled and checked."""
    loaded = load(tiny_models(family))
    backend = CapturedBackend(get_backend(loaded.model), eager, search_compiler=inductor)
    result = check_equivalence(
        loaded.model, lambda model: backend, text_batch(loaded, 32), EQUIVALENCE[setting], rtol=MASKED_SUM_RTOL,
        tie_noise=MASKED_SUM_RTOL,
    )  # fmt: skip
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    assert backend.search is not None and backend.search.failure is None
    assert backend.stats()["search_compiled_steps"] > 0


@pytest.mark.slow  # inductor compiles the search step once: ~30 s on a loaded 2-core box
def test_compile_search_on_the_cpu_skips_cuda_graphs_and_says_so(tiny_models) -> None:
    """``compile_search`` itself (``reduce-overhead``) on the CPU: inductor compiles the step and skips CUDA graphs
    (no CUDA device here), which the guard reads: the search runs eagerly from then on, with the same tokens."""
    torch._dynamo.reset()
    loaded = load(tiny_models("bart"))
    batch, settings = text_batch(loaded, 5, seed=5), SETTINGS["ngram-minlen-lp-forced"]
    backend = static_backend(loaded, compile_search)
    out = run(backend, loaded, batch, settings)
    assert out.sequences == run(beam_only(loaded), loaded, batch, settings).sequences
    assert backend.stats()["search_path"] == f"eager ({SKIPPED})"
    assert backend.path == f"captured (search eager ({SKIPPED}))"
