"""Bytes and kernels per decode step of bart-large-cnn's decoder, as inductor compiles it on the CPU.

The decoder of bart-large-cnn (12 layers, d 1024, 16 heads, vocab 50264; random weights, a 1-layer encoder:
only its output's shape matters to the step) in ``--dtype``, ``--beams`` rows per input, a ``--src``-token
source and ``--positions`` new-token positions, static step (``make_static()``, what capture compiles). For each
``--batch`` it reports, for one step:

* ``bytes``: inductor's own estimate of the bytes its kernels read and write (``graph.count_bytes()``, logged
  by ``TORCH_LOGS=inductor_metrics``; extern GEMMs included);
* ``kernels``: kernel calls in the generated code (CPU inductor: a proxy for CUDA launches after capture);
* ``eager_ops``: ATen ops one eager step dispatches (views aside: a proxy for eager CUDA launches);
* ``cache_bytes``: the self-attention K/V tensors (all layers).

Bytes are linear in the batch, so small batches extrapolate to large ones (``--extrapolate 32,128``). Run it
in two checkouts (``PYTHONPATH``) to compare a change::

    python scripts/harness/step_traffic.py --batch 1,2 --extrapolate 32,128
"""

from __future__ import annotations

import argparse
import json
import logging
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqgen_cli.models import get_backend
from seqgen_cli.models.lane_table import run_step
from seqgen_cli.search.protocol import Batch


class OpCount(TorchDispatchMode):
    """Counts the ATen ops dispatched (views aside: they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def kernel_calls(code: str) -> int:
    """Kernel calls in inductor's generated ``call()``: fused kernels and extern ones (GEMMs)."""
    body = code[code.index("def call(") :]
    return len(re.findall(r"^\s+(?:cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+)\(", body, re.M))


def model(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=50264, d_model=1024, decoder_layers=12, decoder_attention_heads=16, decoder_ffn_dim=4096,
        encoder_layers=1, encoder_attention_heads=16, encoder_ffn_dim=4096, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return BartForConditionalGeneration(cfg).to(dtype).eval()


def measure(backend, batch: int, beams: int, src: int, positions: int) -> dict[str, int]:  # noqa: ANN001
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code

    ids = torch.randint(4, 50000, (batch, src), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(4, 50000, (batch * beams,))
    torch._dynamo.reset()
    metrics.reset()
    compiled = torch.compile(backend.decode, fullgraph=True, dynamic=False)
    with (
        torch.inference_mode(),
        torch._inductor.config.patch(fx_graph_cache=False),  # count_bytes runs only when inductor lowers
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        state, _ = backend.start(Batch(ids, torch.ones_like(ids)), beams, positions)
        state.cache.make_static()
        state.cache.check(0)
        _, codes = run_and_get_code(compiled, state, tokens)
        with OpCount() as count:
            run_step(backend.decode, state, tokens)
    c = state.cache
    caches = [*c.k, *c.v] if isinstance(c.k, list) else [c.k, c.v]
    return {
        "batch": batch,
        "bytes": int(metrics.num_bytes_accessed),
        "kernels": sum(kernel_calls(code) for code in codes),
        "eager_ops": count.ops,
        "cache_bytes": sum(x.nbytes for x in caches),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,2", help="inputs per batch, comma-separated (measured)")
    ap.add_argument("--extrapolate", default="32,128", help="batches to extrapolate bytes to (linear)")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--src", type=int, default=1024)
    ap.add_argument("--positions", type=int, default=142)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from torch._inductor import compile_fx

    log = compile_fx.inductor_metrics_log  # inductor counts bytes when this logs at INFO: enable, unprinted
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(logging.NullHandler())
    backend = get_backend(model(getattr(torch, args.dtype)))
    rows = [measure(backend, int(b), args.beams, args.src, args.positions) for b in args.batch.split(",")]
    out = {"measured": rows}
    if len(rows) >= 2:
        (b0, y0), (b1, y1) = (rows[0]["batch"], rows[0]["bytes"]), (rows[-1]["batch"], rows[-1]["bytes"])
        per_input = (y1 - y0) / (b1 - b0)
        out["bytes_per_input"] = per_input
        out["extrapolated_bytes"] = {
            int(b): y0 + per_input * (int(b) - b0) for b in args.extrapolate.split(",") if b
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
