"""Helpers the test files share: :func:`seqgen` (the CLI in-process), :func:`write_lines`, :func:`shuffled` (inputs
of shuffled lengths), and :class:`FakeGen` (a generator without a model: an input's output is its text reversed,
:func:`expected`) with :class:`Capture` (a binary stream) for the pipeline tests; :func:`failing_on` and
:func:`off_by` (compilers whose compiled step fails, or differs, from a given call) and :func:`run_beam` (a beam
search over a backend) for the capture tests. The fixtures themselves (checkpoints, models) are
``tests/tiny_models.py``'s."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from click.testing import CliRunner, Result
from transformers import AutoTokenizer, GenerationConfig

from seqgen_cli.batching import Batcher, Encoded, Generated, Scored
from seqgen_cli.budget import DeviceBudget
from seqgen_cli.cli import main
from seqgen_cli.config import resolve_generation_config
from seqgen_cli.generator import Generator
from seqgen_cli.loading import Loaded
from seqgen_cli.outputs import OutputText
from seqgen_cli.prompts import PromptSettings
from seqgen_cli.search import Batch, generate
from tests.tiny_models import Loaded as LoadedFixture
from tests.tiny_models import sample_texts, text_batch

REPO = Path(__file__).resolve().parent.parent


def seqgen(*args: str, input: str | bytes | None = None, env: dict[str, str | None] | None = None) -> Result:
    """Run the CLI in-process; returns click's Result (stdout, stderr, exit_code)."""
    return CliRunner().invoke(main, list(args), input=input, env=env, catch_exceptions=False)


class FakeGen:
    """Token ids are code points; the "generation" of an input is its text reversed."""

    backend = "fake"
    prefix = None
    prompt = PromptSettings()
    default_length = None  # a length the test set (Generator.default_length)
    chat_length = None  # no --chat default (Generator.chat_length)
    grammar = None  # no structured outputs (Generator.grammar)
    max_source_length = None
    seed = None

    def __init__(self, n: int = 1, fail=None) -> None:
        self.config = GenerationConfig(num_return_sequences=n, num_beams=n)
        self.model = SimpleNamespace(config=SimpleNamespace(_name_or_path="fake-model"))
        self.loaded = Loaded(None, None, True, torch.device("cpu"), torch.float32)
        self.batches: list[list[list[int]]] = []
        self.fail = fail  # called with the batch before generating; may raise
        self.budget = DeviceBudget(self.loaded.device)  # as a CPU Generator: no limit
        self.texts = OutputText(self.detokenise)

    @property
    def num_return_sequences(self) -> int:
        return self.config.num_return_sequences

    rows_per_input = num_return_sequences

    def encode(self, texts, fields=None):
        return [Encoded([ord(c) for c in t], False) for t in texts]

    def generate_output(self, batch, indices=None, grammars=()):
        """Each input reversed (then its sequence number); with ``output_scores``: score -length, log_prob -2 x it."""
        if self.fail is not None:
            self.fail(batch)
        self.batches.append([list(ids) for ids in batch])
        n = self.config.num_return_sequences
        seqs = [[list(reversed(ids)) + [ord("0") + k] * (k > 0) for k in range(n)] for ids in batch]
        scores = (
            [[Scored(-len(s), -2.0 * len(s)) for s in row] for row in seqs]
            if self.config.output_scores
            else None
        )
        return Generated(seqs, scores)

    def generate_ids(self, batch, indices=None):
        return self.generate_output(batch, indices).sequences

    def detokenise(self, seqs):
        return ["".join(map(chr, s)) for s in seqs]


    def device_stats(self):
        return {"device": "cpu", "dtype": "float32"}

    def batcher(self, chunks, passthrough, batch_size=32, batch_tokens=None, sort_window=None, early=False):
        return Batcher(chunks, passthrough, batch_size=batch_size, batch_tokens=batch_tokens,
                       rows=self.rows_per_input, window=sort_window, grow=early)  # fmt: skip

    generate_batches = Generator.generate_batches  # the real generate loop, over this generate_ids


def expected(texts: list[str]) -> str:
    return "".join(t.strip() and t[::-1] + "\n" or "\n" for t in texts)


def write_lines(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    return path


class Capture:
    """A binary stream for StreamSink."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, b: bytes) -> None:
        self.chunks.append(bytes(b))

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return b"".join(self.chunks).decode()


def one_line_error(res, *needles: str) -> str:
    """The stderr of a failed run: exactly one line, starting `seqgen: error:`, holding ``needles``."""
    lines = res.stderr.strip().splitlines()
    assert res.exit_code != 0 and len(lines) == 1 and lines[0].startswith("seqgen: error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run_seqgen(*args: str, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """``python -m seqgen_cli ARGS`` in a process of its own (signals, pipes, standard streams)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "seqgen_cli", *args]
    kw.setdefault("timeout", 300)
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, **kw)


def failing_on(call: int, error: Exception, after: bool = False) -> Callable[[Any], Any]:
    """A compiler (of a model's ``decode`` or a search step: any ``(state, tensor) -> out``) whose compiled function
    raises ``error`` on its ``call``-th call (1-based; ``after``: once the step has run, as a recording that fails
    after the warm-up wrote the caches)."""

    def compiler(step: Callable[[Any, torch.Tensor], Any]) -> Callable[[Any, torch.Tensor], Any]:
        calls = 0

        def run(state: Any, x: torch.Tensor) -> Any:
            nonlocal calls
            calls += 1
            if calls == call and not after:
                raise error
            out = step(state, x)
            if calls == call:
                raise error
            return out

        return run

    return compiler


def off_by(size: float, from_call: int = 3) -> Callable[[Any], Any]:
    """A compiler (of a model's ``decode``) whose compiled step adds ``size`` to every logit from its
    ``from_call``-th call: a compiled step that differs from the eager one."""

    def compiler(
        decode: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        calls = 0

        def run(state: Any, tokens: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            logits = decode(state, tokens)
            return logits + size if calls >= from_call else logits

        return run

    return compiler


def beam_config(loaded: LoadedFixture, **kwargs: Any) -> Any:
    """Beam 3, 10 new tokens (and ``kwargs``) over a loaded fixture's generation config."""
    return resolve_generation_config(
        loaded.model.generation_config, None, dict(num_beams=3, max_new_tokens=10) | kwargs
    )


def run_beam(backend: Any, loaded: LoadedFixture, batch: Batch | None = None, **kwargs: Any) -> list:
    """The sequences :func:`beam_config` gives over ``backend`` for ``batch`` (default: 5 texts)."""
    config = beam_config(loaded, **kwargs)
    return generate(backend, batch or text_batch(loaded, 5, seed=5), config).sequences


def shuffled(n: int, seed: int) -> list[str]:
    """Inputs of shuffled lengths (3 to 120 words), some empty."""
    texts = sample_texts(n, seed=seed)
    rng = random.Random(seed)
    rng.shuffle(texts)
    return ["" if rng.random() < 0.05 else t for t in texts]


# a fixture's tokenizer's files
TOKENIZER_FILES = ("tokenizer", "special_tokens", "spiece", "vocab", "merges")


def with_fixture_tokenizer(dest: Path, fixture: Path) -> Path:
    """``dest`` with the tokenizer files of the fixture checkpoint ``fixture`` (tests/tiny_models.py: vocabulary
    601, its special ids)."""
    import shutil

    for f in fixture.glob("*"):
        if f.name.startswith(TOKENIZER_FILES):
            shutil.copy(f, dest / f.name)
    return dest


# A ChatML-like chat template: each message between its role marker and EOS, the first after BOS; the assistant's
# turn opened by add_generation_prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token if loop.first else '' }}<|{{ m['role'] }}|> {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def with_chat_template(folder: Path, template: str = CHAT_TEMPLATE) -> Path:
    """``folder``'s tokenizer saved again with ``template`` as its chat template."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder
