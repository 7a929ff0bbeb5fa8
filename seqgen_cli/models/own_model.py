"""The BART family (BART, mBART, Marian, Pegasus, M2M-100 / NLLB) without transformers' model classes: a checkpoint's
``config.json``, ``generation_config.json`` and safetensors read straight into a module tree named as transformers
names it, so that :class:`~seqgen_cli.models.encoder_decoder.EncoderDecoderBackend` reads it as it reads
transformers' model; its encoder runs here.

Why: importing a transformers model class costs 1.0-1.4 s of a CPU process (``torch.distributed.tensor``,
``torch._dynamo``, the loss functions; docs/BENCHMARKS.md, "Start-up and small jobs against CTranslate2"), more than
a small job decodes. :func:`load` is used for the fast engine on the CPU in float32 and int8 only; ``generate()``
(``--backend hf``, ``--verify``, the benchmarks' reference) gets transformers' model (``Loaded.reference``).

Exactness: the encoder runs transformers' operations in transformers' order (``scaled_dot_product_attention`` with
its boolean padding mask, the same additions and norms), so its output is bit-identical, and every weight is the
checkpoint's tensor, tied as transformers ties it (tests/test_own_model.py). A checkpoint it does not read the same
way returns ``None`` from :func:`load`, with the reason, and transformers loads it: a key it does not expect or lacks,
no safetensors, an activation or attention implementation it does not have.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from seqgen_cli.models.families import FAMILIES, Seq2Seq

OWN_FAMILIES = ("bart", "mbart", "marian", "pegasus", "m2m_100")
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "swish": F.silu, "silu": F.silu}  # transformers' ACT2FN, these
SINUSOIDS = ("marian", "pegasus")  # position tables made from a formula where the checkpoint has none


@dataclass
class EncoderOutput:
    last_hidden_state: torch.Tensor  # [B, S, D]


class Attention(nn.Module):
    """BART-named attention projections; :meth:`forward` is the encoder's self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.head_dim = dim // heads
        self.scaling = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, S, D], ``mask`` [B, 1, S, S] bool (True: attend) or ``None`` -> [B, S, D]."""
        b, s, _ = x.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # [B, S, D] -> [B, H, S, d]
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling)
        out = out.transpose(1, 2).contiguous()  # [B, H, S, d] -> [B, S, H, d]
        return self.out_proj(out.reshape(b, s, -1).contiguous())  # [B, S, D]


class Layer(nn.Module):
    """An encoder layer (:meth:`forward`) or, with ``cross``, a decoder layer (read by ``families.bart_layer``)."""

    def __init__(self, dim: int, heads: int, ffn: int, act: str, pre_norm: bool, cross: bool = False) -> None:
        super().__init__()
        self.self_attn, self.self_attn_layer_norm = Attention(dim, heads), nn.LayerNorm(dim)
        if cross:
            self.encoder_attn, self.encoder_attn_layer_norm = Attention(dim, heads), nn.LayerNorm(dim)
        self.fc1, self.fc2, self.final_layer_norm = nn.Linear(dim, ffn), nn.Linear(ffn, dim), nn.LayerNorm(dim)
        self.activation_fn, self.pre_norm = ACTIVATIONS[act], pre_norm

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[B, S, D] -> [B, S, D]: attention, then the feed-forward, each norm before (mBART, Pegasus, M2M-100)
        or after its residual sum (BART, Marian)."""
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
            return x + self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.self_attn(x, mask))
        return self.final_layer_norm(x + self.fc2(self.activation_fn(self.fc1(x))))


class Positions(nn.Module):
    """A stack's absolute positions: ``table`` (BART, mBART: learned, ``offset`` 2; Marian, Pegasus: sinusoids
    from 0) as ``weight``, or M2M-100's sinusoids as ``weights`` with a zero row at ``padding_idx`` and positions
    counted over non-padding tokens from ``padding_idx + 1``."""

    def __init__(self, rows: int, dim: int, offset: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.offset, self.padding_idx = offset, padding_idx
        if padding_idx is None:
            self.weight = nn.Parameter(torch.empty(rows + offset, dim), requires_grad=False)
        else:  # not in checkpoints: made here, as M2M100SinusoidalPositionalEmbedding.get_embedding makes it
            self.register_buffer("weights", padded_sinusoids(rows + offset, dim, padding_idx), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] ids -> the positions to add: [B, S, D] (padded) or [S, D]."""
        if self.padding_idx is None:
            at = torch.arange(input_ids.shape[1], device=input_ids.device) + self.offset  # [S]
            return self.weight.index_select(0, at)
        mask = input_ids.ne(self.padding_idx).int()  # [B, S]
        at = torch.cumsum(mask, dim=1).type_as(mask) * mask + self.padding_idx  # pads keep padding_idx
        b, s = input_ids.shape
        if self.padding_idx + 1 + s > self.weights.shape[0]:  # grows on demand, as transformers' module does
            rows = self.padding_idx + 1 + s + self.offset
            self.weights = padded_sinusoids(rows, self.weights.shape[1], self.padding_idx).to(self.weights)
        return self.weights.index_select(0, at.long().view(-1)).view(b, s, -1)


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding without its random initialisation (its weight is the checkpoint's; on the meta device the
    initialisation would import ``torch._dynamo``, ~1 s)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


def padded_sinusoids(rows: int, dim: int, padding_idx: int) -> torch.Tensor:
    """M2M-100's (fairseq's) sinusoids: [rows, dim], sin | cos halves, zeros at ``padding_idx``."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)  # [D/2]
    angle = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)  # [rows, D/2]
    table = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).view(rows, -1)  # [rows, D (-1)]
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    table[padding_idx, :] = 0
    return table


class Stack(nn.Module):
    """An encoder (:meth:`forward`) or a decoder (its parts, read by the fast backend)."""

    def __init__(self, cfg: Any, family: Seq2Seq, decoder: bool) -> None:
        super().__init__()
        side = "decoder" if decoder else "encoder"
        dim, heads = cfg.d_model, getattr(cfg, f"{side}_attention_heads")
        ffn, count = getattr(cfg, f"{side}_ffn_dim"), getattr(cfg, f"{side}_layers")
        self.embed_tokens = embedding(getattr(cfg, f"{side}_vocab_size", None) or cfg.vocab_size, dim)
        self.embed_scale = math.sqrt(dim) if cfg.scale_embedding else 1.0
        padded = family.positions == "padded table"
        offset = 2 if cfg.model_type in ("bart", "mbart") or padded else 0
        self.embed_positions = Positions(cfg.max_position_embeddings, dim, offset, cfg.pad_token_id if padded else None)
        act, pre = cfg.activation_function, family.pre_norm
        self.layers = nn.ModuleList(Layer(dim, heads, ffn, act, pre, cross=decoder) for _ in range(count))
        self.norms = (family.embedding_norm, family.final_norm)  # by transformers' attribute names
        for name in self.norms:
            if name:
                setattr(self, name, nn.LayerNorm(dim))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_dict: bool = True
    ) -> EncoderOutput:
        """The encoder: [B, S] ids and mask -> ``last_hidden_state`` [B, S, D]."""
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids) * self.embed_scale  # [B, S, D]
        x = x + self.embed_positions(input_ids)
        first, last = (getattr(self, name) if name else None for name in self.norms)
        if first is not None:
            x = first(x)
        mask = None  # transformers' sdpa mask: none without padding, else [B, 1, S, S] True where a key is a token
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.bool()[:, None, None, :].expand(b, 1, s, s)
        for layer in self.layers:
            x = layer(x, mask)
        if last is not None:
            x = last(x)
        return EncoderOutput(x)


class OwnSeq2Seq(nn.Module):
    """A BART-family checkpoint as the fast backend reads a transformers model: ``config``, ``generation_config``,
    ``name_or_path``, ``model.encoder`` / ``model.decoder``, ``lm_head``, ``final_logits_bias``."""

    def __init__(self, config: Any, generation_config: Any, name_or_path: str) -> None:
        super().__init__()
        family = FAMILIES[config.model_type]
        assert isinstance(family, Seq2Seq)
        self.config, self.generation_config, self.name_or_path = config, generation_config, name_or_path
        dim = config.d_model
        self.model = nn.Module()
        if sharing(config):
            self.model.shared = embedding(config.vocab_size, dim)
        self.model.encoder = Stack(config, family, decoder=False)
        self.model.decoder = Stack(config, family, decoder=True)
        vocab = self.model.decoder.embed_tokens.num_embeddings
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if config.model_type != "m2m_100":
            self.register_buffer("final_logits_bias", torch.zeros(1, vocab))

    def get_encoder(self) -> nn.Module:
        return self.model.encoder

    def get_decoder(self) -> nn.Module:
        return self.model.decoder

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


def sharing(config: Any) -> bool:
    """Whether encoder and decoder take their token embeddings from ``model.shared`` (all but Marian's
    ``share_encoder_decoder_embeddings=False``)."""
    return config.model_type != "marian" or bool(getattr(config, "share_encoder_decoder_embeddings", True))


def tied(config: Any) -> dict[str, str]:
    """transformers' tied weights for ``config`` (target -> source), none without ``tie_word_embeddings``."""
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    if not sharing(config):
        return {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    return {
        "lm_head.weight": "model.shared.weight",
        "model.encoder.embed_tokens.weight": "model.shared.weight",
        "model.decoder.embed_tokens.weight": "model.shared.weight",
    }


def read_safetensors(folder: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of the folder's safetensors (one file or an index of shards), as views of the mapped files;
    ``None`` where there are none."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors


def refusal(config: Any) -> str | None:
    """Why :func:`load` does not build this model (transformers loads it), or ``None``."""
    if config.model_type not in OWN_FAMILIES:
        return f"model_type {config.model_type!r} has no own module tree"
    if config.activation_function not in ACTIVATIONS:
        return f"activation {config.activation_function!r} is not written here"
    if getattr(config, "_attn_implementation_internal", None) not in (None, "sdpa"):
        return "an attention implementation other than sdpa"
    if config.d_model % config.encoder_attention_heads or config.d_model % config.decoder_attention_heads:
        return "d_model not divisible by the heads"
    return None


def load(source: str, config: Any) -> tuple[OwnSeq2Seq | None, str | None]:
    """The checkpoint folder ``source`` as an :class:`OwnSeq2Seq` in float32 on the CPU, eval mode, or ``None`` and
    why transformers should load it instead."""
    reason = refusal(config)
    folder = Path(source)
    try:
        tensors = None if reason or not folder.is_dir() else read_safetensors(folder)
    except Exception as err:  # noqa: BLE001 - safetensors' errors: transformers names them for the user
        return None, f"{type(err).__name__}: {err}"
    if reason or tensors is None:
        return None, reason or "no safetensors in the folder"
    with torch.device("meta"):
        model = OwnSeq2Seq(config, generation_config(source), source)
    expected = model.state_dict().keys()
    ties = tied(config)
    for target, src in ties.items():  # transformers' tie: the source's tensor, whatever the target holds
        if src in tensors:
            tensors[target] = tensors[src]
    if "final_logits_bias" not in tensors and "final_logits_bias" in expected:
        tensors["final_logits_bias"] = torch.zeros(1, model.lm_head.out_features)
    for side in ("encoder", "decoder") if config.model_type in SINUSOIDS else ():
        key = f"model.{side}.embed_positions.weight"
        if key not in tensors:
            tensors[key] = sinusoids(config.max_position_embeddings, config.d_model)
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        names = sorted(missing) or sorted(unexpected)
        return None, f"{'missing' if missing else 'unexpected'} weights ({names[0]}, ...)"
    floats = {k: t if t.dtype == torch.float32 else t.float() for k, t in tensors.items()}
    try:
        model.load_state_dict(floats, strict=True, assign=True)
    except RuntimeError as err:  # a shape the config does not give
        return None, str(err).strip().splitlines()[-1].strip()
    for target, src in ties.items():  # one Parameter, as transformers' tied modules hold
        owner, name = target.rsplit(".", 1)
        setattr(model.get_submodule(owner), name, model.get_parameter(src))
    for stack in (model.model.encoder, model.model.decoder):  # made on the meta device: made again here
        pos = stack.embed_positions
        if pos.padding_idx is not None:
            pos.weights = padded_sinusoids(pos.weights.shape[0], config.d_model, pos.padding_idx)
    return model.eval().requires_grad_(False), None


def sinusoids(rows: int, dim: int) -> torch.Tensor:
    """Marian's and Pegasus's position table (transformers' ``create_weight``, vectorised: loading.sinusoid_table)."""
    from seqgen_cli.loading import sinusoid_table

    with torch.device("meta"):
        shape = embedding(rows, dim)  # sinusoid_table reads its shape and dtype
    return sinusoid_table(shape)


def generation_config(source: str) -> Any:
    """The checkpoint's generation settings as ``from_pretrained`` sets them: ``generation_config.json``, else
    those of ``config.json``."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except OSError:
        return GenerationConfig.from_pretrained(source, config_file_name="config.json", _from_model_config=True)
