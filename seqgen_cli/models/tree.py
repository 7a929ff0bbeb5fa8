"""The base of seqgen's own module trees (each family file's ``Tree``, read by ``own_model.load``): a checkpoint as
the fast backend reads a transformers model, named as transformers names it, without importing transformers' model
classes (their import costs 1.0-1.4 s of a CPU process)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation`` (the tanh approximation, its operations in its order)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS = {  # ACT2FN's
    "gelu": F.gelu,
    "relu": F.relu,
    "swish": F.silu,
    "silu": F.silu,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


@dataclass
class EncoderOutput:
    last_hidden_state: torch.Tensor  # [B, S, D]


class OwnSeq2Seq(nn.Module):
    """A checkpoint as the fast backend reads a transformers model: ``config``, ``generation_config``,
    ``name_or_path``, the encoder and decoder (at ``ENCODER`` / ``DECODER``), ``lm_head``. A tree defines its
    modules, ``ties`` (transformers' tied weights: target -> source), ``complete`` (what the checkpoint need not
    hold), ``finish`` (what is made after the weights are in) and ``ATTENTION`` (the attention implementation its
    encoder writes: a config asking for another is loaded by transformers)."""

    ENCODER, DECODER = "model.encoder", "model.decoder"
    ATTENTION = "sdpa"
    lm_head: nn.Linear

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config, self.generation_config, self.name_or_path = config, None, ""

    def ties(self) -> dict[str, str]:
        return {}

    def complete(self, tensors: dict[str, torch.Tensor]) -> None:
        """Add to (or drop from) the checkpoint's ``tensors`` what transformers makes (or ignores) on loading."""

    def finish(self) -> None:
        """After the weights are in: what is made rather than loaded."""

    def get_encoder(self) -> nn.Module:
        return self.get_submodule(self.ENCODER)

    def get_decoder(self) -> nn.Module:
        return self.get_submodule(self.DECODER)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding without its random initialisation (its weight is the checkpoint's; on the meta device the
    initialisation would import ``torch._dynamo``, ~1 s)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
