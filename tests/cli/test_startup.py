"""Start-up's import rules, each checked in a fresh interpreter: what loads no model imports neither torch nor
transformers (``seqgen --help``, every command's help, ``seqgen eval``), so it starts in a fraction of a second."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers")
# what importing a transformers model class pulls (1.0-1.4 s): the BART family's fast CPU runs need none of it
MODEL_CLASS = ("transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor", "sympy")


def imported_after(argv: list[str], cwd: Path | None = None, watch: tuple[str, ...] = HEAVY) -> set[str]:
    """The modules of ``watch`` in ``sys.modules`` once ``seqgen <argv>`` has run (exit 0) in a fresh
    interpreter."""
    code = (
        "import sys\n"
        "from seqgen_cli.cli import main\n"
        f"try: main({argv!r})\n"
        "except SystemExit as e: assert not e.code, e.code\n"
        f"print('imported:', *(m for m in {watch!r} if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert res.returncode == 0, res.stderr
    last = res.stdout.splitlines()[-1]
    assert last.startswith("imported:"), res.stdout
    return set(last.split()[1:])


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["eval", "--help"], ["bench", "--help"]])
def test_help_imports_no_model_library(argv: list[str]) -> None:
    assert imported_after(argv) == set()


def test_eval_imports_no_model_library(tmp_path: Path) -> None:
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("the cat sat on the mat\na dog ran\n", encoding="utf-8")
    ref.write_text("the cat sat on a mat\na dog ran fast\n", encoding="utf-8")
    assert imported_after(["eval", str(hyp), str(ref), "--metrics", "bleu,chrf"]) == set()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_fast_cpu_run_imports_no_model_class(dtype: str, tiny_models: Callable[[str], Path], tmp_path: Path) -> None:
    """The fast engine on the CPU over a BART-family checkpoint: seqgen's own module tree, no transformers model
    class (``models/own_model.py``)."""
    src = tmp_path / "in.txt"
    src.write_text("a dog ran\nthe committee approved the plan\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    argv = ["generate", "-m", str(tiny_models("marian")), str(src), "-o", str(out), "--max-new-tokens", "3"]
    assert imported_after([*argv, "--dtype", dtype, "--device", "cpu"], watch=MODEL_CLASS) == set()
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2


def test_fast_cpu_run_of_t5gemma_imports_no_model_class(tiny_models: Callable[[str], Path], tmp_path: Path) -> None:
    """T5Gemma (a config per stack, eager attention): its own module tree too (``models/families/t5gemma.py``)."""
    import torch
    import transformers as tf

    from tests.tiny_models import sharpen, t5_vocabulary

    t5, folder = tiny_models("t5"), tmp_path / "t5gemma"
    torch.manual_seed(0)
    config = t5_vocabulary("t5gemma", tf.AutoConfig.from_pretrained(t5).vocab_size)
    sharpen(tf.AutoModelForSeq2SeqLM.from_config(config), seed=4).save_pretrained(folder)
    tf.AutoTokenizer.from_pretrained(t5).save_pretrained(folder)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("a dog ran\nthe committee approved the plan\n", encoding="utf-8")
    argv = ["generate", "-m", str(folder), str(src), "-o", str(out), "--max-new-tokens", "3", "--device", "cpu"]
    assert imported_after(argv, watch=MODEL_CLASS) == set()
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
