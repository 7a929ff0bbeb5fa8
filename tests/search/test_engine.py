"""One decode loop (``search/engine.py``): a batch, a batch on the capture wrapper (its kept state and its static
search) and the refill engine's lanes all enter ``Engine.run`` once per call, and the backends step only there
(a batch's start aside: the decoder start token's step); the backends have one step method."""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from typing import Any

import pytest

from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import get_backend
from seqgen_cli.models.capture import CapturedBackend
from seqgen_cli.models.decoder_only import DecoderOnlyBackend
from seqgen_cli.models.encoder_decoder import EncoderDecoderBackend
from seqgen_cli.models.generic import GenericBackend
from seqgen_cli.search import generate
from seqgen_cli.search.engine import Engine
from seqgen_cli.search.refill import generate_refill
from tests.tiny_models import load, text_batch

BEAM = dict(num_beams=3, no_repeat_ngram_size=2, max_new_tokens=12, min_new_tokens=2)
GREEDY = dict(max_new_tokens=12)


def keep(fn: Any) -> Any:
    """A "compiler" that keeps the function as it is (the capture wrapper's logic, eagerly)."""
    return fn


def watch(monkeypatch: pytest.MonkeyPatch, backend: Any) -> tuple[Counter[str], Counter[str]]:
    """Count the loop's entries and who calls ``backend.step`` (the caller's qualified name)."""
    entries: Counter[str] = Counter()
    callers: Counter[str] = Counter()
    run, step = Engine.run, backend.step

    def counted_run(self: Engine, *args: Any, **kwargs: Any) -> Any:
        entries["run"] += 1
        return run(self, *args, **kwargs)

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        callers[sys._getframe(1).f_code.co_qualname] += 1
        return step(*args, **kwargs)

    monkeypatch.setattr(Engine, "run", counted_run)
    monkeypatch.setattr(backend, "step", counted_step)
    return entries, callers


CASES = [
    ("bart", "plain", BEAM),
    ("gpt2", "plain", GREEDY),
    ("t5", "captured", BEAM),
    ("llama", "captured-static-search", BEAM),
    ("bart", "refill", BEAM),
    ("gpt2", "refill", GREEDY),
    ("bart", "generic", BEAM),
]


@pytest.mark.parametrize(("family", "path", "settings"), CASES, ids=[f"{f}-{p}" for f, p, _ in CASES])
def test_every_path_runs_the_one_loop(tiny_models, monkeypatch, family: str, path: str, settings: dict) -> None:
    loaded = load(tiny_models(family))
    batch = text_batch(loaded, 6, seed=2)
    config = resolve_generation_config(loaded.model.generation_config, None, settings)
    fast = get_backend(loaded.model)
    backend: Any = {
        "captured": lambda: CapturedBackend(fast, keep),
        "captured-static-search": lambda: CapturedBackend(fast, keep, search_compiler=keep),
        "generic": lambda: GenericBackend(loaded.model),
    }.get(path, lambda: fast)()
    entries, callers = watch(monkeypatch, backend)
    if path == "refill":
        out = generate_refill(backend, batch, config, lanes=3)
    else:
        out = generate(backend, batch, config)
    assert len(out.sequences) == 6 and all(out.sequences)
    assert entries["run"] == 1
    loop_steps = callers.pop("Engine.step")
    assert loop_steps >= 2
    start = 1 if loaded.model.config.is_encoder_decoder and path != "refill" else 0  # the decoder start token
    assert dict(callers) == ({"start_rows": 1} if start else {}), callers
    if path == "captured-static-search":
        assert backend.stats()["search_compiled_steps"] > 0, "the static search ran"


@pytest.mark.parametrize("cls", [EncoderDecoderBackend, DecoderOnlyBackend, CapturedBackend, GenericBackend])
def test_a_backend_has_one_step_method(cls: type) -> None:
    """No second way to step (a lane step, a static-search step, a plain step): ``step`` serves every state."""
    names = [name for name, _ in inspect.getmembers(cls, inspect.isfunction)]
    steps = [n for n in names if n.endswith("step") or n.startswith("step")]
    assert steps == ["step"], steps


def test_search_modules_import_no_private_names() -> None:
    """The dynamic and the static search share their helpers through public names (``search/beam_step.py``,
    ``search/processors.py``, ``search/history.py``): no module of ``search/`` imports another's ``_private`` name."""
    import ast
    from pathlib import Path

    import seqgen_cli.search

    private = []
    for path in Path(seqgen_cli.search.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("seqgen_cli"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not private, private
