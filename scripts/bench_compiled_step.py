"""The decode step per family on the CPU: eager (dynamic and static) vs compiled by inductor, per step.

Small random models built from configs (no shared files): BART, T5, GPT-2 and Llama at ``--d-model``
width and ``--layers`` decoder layers, ``--batch`` inputs x ``--beams`` rows, a ``--src``-token source or
prompt and ``--slots`` new-token slots. Arms, interleaved in every repetition, each from a fresh ``start()``
(not timed) through ``--steps`` steps, after one untimed warm-up run each:

* ``eager dynamic``: the CPU's default eager step (attends the slots written so far);
* ``eager static``: the eager step over all slots (``make_static()``, what capture compiles);
* ``eager static F.linear``: the same with ``F.linear`` instead of the CPU's oneDNN linear (as compiled);
* ``inductor static``: that step through ``torch.compile(fullgraph=True, dynamic=False)``, default backend
  (compiled before the first repetition; the first call's seconds reported, torch's on-disk caches on).

Also reported, as a proxy for kernel launches per step on a GPU: the ATen ops one eager step dispatches and
the kernels the compiled step's generated code calls (inductor's CPU code, not CUDA's: a proxy).
``--checkouts A B``: run the same in a fresh process per checkout (``PYTHONPATH``), alternating, ``--reps``
rounds (before/after a change). From the repository root::

    python scripts/bench_compiled_step.py --families bart,t5,gpt2,llama --reps 3
    python scripts/bench_compiled_step.py --families bart --reps 3 --checkouts /tmp/before .
"""

from __future__ import annotations

import argparse
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

from seqgen_cli.models import get_backend, linear_maps
from seqgen_cli.models.kv_cache import static_step
from seqgen_cli.search.protocol import Batch

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
    """Counts the ATen ops dispatched (views aside: they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def kernel_calls(code: str) -> int:
    """Kernel calls in inductor's generated ``call()``: fused kernels and extern ones (GEMMs)."""
    body = code[code.index("def call(") :]
    return len(re.findall(r"^\s+(?:cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+)\(", body, re.M))


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
        state, _ = backend.start(batch, args.beams, args.slots)
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
            static_step(backend.decode, state, tokens[0])
        out["ops_eager"] = count.ops
        times: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(-1, args.reps):  # rep -1: a warm-up run of every arm, not recorded
            for name, (owner, decode, static, linear_onednn) in arms.items():
                linear_maps.ONEDNN = linear_onednn  # read by linear_maps.dense at every call
                state = fresh(static, owner)
                t0 = time.perf_counter()
                for t in range(args.steps):
                    static_step(decode, state, tokens[t])
                if rep >= 0:
                    times[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
        linear_maps.ONEDNN = onednn
    out["ms_per_step"] = times
    return out


def report(results: list[dict[str, Any]], label: str = "") -> None:
    print(f"| family{label} | arm | median ms/step | runs | vs eager dynamic | vs eager static |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for res in results:
        times = res["ms_per_step"]
        base_d, base_s = (statistics.median(times[a]) for a in ("eager dynamic", "eager static"))
        for arm, ts in times.items():
            med = statistics.median(ts)
            runs = ", ".join(f"{t:.2f}" for t in ts)
            print(
                f"| {res['family']} | {arm} | {med:.2f} | {runs} | {base_d / med:.2f}x | {base_s / med:.2f}x |"
            )
    for res in results:
        print(
            f"{res['family']}: first compiled call {res['compile_s']:.1f} s; ops per eager step {res['ops_eager']}, "
            f"kernel calls per compiled step {res['kernels_compiled']} (CPU inductor: a proxy for GPU launches)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="bart,t5,gpt2,llama")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--src", type=int, default=128, help="source / prompt tokens")
    ap.add_argument("--slots", type=int, default=64, help="new-token slots (capture rounds to 64)")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared box)")
    ap.add_argument("--checkouts", nargs="*", help="run in these checkouts, alternating, one process each")
    ap.add_argument("--json", action="store_true", help="print the results as JSON (one line)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    families = args.families.split(",")
    if not args.checkouts:
        results = [bench_family(f, args) for f in families]
        print(json.dumps(results)) if args.json else report(results)
        return
    runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in args.checkouts}
    forwarded = [a for a in sys.argv[1:] if a not in args.checkouts and a != "--checkouts"]
    forwarded += ["--reps", "1", "--json"]  # later --reps wins in argparse
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
