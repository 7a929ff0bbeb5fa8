"""Limits a demanding user hits: source length without a position limit, out of memory on the
host, n-gram sizes past int64 packing, checkpoints without tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import Result
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from seqgen_cli.batching import Generated
from seqgen_cli.errors import is_oom
from seqgen_cli.generator import Generator
from seqgen_cli.loading import load
from seqgen_cli.models import get_backend
from seqgen_cli.search.history import TokenHistory
from seqgen_cli.search.ngram import NGramBlocker
from tests.equivalence import check_equivalence, hf_generate
from tests.helpers import seqgen
from tests.tiny_models import REAL_TOKENIZER_DIRS, Loaded, copy_checkpoint, load_tiny, text_batch

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

    generate_output = Generator.generate_output
    sizes: list[int] = []

    def host_oom_for_long_inputs(self: Generator, batch, indices=None):
        sizes.append(len(batch))
        if any(len(ids) > 45 for ids in batch):  # texts[2] only
            raise RuntimeError(HOST_OOM)
        return Generated([generate_output(self, [ids]).sequences[0] for ids in batch])  # each alone, as `alone`

    monkeypatch.setattr(Generator, "generate_output", host_oom_for_long_inputs)
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
    unblocked = hf_generate(loaded.model, batch, dict(kwargs, no_repeat_ngram_size=0)).sequences
    blocked = hf_generate(loaded.model, batch, kwargs).sequences
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


# -- part 7: settings past what the model or torch can index (issue 39, item 4) -------------------------------
HUGE = str(10**20)  # past int64: torch raised c10::ValueError with a C++ frame dump


def _generate(model: Path, *args: str) -> Result:
    return seqgen("generate", "-m", str(model), "-q", *args, input="hello world\nanother line\n")


def _vocab(model: Path) -> int:
    return json.loads((model / "config.json").read_text(encoding="utf-8"))["vocab_size"]


def test_a_huge_num_beams_flag_is_one_line(tiny_models) -> None:
    res = _generate(tiny_models("bart"), "--max-new-tokens", "2", "--num-beams", HUGE)
    _one_line_error(res, f"--num-beams {HUGE}: must be a whole number >= 1 and <= 2147483647")


def test_more_beams_than_the_vocabulary_is_one_line(tiny_models) -> None:
    model = tiny_models("bart")
    vocab = _vocab(model)
    res = _generate(model, "--max-new-tokens", "2", "--num-beams", str(vocab + 1))
    _one_line_error(res, f"--num-beams {vocab + 1}: must be <= {vocab}, the model's vocabulary")


def test_rows_times_length_past_what_torch_indexes_is_one_line(tiny_models) -> None:
    """Each within 2**31 - 1, their product sized the caches past int64 ("Storage size calculation overflowed")."""
    most = "2147483647"
    res = _generate(
        tiny_models("t5"), "--do-sample", "--num-return-sequences", most, "--max-new-tokens", most
    )
    _one_line_error(
        res,
        f"--num-return-sequences {most} with --max-new-tokens {most}: one input would run",
        "(rows x length)",
    )


def test_a_huge_ngram_size_computes_no_huge_power() -> None:
    """``V ** (n - 1)`` for n = 2**31 - 1 is a gigabyte-sized integer: the run hung before its first step."""
    history = TokenHistory(torch.zeros((2, 3), dtype=torch.long), 8)
    assert not NGramBlocker(2**31 - 1, 50_000, history).packed
    assert NGramBlocker(4, 50_000, history).packed and not NGramBlocker(64, 2, history).packed


@pytest.mark.parametrize("value", ["9223372036854775807", HUGE])  # int64's largest: storage size overflow
@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_a_huge_max_new_tokens_from_a_preset_is_one_line(
    tiny_models, tmp_path: Path, family: str, value: str
) -> None:
    preset = tmp_path / "huge.toml"
    preset.write_text(f"[generation]\nmax_new_tokens = {value}\n", encoding="utf-8")
    res = _generate(tiny_models(family), "--preset", str(preset))
    _one_line_error(
        res, f"preset {preset}: max_new_tokens = {value}: must be a whole number >= 1 and <= 2147483647"
    )


@pytest.mark.parametrize(
    "family,flag,value,needle",
    [
        ("gpt2", "--max-new-tokens", "1025", "must be <= 1024: the model has 1024 positions (n_positions"),
        ("bart", "--max-new-tokens", "513", "must be <= 512: the model has 512 decoder positions (max_"),
        ("marian", "--max-new-tokens", "600", "must be <= 512: the model has 512 decoder positions"),
        ("bart", "--max-length", "514", "must be <= 513: the model has 512 decoder positions"),
        ("gpt2", "--max-length", "2000", "must be <= 1025: the model has 1024 positions"),
    ],
)
def test_a_length_past_learned_positions_is_one_line(
    tiny_models, family: str, flag: str, value: str, needle: str
) -> None:
    """Learned (or fixed sinusoid) position tables: past them the model died with ``IndexError: index out of
    range in self``. The limit is exact: the model never runs on the last token."""
    res = _generate(tiny_models(family), flag, value)
    err = _one_line_error(res, f"{flag} {value}: {needle}")
    assert "Traceback" not in res.stderr and "IndexError" not in err


def test_a_checkpoint_max_length_past_its_positions_is_named(tiny_models, tmp_path: Path) -> None:
    model = copy_checkpoint(tiny_models("bart"), tmp_path / "bart")
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), "max_length": 600}))
    _one_line_error(_generate(model), "the model's generation_config.json: max_length = 600: must be <= 513")
    fixed = _generate(model, "--max-new-tokens", "3")  # a flag replaces it
    assert fixed.exit_code == 0 and len(fixed.stdout.splitlines()) == 2, fixed.stderr


@pytest.mark.parametrize(
    "family,value",
    [
        ("t5", "600"),  # relative positions: no limit past n_positions (512)
        ("llama", "1000"),  # rotary positions: the prompt cut to the 24 tokens left of the context (1024)
        ("bart", "512"),  # at the limit: every decoder position used, none past it
        ("gpt2", "1024"),  # at the limit, the prompt cut to one token
    ],
)
def test_lengths_the_positions_allow_still_run(tiny_models, family: str, value: str) -> None:
    res = _generate(tiny_models(family), "--max-new-tokens", value)
    assert res.exit_code == 0, res.stderr
    assert len(res.stdout.splitlines()) == 2


def test_new_tokens_that_leave_a_prompt_no_room_are_a_bad_line(tiny_models) -> None:
    """Llama's context (its tokenizer's 1024) less 1100 new tokens leaves one prompt token, its BOS: an output of
    no input (before: two outputs of BOS alone, exit 0)."""
    res = _generate(tiny_models("llama"), "--max-new-tokens", "1100")
    assert res.exit_code == 2 and "prompt of at most 1 tokens" in res.stderr and "none of the input's text" in res.stderr
