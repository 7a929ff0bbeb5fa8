"""What a run did: the closing one-line summary on stderr and the ``--stats`` JSON."""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from seqgen_cli import startup


@dataclass
class Summary:
    inputs: int = 0  # inputs written by this run
    resumed_from: int = 0  # inputs already in the output when this run started
    journaled: int = (
        0  # an unfinished run: outputs kept in the journal for --resume (they wait for earlier ones)
    )
    skipped: int = 0  # inputs written empty (--on-error skip)
    truncated: int = 0
    generated_tokens: int = 0
    at_default_length: int = 0  # outputs that stopped at transformers' default max_length (Generator.default_length)
    incomplete: int = 0  # outputs that ended before their grammar completed (structured outputs)
    batches: int = 0
    padding_ratio: float = 0.0  # share of padded source tokens that are padding
    seconds: float = 0.0
    read_seconds: float = 0.0  # includes waiting for data when the input is a pipe
    tokenise_seconds: float = 0.0
    generate_seconds: float = 0.0
    write_seconds: float = 0.0
    backend: str = ""
    output: str = ""
    interrupted: bool = False
    error: str | None = None
    metrics: dict[str, Any] | None = field(default=None)
    rss_at_start_mb: float = 0.0  # peak resident memory before the run (model loaded)
    # Generator.device_stats(): device, dtype, step path (under CUDA graphs: shapes compiled, compile seconds,
    # steps captured and eager), GPU peak
    device: dict[str, Any] = field(default_factory=dict)
    # --verify: agreement with generate() on the first inputs (seqgen_cli.verify.Agreement.as_dict, "line")
    verify: dict[str, Any] | None = field(default=None)
    # --workers: shards, shard size, retries, Ray start-up seconds and per-worker throughput ("workers")
    distributed: dict[str, Any] | None = field(default=None)

    @property
    def samples_per_second(self) -> float:
        """Inputs generated per second: written, and journaled (an interrupted run's later outputs)."""
        return (self.inputs + self.journaled) / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def line(self, source: str = "", process_seconds: float | None = None) -> str:
        """The closing line: ``seqgen: SOURCE: 5 inputs in 0.1s (4.6s with start-up and model load): ...``.

        ``source``: what was read (:func:`describe_inputs`); ``process_seconds``: the whole process so far,
        start-up and model load included (``seconds`` is the run alone)."""
        done = plural(self.inputs, "input") + (
            f" (after {self.resumed_from} resumed)" if self.resumed_from else ""
        )
        if self.journaled:  # generated, waiting in the journal for an earlier input: --resume writes them
            done += f" written and {self.journaled} more generated (kept in the journal)"
        whole = (
            f" ({process_seconds:.1f}s with start-up and model load)" if process_seconds is not None else ""
        )
        return (
            f"seqgen: {source + ': ' if source else ''}{done} in {self.seconds:.1f}s{whole}: "
            f"{self.samples_per_second:.2f} samples/s, "
            f"{self.tokens_per_second:.1f} generated tokens/s, padding {100 * self.padding_ratio:.1f}%; "
            f"time read+tokenise {self.read_seconds + self.tokenise_seconds:.1f}s, "
            f"generate {self.generate_seconds:.1f}s, write {self.write_seconds:.1f}s; backend {self.ran()}"
            + (f" on {self.device['device']} {self.device['dtype']}" if self.device else "")
            + (f", step {path}" if (path := self.device.get("step_path")) else "")
            + capture_note(self.device)
            + (f", peak GPU memory {gpu:.0f} MiB" if (gpu := self.device.get("peak_gpu_memory_mb")) else "")
            + (f"; {self.verify['line']}" if self.verify else "")
        )

    def add_counts(self, d: dict[str, Any]) -> None:
        """Add a ``--workers`` shard's counts and times (its worker's :meth:`as_dict`; empty for a part finished
        before a driver loss): the run's summary sums its shards'."""
        more = d.get("batches", 0)
        if more:  # the padding share over both, weighted by batches
            padded = self.padding_ratio * self.batches + d["padding_ratio"] * more
            self.padding_ratio = padded / (self.batches + more)
        self.batches += more
        for key in ("skipped", "truncated", "generated_tokens", "at_default_length", "incomplete"):
            setattr(self, key, getattr(self, key) + d.get(key, 0))
        for key in ("read_seconds", "tokenise_seconds", "generate_seconds", "write_seconds"):
            setattr(self, key, getattr(self, key) + d.get(key, 0.0))

    def ran(self) -> str:
        """``--backend`` and the decoder that ran (``--stats`` ``device.engine``), for the closing line: ``fast (bart
        decoder)``, ``generic (why)`` (no fast decoder runs the model: ``fast`` would mislead), ``hf`` (its step says
        ``generate()``)."""
        decoder = self.device.get("engine")
        if not decoder or decoder == "generate()":
            return self.backend
        return decoder if decoder.startswith("generic") else f"{self.backend} ({decoder})"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples_per_second"] = self.samples_per_second
        d["generated_tokens_per_second"] = self.tokens_per_second
        d["peak_rss_mb"] = peak_rss_mb()
        d["startup"] = startup.report()  # this process's seconds before its first decode step
        return d


def plural(n: int, noun: str) -> str:
    """``1 input``, ``5 inputs``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def describe_inputs(paths: Sequence[str]) -> str:
    """The input, briefly, for the closing line: ``in.txt``, ``stdin``, ``a.txt, b.txt``, ``a.txt and 4 more``."""
    names = ["stdin" if p == "-" else p for p in paths or ["-"]]
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]} and {len(names) - 1} more"


def capture_note(device: dict[str, Any]) -> str:
    """`` (5 shapes compiled in 83s, 97% of 4,100 steps captured)`` under CUDA graphs, else nothing."""
    if "shapes_compiled" not in device:
        return ""
    steps = device["captured_steps"] + device["eager_steps"]
    share = 100 * device["captured_steps"] / steps if steps else 0.0
    return (
        f" ({device['shapes_compiled']} shapes compiled in {device['compile_seconds']:.0f}s, "
        f"{share:.0f}% of {steps:,} steps captured)"
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / (1024 * 1024) if sys.platform == "darwin" else kb / 1024
