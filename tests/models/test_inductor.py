"""The static decode step under the real inductor (``torch.compile``'s default backend) on the CPU, the
compiler that also runs on CUDA.

Every self-attention cache write must stay an in-place ``index_put_`` on the cache tensor, and no buffer the
size of a cache may be allocated (a copy of the cache) per step: a write through a view of one tensor holding
all layers is functionalized into ``index_put`` + ``select_scatter`` + ``copy_`` of the whole tensor, which
makes the compiled step slower than the eager one. Read from the post-grad graph (after inductor's
re-inplacing) and from the generated code. Cross-attention K/V are written once per input, never per step.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from torch._inductor import compile_fx
from torch._inductor.utils import run_and_get_code

from seqgen_cli.models import get_backend
from tests.equivalence import COMPILED_TOL
from tests.tiny_models import load, text_batch

pytestmark = pytest.mark.slow  # inductor compiles

FAMILIES = ["bart", "t5", "gpt2", "llama"]
ALLOC = re.compile(r"(buf\d+) = empty_strided\w*\(\(([\d, ]*)\)")  # inductor's buffer allocations


def written_caches(cache: Any) -> list[torch.Tensor]:
    """The self-attention K/V tensors a step writes (the decoder-only prompt K/V are only read)."""
    return cache.generated.tensors()


def cache_sizes(caches: list[torch.Tensor]) -> set[int]:
    """Element counts of a cache: each tensor's and its storage's (a layer's view of a stacked cache)."""
    return {x.numel() for x in caches} | {x.untyped_storage().nbytes() // x.element_size() for x in caches}


def post_grad_recorder(monkeypatch: pytest.MonkeyPatch) -> list[torch.fx.GraphModule]:
    """Record every graph as inductor lowers it: after the post-grad passes, re-inplacing included."""
    graphs: list[torch.fx.GraphModule] = []
    passes = compile_fx._recursive_post_grad_passes

    def record(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> None:
        passes(gm, *args, **kwargs)
        graphs.append(gm)

    monkeypatch.setattr(compile_fx, "_recursive_post_grad_passes", record)
    return graphs


def float_value(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) and val.is_floating_point() else None


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_step_writes_caches_in_place(
    tiny_models, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    loaded = load(tiny_models(family))
    backend = get_backend(loaded.model)
    batch = text_batch(loaded, 3, seed=2)
    # 9 positions x head_dim 8: no multiple of the cross width (64), no size clash with a cache
    r, positions = 2, 9
    graphs = post_grad_recorder(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(backend.decode, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    with (
        torch.inference_mode(),
        torch._inductor.config.patch(fx_graph_cache=False),  # lower afresh: the post-grad passes run
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        eager_state, _ = backend.start(batch, r, positions)
        state, _ = backend.start(batch, r, positions)
        for s in (eager_state, state):
            s.cache.make_static()
        codes: list[str] = []
        for t in range(3):
            tokens = torch.randint(4, backend.vocab_size, (3 * r,), generator=g)
            for s in (eager_state, state):
                s.cache.check(t)
            expected = backend.decode(eager_state, tokens)
            got, code = run_and_get_code(compiled, state, tokens) if t == 0 else (compiled(state, tokens), [])
            codes += code
            torch.testing.assert_close(got, expected, rtol=COMPILED_TOL, atol=COMPILED_TOL)
            for s in (eager_state, state):
                s.t += 1
                s.cache.advance()
            if t == 1:
                rows = torch.tensor([1, 1, 2, 3, 5, 4])
                backend.reorder(eager_state, rows)
                backend.reorder(state, rows)
    assert len(graphs) == 1 and codes, "one graph for every step"
    caches = written_caches(state.cache)
    sizes = cache_sizes(caches)

    # post-grad graph: the only writes to float inputs are one in-place index_put_ per cache tensor; any
    # other cache-sized value is a view (the attention reading the cache), never a copy or a scatter
    writes, copies = [], []
    for node in graphs[0].graph.nodes:
        val = float_value(node)
        target = node.target
        if node.op != "call_function" or val is None or not isinstance(target, torch._ops.OpOverload):
            continue
        if target._schema.is_mutable:
            assert node.args[0].op == "placeholder", f"{target} writes an intermediate: {node.format_node()}"
            writes.append((str(target), tuple(val.shape)))
        elif val.numel() in sizes and not target.is_view:
            copies.append(node.format_node())
    expected_writes = sorted(("aten.index_put_.default", tuple(x.shape)) for x in caches)
    assert sorted(writes) == expected_writes, f"cache writes not in place (or cross K/V written): {writes}"
    assert not copies, "cache-sized values copied per step:\n" + "\n".join(copies[:6])

    # generated code: no buffer of a cache's size is allocated
    allocs = [m for code in codes for m in ALLOC.findall(code)]
    assert allocs, "no allocations found: has the generated code's format changed?"
    big = [
        (name, shape)
        for name, shape in allocs
        if math.prod(int(n) for n in shape.split(",") if n.strip()) in sizes
    ]
    assert not big, f"cache-sized buffers allocated per step (cache sizes {sorted(sizes)}): {big}"
