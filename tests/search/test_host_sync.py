"""No device->host synchronisation inside the decode loop.

On a GPU every op that reads device memory on the host (``.item()``, ``bool(t)``, ``nonzero``, boolean-mask
indexing, ``tolist()``, a copy of host data into device memory, ...) drains the launch queue and leaves the
GPU idle while Python catches up. The engine promises that a decode step queues work only, and that the
loop reads the device every ``sync_every`` steps (``search/rows.py: default_sync_every``), in
``Rows.check``, then once after the loop (``Rows.remaining``), each followed by the collection of finished
results.

On the CPU tensors already live on the host, so :class:`SyncRecorder` detects the *ops* that would
synchronise on a GPU rather than transfers: a ``TorchDispatchMode`` sees every aten op, and ``tolist`` /
``numpy`` / ``cpu`` / ``to("cpu")`` (which never reach the dispatcher for a CPU tensor) are wrapped at the
Python level. Each op is recorded with the loop iteration and the phase it ran in:

* ``setup``: before the first step (encoder or prefill, processor set-up): once per batch, allowed;
* ``step``: an iteration's processors, search update, reordering and model step: must perform none;
* ``check``: from ``Rows.check`` to the next model step (the check and the collection that follows);
* ``finish``: the final collection after the loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

import tests.equivalence  # noqa: F401  (single intra-op thread)
from seqgen_cli.config import resolve_generation_config
from seqgen_cli.models import EncoderDecoderBackend, get_backend
from seqgen_cli.search import Batch, generate
from seqgen_cli.search.ngram import NGramBlocker
from seqgen_cli.search.rows import default_sync_every
from tests.host_sync import BEAM, SyncRecorder, recording
from tests.tiny_models import load, text_batch


def run_recorded(
    family: str, tiny_models: Any, kwargs: dict, sync_every: int | None, dtype: torch.dtype = torch.float32
) -> tuple[SyncRecorder, Any]:
    loaded = load(tiny_models(family))
    batch: Batch = text_batch(loaded, 8, seed=4)
    config = resolve_generation_config(loaded.model.generation_config, None, kwargs)
    model = loaded.model if dtype == torch.float32 else copy.deepcopy(loaded.model).to(dtype)
    backend = get_backend(model)
    assert not type(backend).__name__.startswith("Generic"), "the fast backend is under test"
    with recording(backend) as rec:
        out = generate(backend, batch, config, seed=0, sync_every=sync_every)
    return rec, out


def assert_cadence(rec: SyncRecorder, every: int) -> None:
    """Checks run after iterations every-1, 2*every-1, ... and nowhere else (the last may end the loop)."""
    expected = [i for i in range(rec.iterations - 1) if (i + 1) % every == 0]
    got = [i for i in rec.checks if i < rec.iterations - 1]
    assert got == expected, f"host checks after iterations {rec.checks}, expected every {every}: {expected}"
    assert all((i + 1) % every == 0 for i in rec.checks), rec.checks


CASES = {
    # bart's generation config forces BOS (0) first and EOS (2) last: forced tokens are exercised too.
    "bart-beam-ngram-minlen-forced": ("bart", BEAM),
    "bart-beam-heuristic-rep": ("bart", dict(BEAM, early_stopping=False, repetition_penalty=1.2)),
    "t5-beam-never-badwords": ("t5", dict(BEAM, early_stopping="never", bad_words_ids=[[5], [7, 8]])),
    "gpt2-beam-ngram-minlen-rep": ("gpt2", dict(BEAM, repetition_penalty=1.3, num_return_sequences=2)),
    "llama-beam-ngram-minlen": ("llama", BEAM),
    # fp16 T5 clamps activations after every sub-layer (sync-free); bf16 Llama keeps float32 attention scores.
    "t5-fp16-beam": ("t5", BEAM, torch.float16),
    "llama-bf16-beam": ("llama", BEAM, torch.bfloat16),
    "bart-greedy": ("bart", dict(max_new_tokens=24, min_new_tokens=9)),
    "llama-greedy-rep-ngram": (
        "llama",
        dict(max_new_tokens=24, min_new_tokens=9, repetition_penalty=1.3, no_repeat_ngram_size=2),
    ),
    "marian-sample": (
        "marian",
        dict(do_sample=True, top_k=8, top_p=0.9, temperature=0.8, max_new_tokens=24, min_new_tokens=9),
    ),
    "gpt2-sample-nrs": (
        "gpt2",
        dict(do_sample=True, top_k=8, top_p=0.9, num_return_sequences=2, max_new_tokens=24, min_new_tokens=2),
    ),
    # --scores: the chosen tokens' log-probs gathered on the device, per step
    "bart-beam-scores": ("bart", dict(BEAM, output_scores=True, return_dict_in_generate=True)),
    "llama-greedy-scores": ("llama", dict(max_new_tokens=24, min_new_tokens=9, output_scores=True, return_dict_in_generate=True)),
}


@pytest.mark.parametrize("sync_every", [4, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_loop_never_syncs_between_checks(tiny_models, case: str, sync_every: int) -> None:
    family, kwargs, *dtype = CASES[case]
    rec, out = run_recorded(family, tiny_models, kwargs, sync_every, *dtype)
    assert rec.iterations > 2 * sync_every, "too short to see two checks: the test would be vacuous"
    assert rec.checks, "no host check ran"
    bad = rec.violations()
    assert not bad, "host syncs inside decode steps:\n" + "\n".join(map(str, bad))
    assert_cadence(rec, sync_every)
    assert any(e.phase == "check" for e in rec.events), "the check itself was not seen: the recorder is blind"
    assert all(seq for per_input in out.sequences for seq in per_input)
    assert (out.token_scores is not None) == ("scores" in case)


def test_cpu_default_checks_every_step(tiny_models) -> None:
    assert default_sync_every(torch.device("cpu")) == 1
    assert default_sync_every(torch.device("cuda")) == 4  # documented GPU cadence
    rec, _ = run_recorded("gpt2", tiny_models, dict(BEAM), None)
    assert not rec.violations(), "\n".join(map(str, rec.violations()))
    assert_cadence(rec, 1)


def inj_item(scores: torch.Tensor) -> None:
    scores[0, 0].item()


def inj_bool(scores: torch.Tensor) -> None:
    if scores.max() > 1e30:
        pass


def inj_int(scores: torch.Tensor) -> None:
    int(scores.argmax())


def inj_nonzero(scores: torch.Tensor) -> None:
    (scores > 0).nonzero()


def inj_mask_index(scores: torch.Tensor) -> None:
    _ = scores[scores > 0]


def inj_tolist(scores: torch.Tensor) -> None:
    scores[:, 0].tolist()


def inj_cpu(scores: torch.Tensor) -> None:
    scores.to("cpu")


def inj_host_tensor(scores: torch.Tensor) -> None:
    scores.new_zeros(2) + torch.tensor([1.0, 2.0])


def inj_multinomial(scores: torch.Tensor) -> None:
    torch.multinomial(torch.softmax(scores.float(), -1), 1)


INJECTIONS = [
    inj_item,
    inj_bool,
    inj_int,
    inj_nonzero,
    inj_mask_index,
    inj_tolist,
    inj_cpu,
    inj_host_tensor,
    inj_multinomial,
]


@pytest.mark.parametrize("inject", INJECTIONS, ids=[f.__name__ for f in INJECTIONS])
def test_recorder_catches_an_inserted_sync(tiny_models, inject: Callable[[torch.Tensor], None]) -> None:
    """The test can fail: one synchronising op inserted into the n-gram blocker is reported, with its step."""
    blocker_call = NGramBlocker.__call__

    def syncing_blocker(self: NGramBlocker, history: Any, scores: torch.Tensor) -> torch.Tensor:
        inject(scores)
        return blocker_call(self, history, scores)

    with mock.patch.object(NGramBlocker, "__call__", syncing_blocker):
        rec, _ = run_recorded("bart", tiny_models, BEAM, 4)
    bad = rec.violations()
    assert bad, f"{inject.__name__} went unnoticed"
    assert {e.iteration for e in bad} == set(range(rec.iterations)), "every step should be reported"
    assert all(inject.__name__ in e.where for e in bad), [str(e) for e in bad]


def test_recorder_catches_a_sync_in_the_model_step(tiny_models) -> None:
    step = EncoderDecoderBackend.step

    def inj_step(self: EncoderDecoderBackend, state: Any, tokens: torch.Tensor) -> torch.Tensor:
        if state.t > 2:
            int(tokens.max())
        return step(self, state, tokens)

    with mock.patch.object(EncoderDecoderBackend, "step", inj_step):
        rec, _ = run_recorded("bart", tiny_models, dict(max_new_tokens=24), 4)
    assert rec.violations() and all("inj_step" in e.where for e in rec.violations())
