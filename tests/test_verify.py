"""Self-check on the user's device, on the CPU.

* ``--verify N``: the first N inputs through seqgen's path and through ``generate()``, the token-identical
  share (near-ties named) in the closing line and ``--stats``; ``--verify strict`` stops before writing when
  they differ beyond near-ties. A disagreement is injected by perturbing the fast backend's logits.
* each captured shape's first replay is checked against the eager step; a fake compiled step that is off
  switches to eager with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from seqgen_cli.cli import main
from seqgen_cli.generator import Generator
from seqgen_cli.models import EncoderDecoderBackend, get_backend
from seqgen_cli.models.capture import CapturedBackend
from seqgen_cli.models.compiled_calls import step_tolerance
from seqgen_cli.search import Batch, generate
from seqgen_cli.verify import Agreement, default_inputs, tolerance, verify
from tests.helpers import beam_config, off_by, run_beam
from tests.tiny_models import load, text_batch

TEXTS = [
    "the cat sat on the mat and looked at the dog",
    "a short line",
    "rain fell over the hills all night long, and the river rose",
    "numbers one two three four five six",
]


def perturb_one_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The BART backend's logits make its most likely first token win by a mile in row 0: a real bug's size."""
    step = EncoderDecoderBackend.step

    def wrong(self: Any, state: Any, tokens: torch.Tensor) -> torch.Tensor:
        logits = step(self, state, tokens)
        if state.t == 2:  # the second generated token of the first row: another token, by far
            logits[0, logits[0].argmin()] = 1e4
        return logits

    monkeypatch.setattr(EncoderDecoderBackend, "step", wrong)


def _gen(tiny_models: Any) -> Generator:
    return Generator(str(tiny_models("bart")), device="cpu", num_beams=2, max_new_tokens=8)


def test_verify_agrees_in_float32(tiny_models) -> None:
    gen = _gen(tiny_models)
    ids = [e.ids for e in gen.encode(TEXTS)]
    result = verify(gen, ids, names=[f"in.txt:{i + 1}" for i in range(len(ids))])
    assert result.total == 4 and result.identical + len(result.near_ties) == 4 and not result.mismatches
    assert result.line().startswith(f"verify {result.identical}/4 identical")


def test_an_injected_disagreement_is_found_and_named(tiny_models, monkeypatch) -> None:
    gen = _gen(tiny_models)
    ids = [e.ids for e in gen.encode(TEXTS)]
    perturb_one_token(monkeypatch)
    result = verify(gen, ids, names=[f"in.txt:{i + 1}" for i in range(len(ids))])
    assert result.differing == ["in.txt:1"] and result.identical == 3
    assert result.mismatches[0].startswith("in.txt:1 #0: from token ")
    assert result.line() == "verify 3/4 identical (1 differ)"
    assert result.as_dict()["share"] == 75.0


def test_sampling_and_the_hf_backend_are_not_compared(tiny_models) -> None:
    path = str(tiny_models("bart"))
    sampled = Generator(path, device="cpu", do_sample=True, max_new_tokens=4, seed=1)
    assert "sampling" in (verify(sampled, [[5, 6, 7, 2]]).note or "")
    hf = Generator(path, device="cpu", backend="hf", max_new_tokens=4)
    assert verify(hf, [[5, 6, 7, 2]]).note == "the backend is generate() itself"


def test_defaults_and_tolerances() -> None:
    assert default_inputs(torch.device("cuda", 0)) == 8 and default_inputs(torch.device("cpu")) == 0
    assert tolerance(torch.float32) == 1e-5 and tolerance(torch.bfloat16) > tolerance(torch.float16) > 1e-5
    assert step_tolerance(torch.float32) == 1e-3 and step_tolerance(torch.bfloat16) > 1e-2
    assert Agreement(total=8, identical=7, near_ties=["x"]).line() == "verify 7/8 identical (1 near-tie)"


def _cli(tiny_models: Any, tmp_path: Path, *flags: str) -> tuple[Any, Path, Path]:
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS * 3) + "\n", encoding="utf-8")
    out, stats = tmp_path / "out.txt", tmp_path / "stats.json"
    args = ["generate", "-m", str(tiny_models("bart")), str(src), "-o", str(out), "--stats", str(stats)]
    args += ["--num-beams", "2", "--max-new-tokens", "8", *flags]
    return CliRunner().invoke(main, args), out, stats


def test_cli_verify_reports_the_share(tiny_models, tmp_path, monkeypatch) -> None:
    perturb_one_token(monkeypatch)
    result, out, stats = _cli(tiny_models, tmp_path, "--verify", "4")
    assert result.exit_code == 0, result.output
    assert "verify 3/4 identical (1 differ)" in result.output
    assert len(out.read_text().splitlines()) == 12
    report = json.loads(stats.read_text())["verify"]
    assert (
        report["total"] == 4 and report["identical"] == 3 and report["differing"] == [f"{tmp_path}/in.txt:1"]
    )


def test_cli_verify_strict_stops_before_writing(tiny_models, tmp_path, monkeypatch) -> None:
    perturb_one_token(monkeypatch)
    result, out, _ = _cli(tiny_models, tmp_path, "--verify", "strict")
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.startswith("seqgen: error:")]
    assert len(lines) == 1 and "--verify strict" in lines[0] and "in.txt:1" in lines[0], result.output
    assert not out.exists()


def test_cli_verify_strict_passes_when_they_agree(tiny_models, tmp_path) -> None:
    result, out, stats = _cli(tiny_models, tmp_path, "--verify", "strict")
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 12
    report = json.loads(stats.read_text())["verify"]
    assert report["total"] == 8 and not report["mismatches"]


def test_cli_verify_is_off_by_default_on_the_cpu(tiny_models, tmp_path) -> None:
    result, _, stats = _cli(tiny_models, tmp_path)
    assert result.exit_code == 0, result.output
    assert (
        json.loads(stats.read_text())["verify"] is None
        and "verify " not in result.output
        and "verify:" not in result.output
    )


def test_cli_verify_rejects_a_bad_value(tiny_models, tmp_path) -> None:
    result, _, _ = _cli(tiny_models, tmp_path, "--verify", "some")
    assert result.exit_code == 2 and "--verify" in result.output


# -- the captured step's first replay, checked against the eager step -----------------------------------


def test_a_compiled_step_that_differs_switches_to_eager(tiny_models) -> None:
    loaded = load(tiny_models("bart"))
    reference = run_beam(get_backend(loaded.model), loaded)
    backend = CapturedBackend(get_backend(loaded.model), off_by(float("nan")))
    assert run_beam(backend, loaded) == reference
    assert backend.decoder.compiled is None and backend.steps["captured"] == 2
    assert backend.path.startswith("captured, then eager (compiled step differs from eager: max |diff| nan")


def test_a_compiled_step_within_rounding_stays_captured(tiny_models) -> None:
    loaded = load(tiny_models("bart"))
    batch = text_batch(loaded, 5, seed=5)
    backend = CapturedBackend(get_backend(loaded.model), off_by(1e-6))
    out = generate(backend, batch, beam_config(loaded)).sequences
    assert out == run_beam(get_backend(loaded.model), loaded, batch)
    assert backend.path == "captured" and backend.steps["eager"] == 0


def test_a_compiled_step_off_from_its_first_replay_is_caught(tiny_models) -> None:
    """Wrong by a logit's size from the first replay (a stale cache would be): caught there, then eager.
    One input held to 4 tokens at least: its rows stay one shape, so the second captured step is that replay."""
    loaded = load(tiny_models("llama"))
    batch = Batch(*text_batch(loaded, 1, seed=1).__dict__.values())
    config = beam_config(loaded, min_new_tokens=4)
    reference = generate(get_backend(loaded.model), batch, config).sequences
    backend = CapturedBackend(get_backend(loaded.model), off_by(5.0))
    assert generate(backend, batch, config).sequences == reference
    assert "compiled step differs from eager" in backend.path and backend.steps["captured"] == 2


def test_out_of_memory_while_verifying_is_reported(tiny_models, monkeypatch) -> None:
    gen = _gen(tiny_models)

    def oom(batch: Any, *args: Any, **kwargs: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA error: tried to allocate 20.00 GiB")

    monkeypatch.setattr(gen, "generate_output", oom)
    result = verify(gen, [e.ids for e in gen.encode(TEXTS)])
    assert result.note == "out of memory checking 4 inputs" and result.total == 0
