"""Where a checked ``seqgen generate`` job runs: in this process (the checkpoint's digests hashed while the
model loads, the notes said before the run) or on Ray workers (``--workers``: :mod:`~.driver`, Ray imported
only then)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from seqgen_cli.digests import prefetch
from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import GeneratorSpec, startup_notes
from seqgen_cli.pipeline.cluster import ClusterOptions
from seqgen_cli.pipeline.job import Job, generate_job
from seqgen_cli.pipeline.messages import no_refill
from seqgen_cli.pipeline.stats import Summary


def cluster_options(
    workers: int | None, flags: Mapping[str, float | int | str | None], *, verify: int | None
) -> ClusterOptions | None:
    """``--workers N`` and its flags (``None``: not given) as the cluster to run on; ``None``: this process. A
    cluster flag without ``--workers``, or ``--verify`` with it, is refused before anything is read."""
    if workers is not None and verify:
        raise SeqgenError("--verify runs in one process: not with --workers")
    given = {k: v for k, v in flags.items() if v is not None}
    if workers is None:
        if given:
            raise SeqgenError(f"--{next(iter(given)).replace('_', '-')} needs --workers N")
        return None
    return ClusterOptions(workers, **given)


def run_job(
    spec: GeneratorSpec,
    job: Job,
    cluster: ClusterOptions | None,
    *,
    quiet: bool,
    note: Callable[[str], None],
) -> tuple[Summary, int | None]:
    """Run ``job`` with the model ``spec`` builds: the summary, and the source length inputs were truncated to
    (for the closing lines). ``note`` gets each line to show before the run (none when ``quiet``)."""
    if cluster is not None:
        from seqgen_cli.pipeline.driver import generate_distributed  # Ray is imported only here

        summary = generate_distributed(spec, job, cluster)
        return summary, (summary.distributed or {}).get("max_source_length")
    prefetch(spec.model)  # the checkpoint's file digests (the run's identity), hashed while it loads
    gen = spec.build()
    if not quiet:
        for line in startup_notes(gen, spec.generation):
            note(f"seqgen: note: {line}")
        if spec.refill and not gen.refill:
            note(no_refill(gen))
    return generate_job(gen, job), gen.max_source_length
