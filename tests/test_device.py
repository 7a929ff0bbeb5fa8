"""GPU code paths that can be tested without a GPU: CUDA out-of-memory splitting, padding into pinned memory
with a non-blocking copy, and ``Generator.device_stats``. (The CUDA-only checks run on a GPU machine through
``scripts/harness/gpu_bench.sh``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from seqgen_cli.batching import Generated, Item, generate_split
from seqgen_cli.errors import is_oom
from seqgen_cli.generator import Generator
from seqgen_cli.loading import Loaded


class FakeGen:
    """``generate_ids`` that raises CUDA's out-of-memory error for batches of more than ``limit`` inputs."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[int] = []

    def generate_output(self, batch: list[list[int]], indices: object = None, grammars: object = ()) -> Generated:
        self.calls.append(len(batch))
        if len(batch) > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA error: tried to allocate 20.00 GiB")  # no 'out of memory'
        return Generated([[list(reversed(ids))] for ids in batch])


def test_cuda_oom_is_recognised_by_type() -> None:
    err = torch.cuda.OutOfMemoryError("CUDA error: tried to allocate 20.00 GiB")
    assert is_oom(err)
    assert not is_oom(RuntimeError("CUDA error: device-side assert triggered"))


def test_cuda_oom_splits_the_batch_like_a_host_oom() -> None:
    items = [Item(i, [i + 1, i + 2, i + 3], f"line {i + 1}") for i in range(10)]
    gen = FakeGen(limit=3)
    results = generate_split(gen, items)
    assert [r.item.index for r in results] == list(range(10))
    assert all(r.error is None for r in results)
    assert [r.sequences for r in results] == [[[i + 3, i + 2, i + 1]] for i in range(10)]
    assert max(n for n in gen.calls if n <= 3) <= 3 and gen.calls[0] == 10


def test_cuda_oom_of_a_single_input_is_reported_with_its_line() -> None:
    results = generate_split(FakeGen(limit=0), [Item(0, [5, 6], "data.txt:7")])
    assert results[0].sequences is None
    assert (
        results[0].error is not None
        and "data.txt:7" in results[0].error
        and "out of memory" in results[0].error
    )


def _fake_generator(
    device: str, encoder_decoder: bool, dtype: torch.dtype = torch.float32, limit: int | None = None
) -> SimpleNamespace:
    return SimpleNamespace(
        loaded=Loaded(None, None, encoder_decoder, torch.device(device), dtype),
        tokenizer=SimpleNamespace(pad_token_id=9),
        is_encoder_decoder=encoder_decoder,
        _source_limit=lambda requested: limit,  # the model's position limit
        exact_widths=None,  # inputs padded to their width buckets
        step_path="eager (test)",
        backend="hf",  # engine: generate()
        refill=False,
        _model_backend=None,
    )


@pytest.mark.parametrize("encoder_decoder", [True, False])
@pytest.mark.parametrize(("limit", "width"), [(None, 8), (5, 5)])  # 3 tokens' width bucket, or the limit
def test_pad_layout(encoder_decoder: bool, limit: int | None, width: int) -> None:
    gen = _fake_generator("cpu", encoder_decoder, limit=limit)
    batch = Generator.pad(gen, [[1, 2, 3], [4]])
    ids, mask = batch.input_ids, batch.attention_mask
    assert batch.widths == (width, min(8, width))  # each input's own width
    pad = [9] * width
    if encoder_decoder:  # right padding
        assert ids.tolist() == [[1, 2, 3, *pad[3:]], [4, *pad[1:]]]
        assert mask.tolist() == [[1] * 3 + [0] * (width - 3), [1] + [0] * (width - 1)]
    else:  # left padding
        assert ids.tolist() == [[*pad[3:], 1, 2, 3], [*pad[1:], 4]]
        assert mask.tolist() == [[0] * (width - 3) + [1] * 3, [0] * (width - 1) + [1]]
    assert ids.dtype == mask.dtype == torch.long


def test_pad_for_cuda_pins_and_copies_without_blocking() -> None:
    """On CUDA the rectangle is built in pinned memory and sent with non_blocking=True (mocked on the CPU)."""
    pinned: list[bool] = []
    copies: list[tuple] = []
    full, zeros = torch.full, torch.zeros

    def fake_full(*args, pin_memory: bool = False, **kwargs):
        pinned.append(pin_memory)
        return full(*args, **kwargs)

    def fake_zeros(*args, pin_memory: bool = False, **kwargs):
        pinned.append(pin_memory)
        return zeros(*args, **kwargs)

    def fake_to(self, *args, **kwargs):
        copies.append((args, kwargs))
        return self

    with (
        mock.patch.object(torch, "full", fake_full),
        mock.patch.object(torch, "zeros", fake_zeros),
        mock.patch.object(torch.Tensor, "to", fake_to),
    ):
        ids = Generator.pad(_fake_generator("cuda", True), [[1, 2], [3]]).input_ids
    assert pinned == [True, True]
    assert copies == [((torch.device("cuda"),), {"non_blocking": True})] * 2
    assert ids.tolist() == [[1, 2, *[9] * 6], [3, *[9] * 7]]  # width bucket 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pad_on_cuda_matches_the_host() -> None:
    batch = [[1, 2, 3], [4], [5, 6]]
    got = Generator.pad(_fake_generator("cuda", False), batch)
    ref = Generator.pad(_fake_generator("cpu", False), batch)
    assert got.input_ids.is_cuda and torch.equal(got.input_ids.cpu(), ref.input_ids)
    assert torch.equal(got.attention_mask.cpu(), ref.attention_mask) and got.widths == ref.widths


def test_device_stats_cpu_and_cuda() -> None:
    assert Generator.device_stats(_fake_generator("cpu", True)) == {
        "device": "cpu",
        "dtype": "float32",
        "loader": "transformers",
        "engine": "generate()",
        "step_path": "eager (test)",
    }
    with (
        mock.patch.object(torch.cuda, "max_memory_allocated", return_value=3 * 2**30),
        mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H100"),
    ):
        stats = Generator.device_stats(_fake_generator("cuda", True, torch.bfloat16))
    assert stats == {
        "device": "cuda",
        "dtype": "bfloat16",
        "loader": "transformers",
        "engine": "generate()",
        "step_path": "eager (test)",
        "device_name": "NVIDIA H100",
        "peak_gpu_memory_mb": 3072.0,
    }


def test_auto_dtype_is_float32_on_cpu_and_bf16_where_the_gpu_supports_it() -> None:
    from seqgen_cli.loading import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert (
        resolve_dtype("float16", torch.device("cpu")) == torch.float16
    )  # explicit half works on the CPU too
    cuda = torch.device("cuda")
    with mock.patch.object(torch.cuda, "is_bf16_supported", return_value=True):
        assert resolve_dtype("auto", cuda) == torch.bfloat16
    with mock.patch.object(torch.cuda, "is_bf16_supported", return_value=False):
        assert resolve_dtype("auto", cuda) == torch.float16


_MALLOC_PROBE = """
import ctypes, resource, sys
from seqgen_cli.loading import keep_freed_memory
applied = keep_freed_memory()
malloc, free = ctypes.CDLL(None).malloc, ctypes.CDLL(None).free
malloc.restype, malloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for size in [24 << 20, 20 << 20, 30 << 20, 8 << 20] * 5:  # vocabulary-sized blocks, written in full
    p = malloc(size)
    ctypes.memset(p, 1, size)
    free(p)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_keep_freed_memory_reuses_large_blocks_unless_the_user_set_malloc() -> None:
    """With the tuning, 20 blocks of 8-30 MiB fault in about the largest one's pages once; glibc's default
    (dynamic threshold) faults about 3 times that here, and a user's own MALLOC_*_ setting wins."""

    def probe(env: dict[str, str]) -> tuple[bool, int]:
        out = subprocess.run(
            [sys.executable, "-c", _MALLOC_PROBE], env={**os.environ, **env}, capture_output=True, text=True
        )
        applied, faults = out.stdout.split()
        return applied == "True", int(faults)

    applied, tuned = probe({})
    assert applied
    pages = (30 << 20) // 4096
    assert tuned < 1.5 * pages
    applied, untouched = probe({"MALLOC_TRIM_THRESHOLD_": str(128 << 10)})
    assert not applied
    assert untouched > 3 * pages
