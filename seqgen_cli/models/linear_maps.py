"""The fast backends' linear maps: float32 and bfloat16 through oneDNN on the CPU, or ``--dtype int8``.

:func:`dense` is ``F.linear``, except for float32 and bfloat16 on the CPU (:data:`ONEDNN_DTYPES`): there decode-step
products ([N, D]) run through oneDNN's matmul, faster than the MKL GEMM behind ``F.linear``. The backends' own maps (:func:`linear`) go one step
further on the CPU: :class:`PackedLinear` runs oneDNN on a weight packed once into its blocked layout, products over
whole sources ([B, S, D]: cross-attention keys/values) as one [B * S, D] product, and the encoder-decoders' encoder
runs its own layers with :class:`SourceLinear` (a PackedLinear) in place of ``nn.Linear`` (:func:`onednn_copy`).

Batch invariance (tests/models/test_determinism.py). oneDNN computes each row of a product the same way whatever the
number of rows, the row's position among them, the number of threads and whether the weight is packed (float32 and bfloat16 alike), except
a product of a single row (a matrix-vector kernel with another summation order): :func:`onednn` runs one row as
two. MKL's GEMM does so only when the row count is a multiple of 8 (rows of products of fewer than 12 rows
change with the row count and the thread count), which the sources' width buckets guarantee
(``shapes.input_width``: ``B x S`` rows; the generic backend and ``generate()`` run the model's own encoder on MKL).
A row's result does not depend on the rows beside it, so an output does not depend on which inputs share its batch
or leave it.

``--dtype int8`` on the CPU: torch's dynamic quantization (``torch.ao.nn.quantized.dynamic.Linear``).
Weights are stored as int8 with one scale per output row (per-channel, as CTranslate2's int8); activations
are quantized per tensor at run time (one scale and zero point from the whole input's minimum and maximum, where
CTranslate2 takes one per row), the product runs in int8 (:func:`int8_engine`: fbgemm under torch's ``x86``
engine, or oneDNN's engine on a CPU with AMX) and comes back
as float32. So an int8 row's result depends on the other rows of its product, and an input's int8 output on the
rest of its batch (tests/models/test_determinism.py, an expected failure). Everything that is not a linear layer (embeddings, norms, attention, the search) stays
float32. torch's ``torch.ao.quantization`` namespace is deprecated in favour of torchao, but torchao has no
fast eager CPU kernel for int8 dynamic activations (see docs/EXPERIMENTS.md, "CPU int8"), so this uses the
torch one and silences its deprecation warnings.

Quantizing is a start-up cost (a Marian-sized model: ~1 s of a ~4.4 s process, docs/EXPERIMENTS.md, "int8 weight
cache"): :func:`int8_linear` takes each weight's quantized values from the disk cache of
:mod:`seqgen_cli.models.int8_cache` when a session of it is open, and packs them (fbgemm's packed layout is not
saved). Cached or not, a layer gets the same int8 values, scales and packed weight, so the same outputs.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from copy import deepcopy
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from seqgen_cli.models.int8_cache import quantized
from seqgen_cli.models.resident import release

with warnings.catch_warnings():  # torch imports it with itself; its deprecation notice aside
    warnings.simplefilter("ignore")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

Linear = Callable[[torch.Tensor], torch.Tensor]


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.ao\.")
        yield


PACK_ROWS = 128  # the row count oneDNN picks the packed layout for (any row count runs on it)
PACK_AFTER = 8  # calls a PackedLinear runs on the dense weight before it packs
PACK_LIMIT = 256 * 2**20  # bytes: a larger weight is not packed (no second copy of NLLB's 1 GB LM head)
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# The dtypes oneDNN runs here: float32 always; bfloat16 where the CPU has bf16 products (AMX, AVX-512 BF16) or
# can convert to them (AVX-512 BW/VL/DQ), as ``mkldnn._is_mkldnn_bf16_supported`` says. An AVX2-only CPU runs
# bfloat16 through ``F.linear``.
ONEDNN_DTYPES = ((torch.float32,) if ONEDNN else ()) + (
    (torch.bfloat16,) if ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()
)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (``/proc/cpuinfo``; none where it cannot be read)."""
    with suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    return set()


def cpu_isa() -> str:
    """The CPU's widest instructions for the products, in words (``--stats`` ``device.cpu_isa``): ``AMX`` (bf16 and
    int8 tiles), ``AVX-512 BF16``, else torch's own capability name (``AVX512``, ``AVX2``, ...); with the cap
    ``ONEDNN_MAX_CPU_ISA`` sets on oneDNN, where set."""
    flags = cpu_flags()
    isa = "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else None
    isa = isa or torch.backends.cpu.get_cpu_capability()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"{isa} (ONEDNN_MAX_CPU_ISA={cap})" if cap else isa


INT8_ENGINES = {"x86": "fbgemm", "fbgemm": "fbgemm", "onednn": "oneDNN"}  # torch's quantized engine -> its kernels


def int8_engine(flags: set[str] | None = None) -> str:
    """torch's quantized engine for ``--dtype int8``'s products on this CPU: ``onednn`` where it has AMX's int8 tiles
    (``amx_int8``; oneDNN's engine is the one that runs them, torch's ``x86`` engine never does; not measured on such
    a CPU yet); else ``x86`` (fbgemm), which on AVX-512 VNNI is as fast as oneDNN's engine or faster at 8-128 rows
    (docs/BENCHMARKS.md, "bfloat16 and int8 on the CPU"). ``flags``: the CPU's (:func:`cpu_flags`)."""
    flags = cpu_flags() if flags is None else flags
    return "onednn" if "amx_int8" in flags and "onednn" in torch.backends.quantized.supported_engines else "x86"


def use_int8_engine(engine: str | None = None) -> str:
    """Make ``engine`` (default :func:`int8_engine`) torch's quantized engine, before any int8 weight is packed (a
    packed weight is the engine's own; the int8 cache's key names the engine) and returns it."""
    torch.backends.quantized.engine = engine or int8_engine()
    return torch.backends.quantized.engine


def kernel(dtype: torch.dtype, int8: bool) -> str:
    """What runs the fast backends' linear maps on the CPU, in words (``--stats`` ``device.linear_maps``)."""
    if int8:
        engine = torch.backends.quantized.engine
        why = "AMX int8 tiles" if engine == "onednn" else "no AMX int8 tiles"
        return f"int8 {INT8_ENGINES.get(engine, engine)} ({why}; per-channel weights, per-tensor dynamic activations)"
    name = str(dtype).removeprefix("torch.")
    return f"{name} oneDNN (weights packed once)" if dtype in ONEDNN_DTYPES else f"{name} F.linear"


def on_onednn(x: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` runs on oneDNN: a CPU weight of a dtype in :data:`ONEDNN_DTYPES` (and ``x`` of
    the same dtype, where given)."""
    return weight.device.type == "cpu" and weight.dtype in ONEDNN_DTYPES and (x is None or x.dtype == weight.dtype)


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul ``x @ weight.T + bias`` (``weight`` dense or packed); a single row runs as two rows, so
    its result is the one it has in any larger product (module docstring)."""
    if x.numel() != x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    twice = x.reshape(1, -1).expand(2, -1).contiguous()  # [1, I] -> [2, I]
    out = torch.ops.mkldnn._linear_pointwise(twice, weight, bias, "none", [], "")  # [2, O]
    return out[:1].reshape(*x.shape[:-1], out.shape[-1])


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; float32 or bfloat16 [N, D] on the CPU through :func:`onednn`.

    On the 2-core CPU of docs/EXPERIMENTS.md ("CPU float32: where a step goes") oneDNN runs the decode step's
    products 10-40 % faster than the MKL GEMM behind ``F.linear``, and the LM head about 2x faster (MKL
    re-packs the whole [V, D] matrix for every few-row product). Same product, another summation order
    (float32 rounding, about 1e-6 relative). Under ``torch.compile`` always ``F.linear``: inductor cannot lower
    ``mkldnn._linear_pointwise`` on a dense weight, and picks its own GEMM.
    """
    if on_onednn(x, weight) and x.dim() == 2 and not torch.compiler.is_compiling():  # any number of rows
        return onednn(x, weight, bias)
    return F.linear(x, weight, bias)


class PackedLinear:
    """``x -> x @ weight.T + bias`` in float32 or bfloat16 on the CPU, after its first ``PACK_AFTER`` calls over a copy of
    ``weight`` that oneDNN has reordered once into its own blocked layout (``mkldnn._reorder_linear_weight``,
    as torch's inductor does for frozen CPU models), so no product repacks the weight.

    On the 2-core CPU of docs/EXPERIMENTS.md ("CPU float32: weights packed for oneDNN") this is 3-40 % faster
    than oneDNN on the dense weight at 8-32 rows (LM heads 18-38 %) and about even at 128. Packing costs time
    (~0.1 s for a 50k-word LM head) and a second copy of the weight, so the first calls run :func:`dense`: a run
    of a few steps (start-up, one short input) never packs. Once packed, the dense weight's pages go back where
    they were read from the checkpoint's file (:mod:`~seqgen_cli.models.resident`; a later read faults them in).
    Packed or not, oneDNN gives every row the same bits (module docstring). An input of more dimensions ([B, S, D]:
    whole sources) runs as one [B * S, D] product.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight  # [O, I] dense, for the first calls (and under torch.compile)
        self.bias = bias
        self.packed: torch.Tensor | None = None  # opaque oneDNN tensor, built on call PACK_AFTER + 1
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile: the dense weight, no state change (it would retrace), no oneDNN op (see dense).
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:  # [..., I] -> [rows, I] -> [..., O]
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if self.packed is None:
            self.calls += 1
            if self.calls <= PACK_AFTER:
                return dense(x, self.weight, self.bias)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS)
            release([self.weight])  # pages read from the checkpoint's file go back until read again (resident.py)
        return onednn(x, self.packed, self.bias)


class SourceLinear(nn.Module):
    """An encoder's ``nn.Linear`` run as a :class:`PackedLinear` (oneDNN on the CPU), the same parameters
    under the same names: the encoder's layers run unchanged but for the products' summation order. On the 2-core
    EPYC of docs/EXPERIMENTS.md ("The encoder on oneDNN") oneDNN runs encoder-sized products (12k rows) 1.7-2.3x as
    fast as the MKL GEMM behind ``nn.Linear``, 1.9-2.4x once packed."""

    def __init__(self, module: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = module.in_features, module.out_features
        self.weight, self.bias = module.weight, module.bias
        self.map = PackedLinear(module.weight, module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.map(x)


def onednn_copy(module: nn.Module) -> nn.Module:
    """``module`` again, its CPU ``nn.Linear`` layers as :class:`SourceLinear` (float32, bfloat16): a copy of its module tree
    that shares every parameter and buffer (no weight is copied), so ``module`` itself, which ``generate()`` runs,
    stays as it was. ``module`` unchanged where there is nothing to run on oneDNN (GPU, float16)."""
    linears = [m for m in module.modules() if type(m) is nn.Linear]
    if not linears or not all(on_onednn(None, m.weight) for m in linears):
        return module
    shared = {id(t): t for t in (*module.parameters(), *module.buffers())}
    copy = deepcopy(module, memo=shared)
    for parent in list(copy.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, SourceLinear(child))
    return copy


def linear(weight: torch.Tensor, bias: torch.Tensor | None, int8: bool = False) -> Linear:
    """``x -> x @ weight.T + bias``: on the CPU in :data:`ONEDNN_DTYPES` a :class:`PackedLinear` (up to :data:`PACK_LIMIT` bytes),
    else :func:`dense` over the given tensors (no copy); with ``int8`` a dynamic-quantized copy of ``weight``
    (:func:`int8_linear`)."""
    if not int8:
        if on_onednn(None, weight) and weight.nbytes <= PACK_LIMIT:
            return PackedLinear(weight, bias)
        return partial(dense, weight=weight, bias=bias)
    return int8_linear(weight, bias)


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [O, I] as a per-channel qint8 tensor (one scale per output row), exactly as torch's
    ``DynamicLinear.from_float`` quantizes it under ``per_channel_dynamic_qconfig``."""
    from torch.ao.nn.quantized.modules.utils import _quantize_weight
    from torch.ao.quantization import per_channel_dynamic_qconfig

    with torch.no_grad(), _quiet():
        w = weight.detach().float()
        observer = per_channel_dynamic_qconfig.weight()
        observer(w)
        return _quantize_weight(w, observer)


def _pack(module: nn.Module, qweight: torch.Tensor, bias: torch.Tensor | None) -> None:
    with torch.no_grad():  # no warnings filter here: a pool thread's would race the caller's (they are global)
        module.set_weight_bias(qweight, bias)


@dataclass
class _Packing:
    """An open :func:`packing_in_threads`: its pool, its packs, and slots bounding the weights submitted and not
    yet packed (each holds its int8 copy until packed)."""

    pool: ThreadPoolExecutor
    slots: threading.BoundedSemaphore
    futures: list[Future[None]] = field(default_factory=list)

    def submit(self, module: nn.Module, qweight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.slots.acquire()
        future = self.pool.submit(_pack, module, qweight, bias)
        future.add_done_callback(lambda _: self.slots.release())
        self.futures.append(future)


_PACKING: ContextVar[_Packing | None] = ContextVar("int8 packing", default=None)


@contextmanager
def packing_in_threads() -> Iterator[None]:
    """The int8 weights built inside the block (:func:`dynamic_linear`) are packed by a pool of torch's thread count
    (none at one thread: packed where built), beside the caller, which reads and checks the next weights meanwhile
    (so briefly one thread more than the count: on 2 cores a pool of one gained little, 0.98 -> 0.96 s against 0.73
    s with two); all are packed when the block ends. Packing (``quantized::linear_prepack``, which lets go of
    the GIL) is most of an int8 start-up (Marian: 0.69 s of 1.17 s, one weight at a time) and runs on one thread
    under either engine (docs/EXPERIMENTS.md, "int8 weight cache"). Each weight's packed matrix is its own: the
    bits are those packed one at a time. An error (a pack's, or the block's) cancels the packs not started."""
    workers = torch.get_num_threads()
    if workers < 2:
        yield
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="seqgen-int8-pack") as pool:
        packing = _Packing(pool, threading.BoundedSemaphore(2 * workers))
        token = _PACKING.set(packing)
        try:
            yield
            for future in packing.futures:
                future.result()  # the first error, if any
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            _PACKING.reset(token)


def dynamic_linear(qweight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """torch's dynamic-quantized ``Linear`` over ``qweight`` (packed here, or by the pool of
    :func:`packing_in_threads` when one is open) and a float32 ``bias``: what ``from_float`` builds, without first
    packing an all-zero weight of the full size (its constructor's)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    with torch.no_grad(), _quiet():
        module = DynamicLinear(1, 1, bias_=False)
    module.out_features, module.in_features = (int(n) for n in qweight.shape)
    packing = _PACKING.get()
    if packing is None:
        _pack(module, qweight, bias)
    else:
        packing.submit(module, qweight, bias)
    return module


BLOCK_BYTES = 8 * 2**20  # under fbgemm, an int8 weight of more bytes is packed and run in blocks of at most this many


def block_rows(cols: int) -> int:
    """Rows of a :class:`BlockedInt8Linear` block over ``cols`` input features (``BLOCK_BYTES`` of int8)."""
    return max(1, BLOCK_BYTES // cols)


def in_blocks(qweight: torch.Tensor) -> bool:
    """Whether ``qweight`` is packed and run in blocks (:class:`BlockedInt8Linear`): over ``BLOCK_BYTES`` under
    fbgemm (torch's ``x86`` engine), whose packing slows down past a few MiB. oneDNN's engine packed a whole LM head
    about as fast as in blocks (one pack each on an AVX2 CPU, docs/EXPERIMENTS.md, "CPU int8: a large head in
    blocks"), so it runs one product: no block's output copied into the logits."""
    return qweight.numel() > BLOCK_BYTES and torch.backends.quantized.engine in ("x86", "fbgemm")


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A dynamic-quantized copy of ``x -> x @ weight.T + bias`` (per-channel qint8 weight, float32 ``bias``),
    the quantized weight taken from the disk cache (:mod:`~seqgen_cli.models.int8_cache`) when a session is
    open and holds it. A strided view (GPT-2's transposed Conv1D weight) is made contiguous first: the cache
    names and stores a weight by its row-major values. A large weight under fbgemm (an LM head, :func:`in_blocks`) is
    a :class:`BlockedInt8Linear`. Once packed, the pages of ``weight`` read from the checkpoint's mapped
    file are given back (:mod:`~seqgen_cli.models.resident`; the cache gives back its own)."""
    qweight = quantized(weight.detach().contiguous(), quantize_weight)
    bias = None if bias is None else bias.detach().float()
    module = BlockedInt8Linear(qweight, bias) if in_blocks(qweight) else dynamic_linear(qweight, bias)
    release([weight])
    return module


class BlockedInt8Linear(DynamicLinear):
    """A dynamic-quantized linear map run as blocks of output rows (``block_rows``: ``BLOCK_BYTES`` of int8 each),
    each its own fbgemm product, the outputs concatenated. The same bits as one product: every block quantizes the
    same input with the same scale (per tensor, from its minimum and maximum) and an output column depends only on
    its weight row. fbgemm's packing slows down past a few MiB a weight: it packs a 256k x 1024 weight in ~3 s as
    one and ~0.7 s as 8,192-row blocks (NLLB's LM head), Marian's 58k x 512 head in 0.28 s as one and 0.10 s as
    blocks (the 2-core EPYC of docs/EXPERIMENTS.md, "CPU int8: a large head in blocks")."""

    def __init__(self, qweight: torch.Tensor, bias: torch.Tensor | None) -> None:
        with torch.no_grad(), _quiet():
            super().__init__(1, 1, bias_=False)
        self.rows = rows = block_rows(qweight.shape[1])
        self.blocks = nn.ModuleList(
            dynamic_linear(qweight[i : i + rows], None if bias is None else bias[i : i + rows])
            for i in range(0, qweight.shape[0], rows)
        )
        self.qweight, self.full_bias = qweight, bias
        self.out_features, self.in_features = (int(n) for n in qweight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((*x.shape[:-1], self.out_features))  # [..., O]; one block's product alive at a time
        for i, block in enumerate(self.blocks):
            out[..., i * self.rows : (i + 1) * self.rows] = block(x)
        return out

    def _weight_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.qweight, self.full_bias


class _Int8Linear:
    """``quantize_dynamic``'s target for ``nn.Linear``: :func:`int8_linear` over the float module's tensors."""

    @classmethod
    def from_float(cls, mod: nn.Module) -> nn.Module:
        return int8_linear(mod.weight, mod.bias)


def quantize_linears(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` (in place) by its dynamic-quantized int8 version
    (:func:`int8_linear`); torch's ``quantize_dynamic`` finds them and moves their hooks."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with torch.no_grad(), _quiet():
        return quantize_dynamic(
            module,
            {nn.Linear: per_channel_dynamic_qconfig},
            dtype=torch.qint8,
            mapping={nn.Linear: _Int8Linear},
            inplace=True,
        )


def is_quantized(module: object) -> bool:
    """Whether ``module`` is a dynamic-quantized linear layer."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return isinstance(module, DynamicLinear)


def out_features(module: nn.Module) -> int:
    """Output width of a linear layer, float or quantized (whose ``weight`` is a method)."""
    weight = module.weight
    return int((weight() if callable(weight) else weight).shape[0])
