"""What a batch holds on the device beyond its caches and logits rows, counted from shapes alone.

``Generator.batch_bytes`` = the backend's ``cache_bytes`` + ``N * V * LOGIT_BYTES`` (the logits rows: logits,
log-probs, processed scores, float32) + :func:`extra_bytes`, the sum of three upper estimates (``B`` inputs of
``S`` tokens, ``R`` rows per input, ``N = B * R`` rows, ``T`` new-token positions, ``V`` the vocabulary, ``e`` the
compute dtype's item size; on the captured path ``B``, ``S`` and ``T`` are the padded shape's, as its caches):

* :func:`encoder_bytes` (encoder-decoder models): the peak of the encoder over ``[B, S]``, held beside the caches
  while ``start`` fills them. Counted as transformers' *eager* attention materialises it (BART family and T5,
  ``eager_attention_forward``): two ``[B, H, S, S]`` score tensors at once in the compute dtype (the scores and
  their softmax), and the softmax kept as the layer's attention weights through its feed-forward; T5 adds the
  ``[B, H, S, S]`` position-bias mask that its ``sdpa`` path builds. ``sdpa`` materialises at most as much (its
  math fallback the same; the fused kernels none), so this is an upper estimate for either.
* :func:`search_bytes`: what the search holds and makes per step beyond the ``[N, V]`` rows (``search/beam.py``,
  ``search/rows.py``, ``search/greedy.py``, ``search/sampling.py``): the token history ``[N, length]`` and the n-gram
  keys ``[N, L + 1]`` (int64, twice: a reorder's ``index_select`` copy beside the old), the finished hypotheses
  ``[B, K, T]`` (int64, four at once while a step merges them), the top-k over ``[B, K * V]`` (chunk maxima, the
  gathered chunks, tied rows' reduced copies: ``beam.wide_topk_bytes``; ``[B, C]`` candidates); sampling's draw (probabilities, exponential clocks, their ratio) and
  its warpers' ``[N, V]`` copies (top-k, top-p's sort).
* :func:`graph_pool_bytes` (CUDA graphs only): the private memory pool of the step's graphs, approximated as one
  decode step's activations at the padded shape (a graph keeps its intermediates' memory for its replays).

The budget these counts are held to is ``budget.DeviceBudget``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from seqgen_cli.batching import LOGIT_BYTES
from seqgen_cli.models.generic import config_int

CANDIDATE_BYTES = 64  # per top-k candidate: its score, index, beam, token, flags and running copies


@dataclass(frozen=True)
class Dims:
    """A transformer stack's sizes, read off the model's config (names vary by family)."""

    hidden: int  # D
    heads: int  # H
    inner: int  # the attention's query / key / value width: H * d (T5: num_heads * d_kv)
    ffn: int  # F
    position_bias: bool  # T5's relative position bias

    @classmethod
    def of(cls, config: Any, part: str) -> Dims | None:
        """The ``part`` (``encoder`` or ``decoder``) stack of ``config`` (T5Gemma / T5Gemma 2: its config of that part);
        ``None`` where it does not say."""
        sub = getattr(config, part, None)
        sub = getattr(sub, "text_config", None) or sub  # T5Gemma 2's encoder: its text stack's
        config = sub if hasattr(sub, "to_dict") else config
        hidden = config_int(config, "d_model", "hidden_size", "n_embd")
        heads = config_int(config, f"{part}_attention_heads", "num_heads", "num_attention_heads", "n_head")
        if hidden is None or heads is None:
            return None
        ffn = config_int(config, f"{part}_ffn_dim", "d_ff", "intermediate_size", "n_inner") or 4 * hidden
        d_kv = config_int(config, "d_kv", "head_dim")
        return cls(
            hidden=hidden,
            heads=heads,
            inner=heads * d_kv if d_kv else hidden,
            ffn=ffn,
            position_bias=hasattr(config, "relative_attention_num_buckets"),
        )


def encoder_bytes(dims: Dims, inputs: int, width: int, itemsize: int) -> int:
    """Peak bytes of an encoder's activations over ``inputs`` sources of ``width`` tokens (an upper estimate,
    module docstring). Held through the layers: the embeddings, a layer's input and its residual, the
    ``[B, 1, S, S]`` mask (T5: its ``[1, H, S, S]`` position bias). Then the larger of a layer's attention (q, k, v,
    the context and its contiguous copy; two score tensors, T5 a third) and its feed-forward (the attention weights,
    kept; four ``[B, S, F]``: a composite activation such as ``gelu_new`` holds its input and three temporaries, a
    gated one as many; the norm's two, in float32 at most)."""
    b, s, e, d = inputs, width, itemsize, dims
    scores = b * d.heads * s * s * e  # [B, H, S, S]
    held = 3 * b * s * d.hidden * e + b * s * s * e + (d.heads * s * s * e if d.position_bias else 0)
    attention = 5 * b * s * d.inner * e + (3 if d.position_bias else 2) * scores
    feed_forward = scores + 4 * b * s * d.ffn * e + 2 * b * s * d.hidden * max(e, 4)
    return held + max(attention, feed_forward)


@dataclass(frozen=True)
class SearchDims:
    """What sizes the search's buffers: the mode and the settings that add buffers."""

    mode: str  # greedy, beam or sample
    num_beams: int  # K
    candidates: int  # C: beam search's top-k candidates per input, max(2, 1 + EOS ids) * K
    ngrams: bool  # no_repeat_ngram_size: the packed n-gram keys
    top_k: bool  # sampling's top-k warper
    top_p: bool  # sampling's top-p warper

    @classmethod
    def of(cls, config: Any) -> SearchDims:
        """From a merged ``GenerationConfig`` (unset fields take ``generate()``'s defaults)."""
        from seqgen_cli.search.settings import setting

        k = setting(config, "num_beams")
        eos = config.eos_token_id
        n_eos = 0 if eos is None else 1 if isinstance(eos, int) else len(eos)
        return cls(
            mode="beam" if k > 1 else "sample" if setting(config, "do_sample") else "greedy",
            num_beams=k,
            candidates=max(2, 1 + n_eos) * k,
            ngrams=setting(config, "no_repeat_ngram_size") > 0,
            top_k=bool(setting(config, "top_k")),
            top_p=setting(config, "top_p") < 1.0,
        )


def search_bytes(
    search: SearchDims, inputs: int, rows: int, history: int, positions: int, vocab: int, cpu: bool = True
) -> int:
    """Bytes the search holds and makes per step beyond the ``[N, V]`` logits rows, for ``inputs`` inputs of
    ``rows`` rows in all, ``history`` decoder positions (prompt and new tokens), ``positions`` new tokens and ``vocab``
    entries: history and n-gram keys (twice, a reorder's copy), beam search's finished hypotheses (four at once)
    and top-k (on the ``cpu`` with tied rows' reduced copies), sampling's draw and warpers."""
    from seqgen_cli.search.beam import wide_topk_bytes  # the chunks' top-k; a GPU's torch.topk makes less

    s, n, v = search, rows, vocab
    total = 2 * n * history * 8 + (2 * n * (history + 1) * 8 if s.ngrams else 0)
    if s.mode == "beam":
        c, kv = s.candidates, s.num_beams * vocab
        total += 4 * inputs * s.num_beams * positions * 8  # fin_tokens, merge candidates, gather, result
        total += inputs * (wide_topk_bytes(c, kv, ties=cpu) + c * CANDIDATE_BYTES)  # [B, K * V] top-k
    elif s.mode == "sample":
        total += 3 * n * v * 4  # probabilities, exponential clocks, their ratio
        total += n * v * 5 if s.top_k else 0  # the kept scores and the bool mask
        total += n * v * 22 if s.top_p else 0  # sorted scores, their indices, softmax, cumsum, two masks
    return total


def graph_pool_bytes(
    dims: Dims, inputs: int, rows_per_input: int, width: int, positions: int, vocab: int, itemsize: int
) -> int:
    """The CUDA graphs' private pool for ``inputs`` inputs of ``rows_per_input`` rows attending ``width`` source
    (prompt) positions and ``positions`` new-token positions, approximated as one decode step's activations: a
    layer's hidden states, q/k/v and the context, the feed-forward; the float32 attention scores and their softmax
    (and its cast) over the source and over the positions of all the input's rows (a beam scores its input's
    ``positions * R`` keys under the back-pointers' mask, float32, held through the layers); the logits the graph
    returns."""
    e, d, r = itemsize, dims, rows_per_input
    rows = inputs * r
    hidden = rows * e * (4 * d.hidden + 4 * d.inner + 3 * d.ffn + vocab)
    return hidden + rows * d.heads * (width + positions * r) * (8 + e) + rows * positions * r * 5


def extra_bytes(
    backend: Any, model: Any, config: Any, inputs: int, width: int, rows_per_input: int, new_tokens: int
) -> int:
    """What a batch of ``inputs`` inputs padded to ``width`` tokens holds beside its caches and logits rows: the
    encoder's peak, the search's buffers and, under CUDA graphs, their pool (module docstring). ``backend``: the
    model backend that runs it: one that pads a batch to a graph shape (a ``CapturedBackend``) says how,
    ``padded_shape``, as its ``cache_bytes`` counts it)."""
    mcfg, padded_shape = model.config, getattr(backend, "padded_shape", None)
    captured = padded_shape is not None
    if captured:
        inputs, width, new_tokens = padded_shape(inputs, width, new_tokens)
    e, rows = model.dtype.itemsize, inputs * rows_per_input
    enc = Dims.of(mcfg, "encoder") if mcfg.is_encoder_decoder else None
    total = 0 if enc is None else encoder_bytes(enc, inputs, width, e)
    history = (1 if mcfg.is_encoder_decoder else width) + new_tokens
    cpu = model.device.type == "cpu"  # where the search runs wide_topk
    total += search_bytes(SearchDims.of(config), inputs, rows, history, new_tokens, backend.vocab_size, cpu)
    dec = Dims.of(mcfg, "decoder")
    if captured and backend.device.type == "cuda" and dec is not None:
        total += graph_pool_bytes(dec, inputs, rows_per_input, width, new_tokens, backend.vocab_size, e)
    return total


def batch_bytes(
    backend: Any, model: Any, config: Any, inputs: int, width: int, rows_per_input: int, new_tokens: int
) -> int | None:
    """``Generator.batch_bytes``: ``backend``'s ``cache_bytes``, the logits rows (``LOGIT_BYTES`` per row and
    vocabulary entry) and :func:`extra_bytes`; ``None`` when the backend cannot say what its caches hold."""
    caches = backend.cache_bytes(inputs, width, rows_per_input, new_tokens)
    if caches is None:
        return None
    logits = inputs * rows_per_input * backend.vocab_size * LOGIT_BYTES
    return caches + logits + extra_bytes(backend, model, config, inputs, width, rows_per_input, new_tokens)
