"""Helpers every test file uses: :func:`seqgen` (the CLI in-process) and :func:`load_tiny` (a checkpoint's
model and tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner, Result
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from seqgen_cli.cli import main


def seqgen(*args: str, input: str | bytes | None = None, env: dict[str, str | None] | None = None) -> Result:
    """Run the CLI in-process; returns click's Result (stdout, stderr, exit_code)."""
    return CliRunner().invoke(main, list(args), input=input, env=env, catch_exceptions=False)


def load_tiny(path: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A checkpoint's model (seq2seq or causal, as its config says; in eval mode) and tokenizer."""
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path)
