"""``--dtype int8`` on the CPU: torch's dynamic quantization (``torch.ao.nn.quantized.dynamic.Linear``).

Weights are stored as int8 with one scale per output row (per-channel, as CTranslate2's int8); activations
are quantized per row at run time, the product runs in int8 (fbgemm under torch's ``x86`` engine) and comes
back as float32. Everything that is not a linear layer (embeddings, norms, attention, the search) stays
float32. torch's ``torch.ao.quantization`` namespace is deprecated in favour of torchao, but torchao has no
fast eager CPU kernel for int8 dynamic activations (see docs/BENCHMARKS.md, "CPU int8"), so this uses the
torch one and silences its deprecation warnings.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

Linear = Callable[[torch.Tensor], torch.Tensor]


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.ao\.")
        yield


def linear(weight: torch.Tensor, bias: torch.Tensor | None, int8: bool = False) -> Linear:
    """``x -> x @ weight.T + bias``: float32 as ``F.linear(x, weight, bias)`` (the same call, bit for bit), or
    with ``int8`` a dynamic-quantized copy of ``weight`` (per-channel qint8; ``bias`` stays float32)."""
    if not int8:
        return partial(F.linear, weight=weight, bias=bias)
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    out_features, in_features = weight.shape
    with torch.no_grad(), _quiet():
        float_linear = nn.Linear(in_features, out_features, bias=bias is not None)
        float_linear.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
        if bias is not None:
            float_linear.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
        float_linear.qconfig = per_channel_dynamic_qconfig
        return DynamicLinear.from_float(float_linear)


def lm_head(weight: torch.Tensor, bias: torch.Tensor | None, int8: bool = False) -> Linear:
    """The LM head ``x -> x @ weight.T + bias`` ([N, D] -> [N, V]) as :func:`linear`, except in float32 on the
    CPU: there it keeps a contiguous transposed copy of ``weight`` ([D, V]), on which MKL's GEMM runs this
    wide product 5-25 % faster than on ``weight`` (docs/BENCHMARKS.md, "CPU float32: where a step goes"),
    for one more copy of the matrix in memory."""
    if int8 or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return linear(weight, bias, int8)
    with torch.no_grad():
        wt = weight.t().contiguous()  # [V, D] -> [D, V]
    if bias is None:
        return partial(torch.mm, mat2=wt)
    return partial(torch.addmm, bias.detach(), mat2=wt)


def quantize_linears(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` (in place) by its dynamic-quantized int8 version."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with torch.no_grad(), _quiet():
        return quantize_dynamic(
            module, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )


def is_quantized(module: object) -> bool:
    """Whether ``module`` is a dynamic-quantized linear layer."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return isinstance(module, DynamicLinear)


def out_features(module: nn.Module) -> int:
    """Output width of a linear layer, float or quantized (whose ``weight`` is a method)."""
    weight = module.weight
    return int((weight() if callable(weight) else weight).shape[0])
