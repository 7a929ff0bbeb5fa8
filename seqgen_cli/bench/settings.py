"""What one ``seqgen bench`` invocation runs (:class:`BenchSettings`): its own module, below the runners that
read it (``run``, ``cells``, ``decode``, ``e2e``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BenchSettings:
    """Everything one ``seqgen bench`` invocation needs."""

    model: str
    input: str
    n: int = 32
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_beams: list[int] = field(default_factory=lambda: [1, 4])
    compare: list[str] = field(default_factory=lambda: ["hf", "ct2"])
    modes: list[str] = field(default_factory=lambda: ["decode"])
    device: str = "auto"
    dtype: str = "auto"
    fixed_new_tokens: int | None = None
    repeats: int = 3
    warmup: bool = True
    max_batches: int | None = None
    threads: int | None = None
    out: str = "bench-results"
    preset: str | None = None
    prefix: str | None = None
    max_source_length: int | None = None
    ct2_cache: str | None = None
    backend: str = "auto"  # seqgen's: auto, fast or hf (generate() inside seqgen's pipeline)
    target_lang: str | None = None  # as seqgen generate --target-lang takes it (CTranslate2: the target prefix)
    seed: int | None = None  # sampling
    generation: dict[str, Any] = field(default_factory=dict)

    def generation_flags(self, beams: int) -> dict[str, Any]:
        """The generation flags of one cell: the user's, the cell's beams, fixed lengths when asked."""
        flags = {k: v for k, v in self.generation.items() if v is not None}
        flags["num_beams"] = beams
        flags["num_return_sequences"] = 1
        if self.fixed_new_tokens is not None:
            for k in ("max_length", "min_length"):
                flags.pop(k, None)
            flags["max_new_tokens"] = flags["min_new_tokens"] = self.fixed_new_tokens
        return flags
