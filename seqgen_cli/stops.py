"""Where an output ends besides EOS: stop strings (the checkpoint's ``stop_strings``, then ``--stop``'s), checked
before the model loads, and stop token ids (``--stop-token-id``) added to the EOS ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from seqgen_cli.errors import SeqgenError
from seqgen_cli.rules import CHECKPOINT, FLAG, describe

if TYPE_CHECKING:  # a type only: this module loads no transformers
    from transformers import GenerationConfig

# transformers' StopStringCriteria builds tables over the whole vocabulary for each stop string: about 55 ms a
# string on GPT-2's 50k tokens, so 1000 strings take a minute before the first input. More than any stop list
# in use needs.
MOST_STOPS = 64


def check_stop_strings(value: Any, source: str) -> list[str]:
    """``stop_strings`` (a string or a list of strings, as ``generate()`` takes them) as a list; one line naming
    the source for anything else: an empty string (it would stop nothing), a dict, a number, a nested list, more
    than :data:`MOST_STOPS`."""
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise SeqgenError(f"{describe('stop_strings', value, source)}: must be a string or a list of strings")
    if any(v == "" for v in values):
        what = "--stop ''" if source == FLAG else describe("stop_strings", value, source)
        raise SeqgenError(f"{what}: an empty stop string stops nothing: drop it")
    if len(values) > MOST_STOPS:
        raise SeqgenError(
            f"{len(values)} stop strings: at most {MOST_STOPS} (each costs a pass over the vocabulary)"
        )
    return values


def all_stops(own: Any, stop: Sequence[str]) -> list[str] | None:
    """The checkpoint's ``stop_strings``, then ``--stop``'s (None: none)."""
    return check_stop_strings([*check_stop_strings(own, CHECKPOINT), *stop], FLAG) or None


def with_stop_tokens(config: GenerationConfig) -> GenerationConfig:
    """``stop_token_id`` (``--stop-token-id``, a preset's) added to the EOS ids, so that every backend, and
    ``generate()``, ends an output there: ``generate(eos_token_id=[...])``'s outputs."""
    extra = getattr(config, "stop_token_id", None)
    if not extra:
        return config
    eos = config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    config.eos_token_id = ids + [i for i in ([extra] if isinstance(extra, int) else extra) if i not in ids]
    return config
