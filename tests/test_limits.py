"""Limits a demanding user hits: source length without a position limit, out of memory on the
host, n-gram sizes past int64 packing, checkpoints without tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from seqgen_cli.errors import is_oom
from seqgen_cli.generator import Generator
from seqgen_cli.loading import load
from seqgen_cli.models import get_backend
from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.ngram import NGramBlocker
from tests.engine_models import Loaded, text_batch
from tests.equivalence import check_equivalence, hf_generate
from tests.helpers import load_tiny, seqgen
from tests.tiny_models import REAL_TOKENIZER_DIRS, copy_checkpoint

HOST_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"
)


# -- part 4: a source limit for every model, host out-of-memory handled ------------------------------------
def test_t5_takes_the_tokenizer_limit_where_the_config_has_none(tiny_models) -> None:
    gen = Generator(str(tiny_models("t5")), max_new_tokens=2)
    assert gen.tokenizer.model_max_length == 512
    assert gen.max_source_length == 512
    assert gen._source_limit(2000) == 2000  # relative positions: a longer request is the user's to make
    gen.tokenizer.model_max_length = int(1e30)  # transformers' "no limit"
    assert gen._source_limit(None) is None


def test_position_limits_from_the_config_are_unchanged(tiny_models) -> None:
    bart = Generator(str(tiny_models("bart")), max_new_tokens=2)
    assert bart.max_source_length == bart.model.config.max_position_embeddings
    gpt2 = Generator(str(tiny_models("gpt2")), max_new_tokens=24)
    assert gpt2.max_source_length == gpt2.model.config.n_positions - 24


def test_a_megabyte_t5_line_is_truncated_and_counted(tiny_models, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a short line\n" + "the cat sat on the mat " * 45_000 + "\n", encoding="utf-8")
    assert src.stat().st_size > 1_000_000
    stats = tmp_path / "stats.json"
    res = seqgen(
        "generate", "-m", str(tiny_models("t5")), "--max-new-tokens", "2", str(src), "--stats", str(stats)
    )
    assert res.exit_code == 0, res.stderr
    assert len(res.stdout.splitlines()) == 2
    assert "1 of 2 inputs truncated to 512 tokens" in res.stderr
    assert json.loads(stats.read_text())["truncated"] == 1


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError(HOST_OOM),
        RuntimeError(
            "[enforce fail at CPUAllocator.cpp:64] . DefaultCPUAllocator: not enough memory: you tried "
            "to allocate 1073741824 bytes. Buy new RAM!"
        ),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        torch.OutOfMemoryError("any message"),
        MemoryError(),
    ],
)
def test_is_oom_matches_every_allocator(err: BaseException) -> None:
    assert is_oom(err)


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"),
        ValueError("out of memory"),  # not an error the runtime raises for memory
        RuntimeError("CUDA error: device-side assert triggered"),
    ],
)
def test_is_oom_leaves_other_errors(err: BaseException) -> None:
    assert not is_oom(err)


def test_host_oom_on_one_input_is_split_down_and_skipped(
    tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU allocator fails for the one longest input: its batch is halved down to it alone, then it is
    named and written empty; every other input gets the output it gets alone. (41-48 tokens each: one width
    bucket, so one batch.)"""
    texts = [f"line {i} of the file " * 3 for i in range(6)]
    texts[2] += "and more"
    src = tmp_path / "in.txt"
    src.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    model = str(tiny_models("t5"))
    common = ["generate", "-m", model, "--max-new-tokens", "4", str(src)]
    alone = seqgen(*common, "--batch-size", "1")
    assert alone.exit_code == 0

    generate_ids = Generator.generate_ids
    sizes: list[int] = []

    def host_oom_for_long_inputs(self: Generator, batch, indices=None):
        sizes.append(len(batch))
        if any(len(ids) > 45 for ids in batch):  # texts[2] only
            raise RuntimeError(HOST_OOM)
        return [generate_ids(self, [ids])[0] for ids in batch]  # each alone: outputs as in `alone`

    monkeypatch.setattr(Generator, "generate_ids", host_oom_for_long_inputs)
    stats = tmp_path / "stats.json"
    res = seqgen(*common, "--batch-size", "8", "--on-error", "skip", "--stats", str(stats))
    assert res.exit_code == 0, res.stderr
    assert sizes[0] == 6 and sizes.count(1) >= 1 and 1 in sizes[-3:]
    assert f"{src}:3: out of memory (input of" in res.stderr
    expected = alone.stdout.splitlines()
    expected[2] = ""
    assert res.stdout.splitlines() == expected
    assert json.loads(stats.read_text())["skipped"] == 1


# -- part 5: n-gram sizes past int64 packing on real vocabularies ------------------------------------------
def _repetitive(rows: int, length: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """[rows, length] ids spread over the whole vocabulary that repeat long n-grams: a short motif of rare
    and frequent ids, tiled, with a few random substitutions. int64."""
    motif = torch.randint(0, vocab, (rows, 5), generator=g)
    motif[:, 0] = vocab - 1  # the largest id: keys would need V**(n-1)
    ids = motif.repeat(1, length // 5 + 1)[:, :length]
    noise = torch.rand((rows, length), generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab, (rows, length), generator=g), ids)


@pytest.mark.parametrize("n", [7, 10, 20])
def test_ngram_blocker_beyond_int64_packing_bans_as_brute_force(n: int) -> None:
    """V = 50k: V**(n-2) alone overflows int64; bans equal transformers' brute-force processor, through
    incremental appends and beam reordering."""
    g = torch.Generator().manual_seed(n)
    rows, vocab, prompt = 4, 50_000, 60
    history = TokenHistory(_repetitive(rows, prompt, vocab, g), prompt + 40)
    blocker = NGramBlocker(n, vocab, history)
    assert not blocker.packed
    reference = NoRepeatNGramLogitsProcessor(n)
    banned = 0
    for _ in range(40):
        scores = torch.randn((rows, vocab), generator=g)
        ours = blocker(history, scores.clone())
        assert torch.equal(ours, reference(history.filled, scores))
        banned += int(torch.isinf(ours).sum())
        order = torch.randint(0, rows, (rows,), generator=g)  # beams continue other beams
        history.select(order)
        blocker.select(order)
        column = history.tokens[:, history.length - 5]  # mostly continue the motif
        fresh = torch.randint(0, vocab, (rows,), generator=g)
        history.append(torch.where(torch.rand(rows, generator=g) < 0.9, column, fresh))
        blocker.appended(history)
    assert banned > 0  # the histories do repeat n-grams


def _real_vocab_model(real_tokenizer_models, family: str) -> Loaded:
    """A tiny model with a real ~50k vocabulary, EOS untouched (outputs run to the length limit)."""
    model, tokenizer = load_tiny(real_tokenizer_models(family))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Loaded(model, tokenizer)


# V**(n-2) >= 2**63 from n = 7. The tiny GPT-2 repeats no 13-gram or longer in its outputs, so blocking
# could not change them and the comparison would not cover it: its n stops at 10.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "n"), [("bart", 7), ("bart", 10), ("bart", 20), ("gpt2", 7), ("gpt2", 10)]
)
def test_large_ngram_sizes_equal_generate(real_tokenizer_models, family: str, n: int) -> None:
    loaded = _real_vocab_model(real_tokenizer_models, family)
    assert loaded.model.config.vocab_size ** (n - 2) >= 2**63  # the sizes that crashed
    batch = text_batch(loaded, 6, seed=1)
    kwargs = dict(num_beams=3, max_new_tokens=48 + 3 * n, no_repeat_ngram_size=n)  # room to repeat an n-gram
    result = check_equivalence(loaded.model, get_backend, batch, kwargs)
    assert not result.mismatches, "\n".join(result.mismatches[:5])
    unblocked, _ = hf_generate(loaded.model, batch, dict(kwargs, no_repeat_ngram_size=0))
    blocked, _ = hf_generate(loaded.model, batch, kwargs)
    assert blocked != unblocked  # the blocking changed some output: the comparison covers it


@pytest.mark.slow
@pytest.mark.parametrize("n", ["7", "20"])
def test_cli_large_ngram_size_equals_backend_hf(real_tokenizer_models, tmp_path: Path, n: str) -> None:
    src = tmp_path / "in.txt"
    src.write_text("the cat sat on the mat\na second, somewhat longer line of text\n", encoding="utf-8")
    args = ["generate", "-m", str(real_tokenizer_models("bart")), str(src), "--num-beams", "3"]
    args += ["--max-new-tokens", "40", "--no-repeat-ngram-size", n]
    fast, hf = seqgen(*args, "--backend", "fast"), seqgen(*args, "--backend", "hf")
    assert fast.exit_code == 0 and hf.exit_code == 0, fast.stderr + hf.stderr
    assert fast.stdout == hf.stdout and len(fast.stdout.splitlines()) == 2


# -- part 6: a checkpoint folder without tokenizer files -----------------------------------------------------
def _one_line_error(res, *needles: str) -> str:
    err = res.stderr.strip()
    assert res.exit_code != 0 and res.stdout == ""
    assert len(err.splitlines()) == 1 and err.startswith("seqgen: error:"), err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize(
    "family,files",
    [
        ("bart", "tokenizer.json, vocab.json, merges.txt"),
        ("gpt2", "tokenizer.json, vocab.json, merges.txt"),
        ("t5", "tokenizer.json, spiece.model"),
        ("marian", "source.spm, target.spm, vocab.json"),
    ],
)
def test_folder_without_tokenizer_files_names_them(
    tiny_models, tmp_path: Path, family: str, files: str
) -> None:
    """Without its tokenizer files, transformers builds an empty tokenizer (BART: empty outputs, exit 0;
    GPT-2: "empty token sequence"): one line naming the missing files instead."""
    model = copy_checkpoint(tiny_models(family), tmp_path / family)
    for path in model.glob("tokenizer*"):
        path.unlink()
    res = seqgen("generate", "-m", str(model), "--max-new-tokens", "2", input="hello world\n")
    _one_line_error(res, f"model {model}: no tokenizer files", f"missing {files}")


def test_tokenizer_config_without_the_tokenizer_names_the_file(tiny_models, tmp_path: Path) -> None:
    model = copy_checkpoint(tiny_models("bart"), tmp_path / "bart")
    (model / "tokenizer.json").unlink()  # tokenizer_config.json stays: its class reads tokenizer.json
    res = seqgen("generate", "-m", str(model), "--max-new-tokens", "2", input="hello world\n")
    _one_line_error(res, "no tokenizer files", "missing tokenizer.json")


def test_a_partial_vocabulary_names_what_is_missing(real_tokenizer_models, tmp_path: Path) -> None:
    model = copy_checkpoint(real_tokenizer_models("marian"), tmp_path / "marian")  # source/target.spm, vocab
    (model / "target.spm").unlink()
    assert (model / "source.spm").is_file() and not (model / "tokenizer.json").exists()
    res = seqgen("generate", "-m", str(model), "--max-new-tokens", "2", input="hello world\n")
    _one_line_error(res, "cannot load its tokenizer (missing target.spm")


@pytest.mark.parametrize("family", sorted(REAL_TOKENIZER_DIRS))
def test_real_tokenizer_folders_still_load(real_tokenizer_models, family: str) -> None:
    """Checkpoints as published (Marian without tokenizer.json, others with it only) are not refused."""
    loaded = load(str(real_tokenizer_models(family)))
    assert len(loaded.tokenizer) > 1000 and loaded.tokenizer("hello world")["input_ids"]
