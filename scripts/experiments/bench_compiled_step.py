"""The decode step per family on the CPU: eager (dynamic and static) vs compiled by inductor, per step.

Small random models built from configs (no shared files): BART, T5, GPT-2 and Llama at ``--d-model``
width and ``--layers`` decoder layers, ``--batch`` inputs x ``--beams`` rows, a ``--src``-token source or
prompt and ``--positions`` new-token positions. Arms, interleaved in every repetition, each from a fresh ``start()``
(not timed) through ``--steps`` steps, after one untimed warm-up run each:

* ``eager dynamic``: the CPU's default eager step (attends the positions written so far);
* ``eager static``: the eager step over all positions (``make_static()``, what capture compiles);
* ``eager static F.linear``: the same with ``F.linear`` instead of the CPU's oneDNN linear (as compiled);
* ``inductor static``: that step through ``torch.compile(fullgraph=True, dynamic=False)``, default backend
  (compiled before the first repetition; the first call's seconds reported, torch's on-disk caches on).

Also reported, as a proxy for kernel launches per step on a GPU: the ATen ops one eager step dispatches and
the kernels the compiled step's generated code calls (inductor's CPU code, not CUDA's: a proxy).

The decode loop, model and beam search (``--engine``, on by default): beam ``--beams``, no-repeat 3, length penalty
2, exactly ``--steps`` new tokens, host check every ``--sync-every`` steps, only the loop timed (after the
encoder or prefill), arms interleaved in every repetition as above, each on its own backend kept across
repetitions (the capture path's kept states):

* ``loop eager``: the CPU's default, the eager dynamic step and ``BeamSearch``;
* ``loop static``: ``CapturedBackend`` with stand-in compilers that compile nothing: the static step and the static
  search (``search/static.py``), both eager;
* ``loop inductor model``: the static step compiled, ``BeamSearch`` eager (the capture path without a search
  compiler);
* ``loop inductor model+search``: both compiled, the static search's step too, as ``--capture`` runs them on CUDA
  (default mode here: no CUDA graphs on the CPU).

Counted per step: the eager loop's ATen ops (the model step's, the search's and the loop's own), and for the
compiled loop the kernels of the model's and the search's graphs plus the ATen ops run outside them; and dynamo's
cache lookup per compiled call (its guards), a settled key's calls on the differentiating guards (as shipped)
against every guard.

``--checkouts A B``: run the same in a fresh process per checkout (``PYTHONPATH``), alternating, ``--reps``
rounds (before/after a change). See docs/EXPERIMENTS.md ("Compiled step on the CPU", "One stacked cache"). From
the repository root::

    python scripts/experiments/bench_compiled_step.py --families bart,t5,gpt2,llama --reps 3
    python scripts/experiments/bench_compiled_step.py --families bart --reps 3 --checkouts /tmp/before .
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import compiled_calls, get_backend, linear_maps
from seqgen_cli.models.capture import CapturedBackend
from seqgen_cli.models.lane_table import run_step
from seqgen_cli.search.beam import BeamConstants, pick_topk
from seqgen_cli.search.cohort import Cohort, Results, make_search
from seqgen_cli.search.engine import run_batch
from seqgen_cli.search.protocol import Batch
from seqgen_cli.search.rows import start_rows
from seqgen_cli.search.sampling import Streams
from seqgen_cli.search.settings import rows_per_input, settings_for
from seqgen_cli.search.static import static_beam_step

VOCAB = 8192
onednn = linear_maps.ONEDNN


def build(family: str, d: int, layers: int) -> torch.nn.Module:
    """A random-weight model (seed 0) of ``family`` at width ``d``, ``layers`` layers, 4 heads."""
    import transformers as tf

    heads, ffn = 4, 4 * d
    if family == "bart":
        cfg = tf.BartConfig(
            vocab_size=VOCAB, d_model=d, encoder_layers=layers, decoder_layers=layers,
            encoder_attention_heads=heads, decoder_attention_heads=heads,
            encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        )  # fmt: skip
        cls = tf.BartForConditionalGeneration
    elif family == "t5":
        cfg = tf.T5Config(
            vocab_size=VOCAB, d_model=d, d_kv=d // heads, d_ff=ffn, num_layers=layers,
            num_decoder_layers=layers, num_heads=heads,
        )  # fmt: skip
        cls = tf.T5ForConditionalGeneration
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=d, n_layer=layers, n_head=heads)
        cls = tf.GPT2LMHeadModel
    elif family == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads // 2,
        )  # fmt: skip
        cls = tf.LlamaForCausalLM
    else:
        raise SystemExit(f"unknown family {family!r}")
    torch.manual_seed(0)
    return cls(cfg).eval()


def source(batch: int, length: int) -> Batch:
    """Random token ids [B, S], no padding."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (batch, length), generator=g)
    return Batch(ids, torch.ones_like(ids))


class OpCount(TorchDispatchMode):
    """Counts the ATen ops dispatched (views aside: they launch nothing), none while ``paused``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += not func.is_view and not self.paused
        return func(*args, **(kwargs or {}))


KERNEL_CALL = re.compile(
    r"^\s+(?:\w+ = )?"  # a fallback's result may be assigned: buf9 = torch.ops.aten.topk.default(...)
    r"(?:cpp_fused_\w+|extern_kernels\.\w+|(?:torch\.ops\.)?aten\.\w+(?:\.\w+)?|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(",
    re.M,
)


def kernel_calls(code: str) -> int:
    """Kernel calls in inductor's generated ``call()``: fused kernels, extern ones (GEMMs) and ATen fallbacks
    (``aten.scatter_reduce_.two(...)``, ``buf = torch.ops.aten.topk.default(...)``)."""
    return len(KERNEL_CALL.findall(code[code.index("def call(") :]))


def bench_family(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """Per-step milliseconds of every arm over ``args.reps`` interleaved repetitions, compile seconds, op counts."""
    from torch._inductor.utils import run_and_get_code

    model = build(family, args.d_model, args.layers)
    backend = get_backend(model)
    linear_maps.ONEDNN = False  # a second backend over the same weights with F.linear, as inductor runs them
    plain = get_backend(model)
    linear_maps.ONEDNN = onednn
    batch = source(args.batch, args.src)
    n = args.batch * args.beams
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(4, VOCAB, (n,), generator=g) for _ in range(args.steps)]
    torch._dynamo.reset()
    compiled = torch.compile(backend.decode, fullgraph=True, dynamic=False)
    arms = {  # name: (backend, decode, static step, oneDNN linear on)
        "eager dynamic": (backend, backend.decode, False, onednn),
        "eager static": (backend, backend.decode, True, onednn),
        "eager static F.linear": (plain, plain.decode, True, False),
        "inductor static": (backend, compiled, True, onednn),
    }

    def fresh(static: bool, backend: Any = backend) -> Any:
        state, _ = backend.start(batch, args.beams, args.positions)
        if static:
            state.cache.make_static()
        return state

    out: dict[str, Any] = {"family": family}
    with torch.inference_mode():
        state = fresh(True)
        t0 = time.perf_counter()
        state.cache.check(0)
        _, codes = run_and_get_code(compiled, state, tokens[0])
        out["compile_s"] = time.perf_counter() - t0
        out["kernels_compiled"] = sum(kernel_calls(c) for c in codes)
        state = fresh(True)
        with OpCount() as count:
            run_step(backend.decode, state, tokens[0])
        out["ops_eager"] = count.ops
        times: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(-1, args.reps):  # rep -1: a warm-up run of every arm, not recorded
            for name, (owner, decode, static, linear_onednn) in arms.items():
                linear_maps.ONEDNN = linear_onednn  # read by linear_maps.dense at every call
                state = fresh(static, owner)
                t0 = time.perf_counter()
                for t in range(args.steps):
                    run_step(decode, state, tokens[t])
                if rep >= 0:
                    times[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
        linear_maps.ONEDNN = onednn
    out["ms_per_step"] = times
    return out


def inductor(fn: Any) -> Any:
    """``torch.compile`` as the capture path does, less CUDA graphs (none on the CPU)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def engine_config(model: torch.nn.Module, beams: int, steps: int) -> Any:
    """Beam ``beams``, no-repeat 3, length penalty 2, early stopping, exactly ``steps`` new tokens."""
    flags = dict(
        num_beams=beams, max_new_tokens=steps, min_new_tokens=steps, no_repeat_ngram_size=3,
        length_penalty=2.0, early_stopping=True,
    )  # fmt: skip
    if model.config.is_encoder_decoder:  # T5's config has one, its generation config may not
        flags["decoder_start_token_id"] = getattr(model.config, "decoder_start_token_id", None) or 0
    return resolve_generation_config(model.generation_config, None, flags)


def decode_loop(
    backend: Any, batch: Batch, config: Any, sync_every: int, around: Any = None
) -> tuple[float, float]:
    """Seconds of ``generate()``'s decode loop over ``backend`` (its start, the encoder or prefill, untimed), run
    inside the context ``around``, and of its search steps (``Cohort.advance``: the search and the reorder)."""
    s = settings_for(backend, batch, config)
    device = batch.input_ids.device
    consts = BeamConstants.build(s, device)
    rows, logits = start_rows(backend, batch, s, rows_per_input(config))
    search = make_search(rows, s, consts, pick_topk(logits), Streams(None, device))
    cohort = Cohort(rows, search, Results(len(rows.inputs)))
    searching, advance = [0.0], cohort.advance

    def timed(logits: torch.Tensor) -> Any:
        t0 = time.perf_counter()
        try:
            return advance(logits)
        finally:
            searching[0] += time.perf_counter() - t0

    cohort.advance = timed  # type: ignore[method-assign]
    with around or contextlib.nullcontext():
        t0 = time.perf_counter()
        run_batch(backend, cohort, logits, sync_every)
        return time.perf_counter() - t0, searching[0]


def count_loop(backend: Any, batch: Batch, config: Any, sync_every: int, pause: str) -> int:
    """ATen ops of one decode loop (the loop only), none inside what ``pause`` names: ``"model"`` (the backend's
    step), ``"compiled"`` (every compiled call of a ``CapturedBackend``) or ``""``."""
    count, step, under_limit = OpCount(), backend.step, compiled_calls.call_under_limit

    def paused_step(*args: Any) -> Any:
        count.paused = True
        try:
            return step(*args)
        finally:
            count.paused = False

    def outside(*args: Any, **kwargs: Any) -> Any:  # a compiled call runs without the mode (no guard sees it)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return under_limit(*args, **kwargs)

    if pause == "model":
        backend.step = paused_step
    if pause == "compiled":  # the model's guarded call and the search's both go through compiled_calls
        compiled_calls.call_under_limit = outside
    try:
        decode_loop(backend, batch, config, sync_every, around=count)
    finally:
        backend.__dict__.pop("step", None)
        compiled_calls.call_under_limit = under_limit
    return count.ops


def lookup_us(backend: CapturedBackend, batch: Batch, config: Any, sync_every: int) -> dict[str, float]:
    """Microseconds per compiled call in dynamo's cache lookup (its guards; ``torch.profiler``'s "TorchDynamo Cache
    Lookup" events over one decode loop), with a settled key's calls on the differentiating guards only (as
    shipped) and on every guard."""
    from torch.profiler import profile

    out, shipped = {}, compiled_calls._SKIP_GUARDS
    for name, skip in (("differentiating guards", True), ("every guard", False)):
        compiled_calls._SKIP_GUARDS = skip
        try:
            with profile() as prof:
                decode_loop(backend, batch, config, sync_every)
        finally:
            compiled_calls._SKIP_GUARDS = shipped
        (event,) = [e for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup"]
        out[name] = event.self_cpu_time_total / event.count
    return out


def search_kernels(backend: CapturedBackend) -> int:
    """Kernel calls in the compiled static search step of ``backend``'s (first) kept state (a pure function: run on
    random logits, it changes nothing)."""
    from torch._inductor.utils import run_and_get_code

    st = next(iter(backend.kept.values())).search[1]  # type: ignore[index]
    logits = torch.randn(st.history.tokens.shape[0], st.spec.vocab)
    _, codes = run_and_get_code(inductor(static_beam_step), st, logits)
    return sum(kernel_calls(c) for c in codes)


def bench_engine(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """The decode loop (model + beam search) per arm: ms per step over ``args.reps`` interleaved repetitions and
    the op / kernel counts per step."""
    model = build(family, args.d_model, args.layers)
    batch, config = source(args.batch, args.src), engine_config(model, args.beams, args.steps)
    torch._dynamo.reset()
    arms = {
        "loop eager": get_backend(model),
        "loop static": CapturedBackend(get_backend(model), lambda d: d, search_compiler=lambda f: f),
        "loop inductor model": CapturedBackend(get_backend(model), inductor),
        "loop inductor model+search": CapturedBackend(get_backend(model), inductor, search_compiler=inductor),
    }
    out: dict[str, Any] = {"family": family}
    with torch.inference_mode():
        times: dict[str, list[float]] = {name: [] for name in arms}
        searching: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(-1, args.reps):  # rep -1: a warm-up run of every arm (compiles), not recorded
            for name, backend in arms.items():
                seconds, search_s = decode_loop(backend, batch, config, args.sync_every)
                if rep >= 0:
                    times[name].append(1e3 * seconds / args.steps)
                    searching[name].append(1e3 * search_s / args.steps)
        eager, compiled = arms["loop eager"], arms["loop inductor model+search"]
        total = count_loop(eager, batch, config, args.sync_every, "")
        search = count_loop(eager, batch, config, args.sync_every, "model")
        out["loop_ops_model"] = (total - search) / (args.steps - 1)  # the first step's logits come from start
        out["loop_ops_search"] = search / args.steps
        out["loop_ops_outside"] = (
            count_loop(compiled, batch, config, args.sync_every, "compiled") / args.steps
        )
        out["search_kernels"] = search_kernels(compiled)
        out["lookup_us"] = lookup_us(compiled, batch, config, args.sync_every)
        out["search_path"] = compiled.stats()["search_path"]
    out["ms_per_step"], out["search_ms_per_step"] = times, searching
    return out


def report(
    results: list[dict[str, Any]], label: str = "", bases: tuple[str, str] = ("eager dynamic", "eager static")
) -> None:
    print(f"| family{label} | arm | median ms/step (min-max) | runs | vs {bases[0]} | vs {bases[1]} |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for res in results:
        times = res["ms_per_step"]
        base_d, base_s = (statistics.median(times[a]) for a in bases)
        for arm, ts in times.items():
            med = statistics.median(ts)
            runs = ", ".join(f"{t:.2f}" for t in ts)
            spread = f"{med:.2f} ({min(ts):.2f}-{max(ts):.2f})"
            print(
                f"| {res['family']} | {arm} | {spread} | {runs} | {base_d / med:.2f}x | {base_s / med:.2f}x |"
            )
    for res in results:
        if "compile_s" not in res:
            continue
        print(
            f"{res['family']}: first compiled call {res['compile_s']:.1f} s; ops per eager step {res['ops_eager']}, "
            f"kernel calls per compiled step {res['kernels_compiled']} (CPU inductor: a proxy for GPU launches)"
        )


def report_engine(results: list[dict[str, Any]], steps: list[dict[str, Any]]) -> None:
    """The loop arms' table and the counts per decode step (model kernels from the step arms' ``steps``)."""
    report(results, bases=("loop eager", "loop static"))
    print("\nof which the search step (Cohort.advance: search, reorder), ms per step:")
    report(
        [res | {"ms_per_step": res["search_ms_per_step"]} for res in results],
        bases=("loop eager", "loop static"),
    )
    for res, step in zip(results, steps, strict=True):
        model_k, search_k, outside = step["kernels_compiled"], res["search_kernels"], res["loop_ops_outside"]
        eager_m, eager_s = res["loop_ops_model"], res["loop_ops_search"]
        compiled, eager = model_k + search_k + outside, eager_m + eager_s
        print(
            f"{res['family']} decode step: eager {eager:.0f} ATen ops (model {eager_m:.0f}, search and loop "
            f"{eager_s:.0f}); compiled {compiled:.0f} (model graph {model_k} kernels, search graph {search_k}, "
            f"outside the graphs {outside:.1f} ops): {compiled / eager:.2f} of eager; search {res['search_path']}"
        )
        lookups = ", ".join(f"{name} {us:.0f}" for name, us in res["lookup_us"].items())
        print(f"{res['family']} dynamo cache lookup per compiled call, settled keys, us: {lookups}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="bart,t5,gpt2,llama")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--src", type=int, default=128, help="source / prompt tokens")
    ap.add_argument("--positions", type=int, default=64, help="new-token positions (capture rounds to 64)")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared box)")
    ap.add_argument("--checkouts", nargs="*", help="run in these checkouts, alternating, one process each")
    ap.add_argument("--json", action="store_true", help="print the results as JSON (one line)")
    ap.add_argument(
        "--engine", action=argparse.BooleanOptionalAction, default=True, help="the decode loop too"
    )
    ap.add_argument("--sync-every", type=int, default=4, help="steps between host checks in the loop arms")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    families = args.families.split(",")
    if not args.checkouts:
        results = [bench_family(f, args) for f in families]
        loops = [bench_engine(f, args) for f in families] if args.engine else []
        if args.json:
            print(json.dumps(results + loops))
            return
        report(results)
        if loops:
            print()
            report_engine(loops, results)
        return
    runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in args.checkouts}
    forwarded = [a for a in sys.argv[1:] if a not in args.checkouts and a != "--checkouts"]
    forwarded += ["--reps", "1", "--json", "--no-engine"]  # later --reps wins in argparse
    for _ in range(args.reps):
        for checkout in args.checkouts:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
            cmd = [sys.executable, __file__, *forwarded]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[checkout].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for checkout, rounds in runs.items():
        merged = []
        for i in range(len(families)):
            res = dict(rounds[0][i])
            res["ms_per_step"] = {a: [r[i]["ms_per_step"][a][0] for r in rounds] for a in res["ms_per_step"]}
            res["compile_s"] = statistics.median(r[i]["compile_s"] for r in rounds)
            merged.append(res)
        print(f"\n{checkout}:")
        report(merged)


if __name__ == "__main__":
    main()
