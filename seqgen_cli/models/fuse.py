"""Fuse linear layers that read the same input into one matmul without a second copy of their weights."""

from __future__ import annotations

import torch
from torch import nn

from seqgen_cli.models.resident import release


@torch.no_grad()
def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate ``linears`` (same input width) into one ``[sum(out), in]`` weight (and bias).

    The modules' own parameters are then re-pointed at slices of the fused tensor, so the model keeps
    working, unchanged in value, and the weights exist once. Idempotent: already-fused layers are reused.
    """
    weights = [lin.weight for lin in linears]
    first = weights[0]
    rows = sum(w.shape[0] for w in weights)
    if _are_adjacent_views(weights):
        fused_w = first.data.as_strided((rows, first.shape[1]), first.stride(), first.storage_offset())
    else:
        fused_w = torch.cat([w.data for w in weights], dim=0)  # [sum(out), in]
        _repoint([lin.weight for lin in linears], fused_w)
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases):
        return fused_w, None
    if _are_adjacent_views(biases):
        fused_b = biases[0].data.as_strided((rows,), (1,), biases[0].storage_offset())
    else:
        fused_b = torch.cat([b.data for b in biases], dim=0)  # [sum(out)]
        _repoint(biases, fused_b)
    return fused_w, fused_b


@torch.no_grad()
def concat_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linears``' weights (and biases) concatenated, the modules left as they are: a temporary to make one
    int8 copy of (``--dtype int8``), after which the backend releases the modules' pages (``resident.py``)."""
    weight = torch.cat([lin.weight.data for lin in linears], dim=0)  # [sum(out), in]
    biases = [lin.bias for lin in linears]
    return weight, None if any(b is None for b in biases) else torch.cat([b.data for b in biases], dim=0)


def _repoint(params: list[nn.Parameter], fused: torch.Tensor) -> None:
    """Point ``params`` at consecutive slices of ``fused``; the pages of the checkpoint's copies they held are
    given back (``resident.py``)."""
    start = 0
    for p in params:
        old, p.data = p.data, fused[start : start + p.shape[0]]
        release([old])
        start += p.shape[0]


def _are_adjacent_views(params: list[torch.Tensor]) -> bool:
    """True when ``params`` are contiguous, back to back in one storage (a previous fusion)."""
    first = params[0]
    ptr = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p in params:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True
