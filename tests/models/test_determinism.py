"""The bytes of an output depend on its input and the settings only (CPU float32).

Not on the batch size, the token budget, the sort window, a shard, the thread count, the reader's timing or
which inputs share a batch or leave it first. Three layers: the products (a row's bits whatever the rows beside
it), the model backends (an input's logits alone, among neighbours, after they leave) and the CLI (120 lines
through many batchings against each input run alone), the last on tiny checkpoints whose LM head rows come
in near-identical pairs, so that every step is a near-tie and any change of arithmetic shows in the text.
``--dtype int8`` does not hold (activations are quantized per tensor): an expected failure that says so.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from seqgen_cli.batching import Encoded
from seqgen_cli.generator import Generator
from seqgen_cli.models import linear_maps
from seqgen_cli.models.attention import attention
from seqgen_cli.pipeline.reader import ReaderStage
from seqgen_cli.pipeline.records import Record
from seqgen_cli.shapes import CROSS_CHUNK, input_width
from tests.helpers import seqgen
from tests.models.neighbours import check_neighbours
from tests.tiny_models import copy_checkpoint, sample_texts

FAST_FAMILIES = ("bart", "marian", "pegasus", "t5", "gpt2", "llama")


# -- products -------------------------------------------------------------------------------------------------


def test_input_width_depends_on_the_length_only_and_pads_little() -> None:
    previous = 0
    for n in range(1, 5000):
        w = input_width(n)
        assert w >= n and w % 8 == 0 and w >= previous
        assert input_width(w) == w  # a bucket's bound is its own bucket
        assert w - n < max(8, n / 8)  # under 8 tokens or 12.5 %
        previous = w


# AMX's bf16 tiles (oneDNN's ``brg_matmul:avx10_1_512_amx``) sum a row's inner dimension in an order that depends on
# the row count and the threads for these two shapes, measured on a 2-core Intel Xeon with AMX (every run): bf16 keeps
# a row's bits whatever its neighbours on AVX-512 BF16 and not on AMX (docs/ARCHITECTURE.md, "Products").
AMX = "amx_bf16" in linear_maps.cpu_flags()
AMX_BATCH_DEPENDENT = {(2048, 48), (512, 512)}


def _product_cases() -> list:
    cases = []
    for inputs, outputs in [(2048, 48), (48, 600), (512, 512)]:
        for dtype in linear_maps.ONEDNN_DTYPES:
            dependent = AMX and dtype == torch.bfloat16 and (inputs, outputs) in AMX_BATCH_DEPENDENT
            reason = "bf16 on AMX: a row's bits depend on the row count and threads (ARCHITECTURE, Products)"
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if dependent else []
            cases.append(pytest.param(inputs, outputs, dtype, marks=marks, id=f"{inputs}-{outputs}-{dtype}"))
    return cases


@pytest.mark.skipif(not linear_maps.ONEDNN, reason="torch built without oneDNN")
@pytest.mark.parametrize(("inputs", "outputs", "dtype"), _product_cases())
def test_a_rows_product_does_not_depend_on_the_other_rows_or_threads(
    inputs: int, outputs: int, dtype: torch.dtype
) -> None:
    """Rows ``a:a+m`` of a product equal those rows of the whole product, for any ``m`` (1 included, beyond
    1024 too) and offset ``a``, at 1-3 threads: ``dense`` and ``PackedLinear`` (dense, then packed weight) for
    [N, D] inputs and [B, S, D] inputs (whole sources), in every dtype oneDNN runs here; bf16 on AMX is an
    expected failure for the shapes where it was measured to fail."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(outputs, inputs, generator=g) / inputs**0.5, torch.randn(outputs, generator=g)
    x = torch.randn(1100, inputs, generator=g)
    sources = torch.randn(9, 24, inputs, generator=g)  # [B, S, D]
    w, b, x, sources = (t.to(dtype) for t in (w, b, x, sources))
    threads = torch.get_num_threads()
    packed = linear_maps.PackedLinear(w, b)
    packed.calls = linear_maps.PACK_AFTER  # the next call packs
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for name, fn in [("dense", lambda x: linear_maps.dense(x, w, b)), ("packed", packed)]:
                full = fn(x)
                for a in (0, 5, 64):
                    for m in (1, 2, 3, 7, 9, 16, 33, 1025):
                        got = fn(x[a : a + m])
                        assert torch.equal(got, full[a : a + m]), (
                            f"{name}, rows {a}:{a + m}, {n_threads} threads"
                        )
            assert packed.packed is not None
            assert torch.equal(packed(x[:7]), linear_maps.dense(x[:7], w, b))  # packed or not: the same bits
            full = packed(sources)
            for a, n in [(0, 1), (3, 1), (2, 3), (4, 5)]:
                assert torch.equal(packed(sources[a : a + n]), full[a : a + n]), f"sources {a}:{a + n}"
    finally:
        torch.set_num_threads(threads)


def test_cross_attention_keeps_its_bits_at_wider_widths_and_in_any_batch() -> None:
    """``attention.attention`` with ``chunk`` (cross-attention, sources padded to whole chunks): an input's output
    over its own width equals its output over a wider batch's (keys past its width zero and masked) and alone,
    at 1-3 threads, for widths of 1 to 16 chunks. (One product over all keys does not keep them on this box's
    MKL: the GEMM splits its inner dimension by its length.)"""
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for chunks, wider in [(1, 2), (1, 16), (3, 4), (5, 7), (6, 16), (8, 9)]:
                w, big = chunks * CROSS_CHUNK, wider * CROSS_CHUNK
                q = torch.randn(3, 4, 4, 64, generator=g)  # [B, H, R, d]
                k, v = torch.randn(3, 4, 64, w, generator=g), torch.randn(3, 4, w, 64, generator=g)
                mask = torch.zeros(3, 1, 1, w)
                mask[1, ..., w - 5 :] = float("-inf")  # an input shorter than its width
                own = attention(q, k, v, mask, 0.125, chunk=CROSS_CHUNK)
                pad = big - w
                wide = attention(
                    q, F.pad(k, (0, pad)), F.pad(v, (0, 0, 0, pad)), F.pad(mask, (0, pad), value=float("-inf")),
                    0.125, chunk=CROSS_CHUNK,
                )  # fmt: skip
                assert torch.equal(own, wide), f"{w} -> {big} keys, {n_threads} threads"
                alone = attention(q[1:2], k[1:2], v[1:2], mask[1:2], 0.125, chunk=CROSS_CHUNK)
                assert torch.equal(alone, own[1:2]), f"{w} keys alone, {n_threads} threads"
    finally:
        torch.set_num_threads(threads)


def test_merged_attention_is_one_softmax_and_keeps_its_bits_at_wider_source_widths() -> None:
    """``attention(..., then=...)`` (T5Gemma 2's merged attention, grouped-query): the decoder's keys and the
    source's under one softmax, as the concatenated keys give it (float32 summation order apart: within 1e-6 of
    outputs of magnitude ~1), and an input's output keeps its bits when the source block is wider (keys past its
    width zero and masked), its values summed by chunk."""
    g = torch.Generator().manual_seed(1)
    b, h, hkv, r, d, span = 3, 4, 2, 2, 16, 8
    q = torch.randn(b, h, r, d, generator=g)  # [B, H, R, d]
    k, v = torch.randn(b, hkv, d, span, generator=g), torch.randn(b, hkv, span, d, generator=g)
    bias = torch.zeros(b, 1, r, span)
    bias[:, :, 0, -2:] = float("-inf")  # a beam that does not see the last positions
    for chunks, wider in [(1, 2), (2, 16), (5, 9)]:  # one product over all keys differs at the last two
        w, pad = chunks * CROSS_CHUNK, (wider - chunks) * CROSS_CHUNK
        sk, sv = torch.randn(b, hkv, d, w, generator=g), torch.randn(b, hkv, w, d, generator=g)
        smask = torch.zeros(b, 1, 1, w)
        smask[1, ..., w - 7 :] = float("-inf")
        got = attention(q, k, v, bias, 0.25, then=(sk, sv, smask, CROSS_CHUNK))
        keys, values = torch.cat((k, sk), -1), torch.cat((v, sv), -2)
        whole = attention(q, keys, values, torch.cat((bias, smask.expand(b, 1, r, w)), -1), 0.25)
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-6)
        wide = (F.pad(sk, (0, pad)), F.pad(sv, (0, 0, 0, pad)), F.pad(smask, (0, pad), value=float("-inf")))
        assert torch.equal(attention(q, k, v, bias, 0.25, then=(*wide, CROSS_CHUNK)), got), f"{w} -> {w + pad}"


# -- model backends -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAST_FAMILIES)
def test_an_inputs_logits_do_not_depend_on_its_neighbours(tiny_models, family: str) -> None:
    check_neighbours(Generator(str(tiny_models(family)), max_new_tokens=8))


@pytest.mark.skipif(AMX, reason="bf16 on AMX: a row's bits depend on the row count and threads (ARCHITECTURE, Products)")
@pytest.mark.parametrize("family", ["bart", "llama"])
def test_an_inputs_bfloat16_logits_do_not_depend_on_its_neighbours(tiny_models, family: str) -> None:
    """bfloat16 on a CPU without AMX keeps an input's logits whatever its neighbours: oneDNN's bf16 products on
    AVX-512 BF16, ``F.linear``'s on an AVX2-only CPU, attention in float32 (README's ``--dtype`` table). Element-wise
    kernels run bf16 in chunks of two vectors (32 values under AVX2, 64 under AVX-512) and a tensor's tail one by
    one (ARCHITECTURE, "Element-wise functions"): the tiny models' 32-wide rows fill whole chunks under AVX2 only,
    so elsewhere this skips (real checkpoints' widths are multiples of 64)."""
    gen = Generator(str(tiny_models(family)), max_new_tokens=8, dtype="bfloat16")
    chunk = 64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32
    config = gen.model.config.get_text_config(decoder=True)
    widths = [config.hidden_size, getattr(config, "intermediate_size", None) or config.decoder_ffn_dim]
    if any(w % chunk for w in widths):
        pytest.skip(f"{widths}-wide rows split bf16's {chunk}-value chunks here")
    check_neighbours(gen)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="int8 activations are quantized per tensor: a row's scale is the batch's",
)
def test_int8_logits_do_not_depend_on_its_neighbours(tiny_models) -> None:
    check_neighbours(Generator(str(tiny_models("bart")), dtype="int8", max_new_tokens=8))


# -- reader timing --------------------------------------------------------------------------------------------


def _slow_records(n: int, pause: float) -> Iterator[Record]:
    for i in range(n):
        time.sleep(pause)  # the tokeniser always waits for the reader
        yield Record(index=i, source="in.txt", line=i + 1, text=f"input {i}")


def _encode(texts: list[str], fields: object = None) -> list[Encoded]:
    return [Encoded([1, 2], False) for _ in texts]


def _chunks(streaming: bool) -> list:
    stage = ReaderStage(_slow_records(12, 0.01), _encode, chunk_size=4, streaming=streaming).start()
    return list(stage.chunks())


def _pipe_chunks() -> list:
    """A pipe whose next line arrives only once the consumer has the chunk before it: the tokeniser finds
    nothing more after the first line, however late the box's load lets its threads run (sleeps would not)."""
    handed = threading.Semaphore(0)

    def lines() -> Iterator[Record]:
        for i in range(12):
            if i:
                assert handed.acquire(timeout=60), "the consumer never took the chunk before"
            yield Record(index=i, source="in.txt", line=i + 1, text=f"input {i}")

    stage = ReaderStage(lines(), _encode, chunk_size=4, streaming=True).start()
    chunks = []
    for chunk in stage.chunks():
        chunks.append(chunk)
        handed.release()
    return chunks


def test_a_files_windows_never_depend_on_the_readers_timing() -> None:
    """A lagging reader never cuts a regular file's window early; only a pipe's (its outputs still do not
    depend on where the cut falls)."""
    assert not any(c.starved for c in _chunks(streaming=False))
    chunks = _pipe_chunks()
    assert [r.index for c in chunks for r in c.items] == list(range(12))
    assert all(c.starved for c in chunks[:-1]), "every line alone: nothing more had arrived"


# -- the CLI: many batchings, shards, each input alone ---------------------------------------------------------


def near_tie_checkpoint(src: Path, dest: Path) -> Path:
    """``src`` with its LM head's odd rows copies of the even ones times (1 + 1e-6 noise): the two tokens of a
    pair differ by about the float32 rounding of the product, so any other arithmetic picks the other one."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    copy_checkpoint(src, dest)
    auto = (
        AutoModelForSeq2SeqLM if AutoConfig.from_pretrained(src).is_encoder_decoder else AutoModelForCausalLM
    )
    model = auto.from_pretrained(src)
    w = model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        odd = w[1::2]
        odd.copy_(w[0::2][: odd.shape[0]] * (1 + 1e-6 * torch.randn(odd.shape, generator=g)))
    model.save_pretrained(dest)
    return dest


CLI_CASES = {  # family -> generation flags: beams returning two outputs each (their order is a near-tie too)
    "marian": ["--num-beams", "4", "--num-return-sequences", "2", "--max-new-tokens", "8"],
    "gpt2": ["--max-new-tokens", "8"],
}
BATCHINGS = {  # name -> flags; the first is the reference: every input alone in its batch, in input order
    "batch 1": ["--batch-size", "1", "--sort-window", "0"],
    "batch 16": ["--batch-size", "16"],
    "batch 5, no sorting": ["--batch-size", "5", "--sort-window", "0"],
    "batch 4, window 7": ["--batch-size", "4", "--sort-window", "7"],
    "token budget 600": ["--batch-size", "64", "--batch-tokens", "600"],
}
ALONE = (3, 77)  # lines also run as a file of their own


def seqgen_ok(*args: str, stdin: bytes | None = None) -> None:
    res = seqgen(*args, input=stdin)
    assert res.exit_code == 0, res.stderr


@pytest.fixture(scope="module", params=sorted(CLI_CASES))
def job(request, tiny_models, tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """A near-tie checkpoint, 120 inputs of varied length (two empty) and the generation flags."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    model = near_tie_checkpoint(tiny_models(family), tmp / "model")
    texts = sample_texts(120, seed=7)
    texts[17] = texts[90] = ""  # empty lines pass through
    src = tmp / "in.txt"
    src.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    return model, src, [*CLI_CASES[family], "--output-format", "jsonl", "-q"]


def _generate(
    job: tuple[Path, Path, list[str]], src: Path, out: Path, *more: str, stdin: bytes | None = None
) -> bytes:
    model, _, flags = job
    seqgen_ok("generate", "-m", str(model), str(src), "-o", str(out), *flags, *more, stdin=stdin)
    return out.read_bytes()


def _differing_lines(got: bytes, expected: bytes) -> list[int]:
    lines, ref = got.decode().splitlines(), expected.decode().splitlines()
    assert len(lines) == len(ref)
    return [i + 1 for i, (a, b) in enumerate(zip(lines, ref, strict=True)) if a != b]


def test_the_same_bytes_from_every_batching_window_shard_and_alone(job, tmp_path: Path) -> None:
    """One file through several batch sizes, sort windows, a token budget, stdin (a pipe: windows also cut when
    the reader waits), three shards merged: the same bytes as every input in a batch of its own, and as a few
    lines run each as a file of its own."""
    _, src, _ = job
    runs = {name: _generate(job, src, tmp_path / f"out{i}.jsonl", *flags) for i, (name, flags) in
            enumerate(BATCHINGS.items())}  # fmt: skip
    stdin = _generate(job, Path("-"), tmp_path / "stdin.jsonl", "--batch-size", "8", stdin=src.read_bytes())
    runs["stdin, batch 8"] = stdin
    parts = [tmp_path / f"part{i}.jsonl" for i in range(3)]
    for i, part in enumerate(parts):
        _generate(job, src, part, "--batch-size", "16", "--shard", f"{i}/3")
    seqgen_ok("merge", *map(str, parts), "-o", str(tmp_path / "merged.jsonl"))
    runs["3 shards + merge"] = (tmp_path / "merged.jsonl").read_bytes()

    reference = runs.pop("batch 1")
    lines = reference.decode().splitlines(keepends=True)
    assert len(set(lines)) > 60, "the outputs should differ between inputs"
    differ = {name: _differing_lines(got, reference) for name, got in runs.items()}
    assert not any(differ.values()), f"lines that differ from each input in a batch of its own: {differ}"
    texts = src.read_text(encoding="utf-8").splitlines()
    for i in ALONE:
        one = tmp_path / f"line{i}.txt"
        one.write_text(texts[i] + "\n", encoding="utf-8")
        assert _generate(job, one, tmp_path / f"line{i}.jsonl", "--batch-size", "16") == lines[i].encode()


@pytest.mark.slow
@pytest.mark.parametrize("job", ["marian"], indirect=True)
def test_two_ray_workers_write_the_same_bytes(job, tmp_path: Path) -> None:
    """--workers 2 (a local Ray, one torch thread per worker) against one process of two threads."""
    model, src, flags = job
    one = _generate(job, src, tmp_path / "one.jsonl", "--batch-size", "16")
    out = tmp_path / "workers.jsonl"
    cmd = [sys.executable, "-m", "seqgen_cli", "generate", "-m", str(model), str(src), "-o", str(out), *flags]
    cmd += ["--batch-size", "16", "--workers", "2", "--shard-size", "25"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    assert not _differing_lines(out.read_bytes(), one)
