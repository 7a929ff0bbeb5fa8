"""Scale-out on Ray: one ``seqgen generate`` over many workers (GPUs, machines), written as one process.

The driver (this process) reads the input and cuts it into contiguous shards (:class:`~.shards.Cutter`). Ray
actors (:class:`~.worker.ShardWorker`, one model load each) take shards as they free up (a fast worker takes
more) and write each into a part file. The driver appends finished parts to the output in input order,
recording each in the output's own index as a one-process run does, and deletes them. A lost worker's shard
goes to another worker (or the restarted one), which resumes the part; a lost driver is rerun with
``--resume``: merged inputs are skipped and parts are reused. This module is imported only with ``--workers``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import GeneratorSpec
from seqgen_cli.pipeline import resume
from seqgen_cli.pipeline.cluster import ClusterOptions, check_resources, connect, import_ray, node_id
from seqgen_cli.pipeline.formats import DRIVER_MARK, IndexEntry, InputDigest, parts_dir, remove_part
from seqgen_cli.pipeline.job import Job, guarded, open_sink, score, write_stats
from seqgen_cli.pipeline.ledger import ShardLedger
from seqgen_cli.pipeline.progress import Progress
from seqgen_cli.pipeline.records import read_records
from seqgen_cli.pipeline.shards import Cutter, Shard, count_lines
from seqgen_cli.pipeline.sinks import Sink, is_stream
from seqgen_cli.pipeline.stats import Summary, peak_rss_mb
from seqgen_cli.pipeline.worker import ShardResult, ShardTask, ShardWorker

DEFAULT_SHARD_SIZE = 4096
MIN_SHARD_SIZE = 16
LOOKAHEAD_PER_WORKER = 2  # shards cut beyond the oldest unmerged one, per worker (bounds driver memory)
STARTUP_NOTICE_SECONDS = 60.0

Events = Callable[[str, dict[str, Any]], None]


def auto_shard_size(total: int | None, workers: int) -> int:
    """A few thousand inputs; for a small input, fewer, so that each worker gets about four shards."""
    if total is None:
        return DEFAULT_SHARD_SIZE
    return max(MIN_SHARD_SIZE, min(DEFAULT_SHARD_SIZE, -(-total // (4 * workers))))


def generate_distributed(
    generator: GeneratorSpec, job: Job, cluster: ClusterOptions, *, events: Events | None = None
) -> Summary:
    """Run ``job`` on ``cluster.workers`` Ray actors (``generator.build()`` each).

    Joins the Ray cluster at ``cluster.address`` (or starts a local one, on loopback) unless this process
    is already connected. ``events(kind, info)`` is told of each worker's progress (``"progress"``: pid,
    shard, done) and merged shard (``"merged"``), for tests and monitoring.
    """
    if job.opts.reference and is_stream(job.output):
        raise SeqgenError("--reference with --workers needs -o FILE")
    if not is_stream(job.output) and not job.opts.resume:
        resume.check_fresh(job.output)
    t0 = time.perf_counter()
    ray = import_ray(local=cluster.address is None)
    stdout = sys.stdout
    sys.stdout = sys.stderr  # Ray prints its notices (e.g. a worker died) to sys.stdout: not into the output
    try:
        connected = connect(ray, cluster)
        try:
            return _Driver(ray, generator, job, cluster, events, t0).run(stdout)
        finally:
            if connected:
                ray.shutdown()
    finally:
        sys.stdout = stdout


class _Worker:
    """The driver's view of one actor."""

    def __init__(self, index: int, handle: Any) -> None:
        self.index, self.handle = index, handle
        self.hello_ref: Any = handle.hello.remote()
        self.task_ref: Any = None
        self.poll_ref: Any = None
        self.shard: Shard | None = None
        self.ready = False
        self.progress = 0  # inputs done in the current shard, as last polled
        self.started = 0.0
        self.deaths = 0
        self.hello_failures = 0  # in a row
        self.pids: list[int] = []
        self.nodes: list[str] = []  # the node of each of its processes (a restart may land on another)
        self.stats: dict[str, Any] = dict(shards=0, inputs=0, generated_tokens=0, busy_seconds=0.0)

    @property
    def pid(self) -> int:
        return self.pids[-1] if self.pids else 0

    def start(self, shard: Shard) -> None:
        """Send ``shard`` to the actor."""
        shard.attempts += 1
        self.shard, self.progress, self.started = shard, 0, time.perf_counter()
        self.task_ref = self.handle.run_shard.remote(ShardTask(shard.name, shard.records))

    def finish(self, r: ShardResult) -> None:
        """The actor returned its shard's result: count it, and be idle."""
        self.task_ref, self.shard = None, None
        self.stats["shards"] += 1
        self.stats["inputs"] += r.summary.get("inputs", 0)
        self.stats["generated_tokens"] += r.summary.get("generated_tokens", 0)
        self.stats["busy_seconds"] += time.perf_counter() - self.started

    def report(self) -> dict[str, Any]:
        busy = self.stats["busy_seconds"]
        return dict(
            worker=self.index,
            nodes=self.nodes,
            pids=self.pids,
            restarts=self.deaths,
            **self.stats,
            samples_per_second=self.stats["inputs"] / busy if busy else 0.0,
            generated_tokens_per_second=self.stats["generated_tokens"] / busy if busy else 0.0,
        )


class _Pool:
    """The Ray actors: started, answering ``hello`` once the model is loaded, restarted by Ray when they die,
    dropped after ``max_restarts``."""

    def __init__(self, ray: Any, generator: GeneratorSpec, opts: Any, cluster: ClusterOptions) -> None:
        self.ray, self.generator, self.opts, self.cluster = ray, generator, opts, cluster
        self.workers: list[_Worker] = []
        self.lost_workers: list[_Worker] = []  # dropped after too many restarts

    def start(self, parts: Path) -> None:
        """One actor per worker, each loading the model (``hello`` answers once it has)."""
        cl = self.cluster
        actor = self.ray.remote(
            num_cpus=cl.cpus_per_worker,
            num_gpus=cl.gpus_per_worker,
            max_restarts=cl.max_restarts,
            max_concurrency=2,  # progress() answers while run_shard() works
        )(ShardWorker)
        threads = max(1, int(cl.cpus_per_worker)) if cl.gpus_per_worker == 0 else None
        node = node_id()
        for i in range(cl.workers):
            handle = actor.remote(self.generator, self.opts, str(parts.resolve()), node, threads)
            self.workers.append(_Worker(i, handle))

    def hello(self, w: _Worker) -> dict[str, Any] | None:
        """Take a worker's hello; None when its process died (it is restarted, or dropped)."""
        try:
            info = self.ray.get(w.hello_ref)
        except self.ray.exceptions.RayActorError:  # died loading the model, or was already dead when asked
            w.hello_failures += 1
            self.lost(w, died=False)
            return None
        w.hello_ref, w.hello_failures = None, 0
        if info["error"] is not None:
            raise SeqgenError(f"a worker could not load the model: {info['error']}")
        w.ready = True
        w.pids.append(info["pid"])
        w.nodes.append(info["node"])
        return info

    def lost(self, w: _Worker, died: bool = True) -> None:
        """A worker's process died: wait for Ray to restart it, or drop it after ``max_restarts``."""
        w.deaths += died
        w.ready, w.task_ref, w.poll_ref, w.shard, w.progress = False, None, None, None, 0
        if w.deaths > self.cluster.max_restarts or w.hello_failures > self.cluster.max_restarts + 1:
            self.workers.remove(w)
            self.lost_workers.append(w)
            if not self.workers:
                raise SeqgenError(self._why_all_died())
            return
        w.hello_ref = w.handle.hello.remote()  # answered once the restarted process has loaded the model

    def _why_all_died(self) -> str:
        """Every worker is gone: because the cluster took this driver's node for dead (a connection lost for longer
        than its health checks allow: its job's workers go with it), or each died on its own."""
        try:
            cut_off = any(n["NodeID"] == node_id() and not n["Alive"] for n in self.ray.nodes())
        except Exception:  # noqa: BLE001 - the cluster cannot be asked either: say what is known
            cut_off = False
        if cut_off:
            return "the Ray cluster took this driver's node for dead (its connection lost too long) and ended its workers"
        return "every worker died (see the Ray logs of their nodes for why)"

    def first_hello(self) -> dict[str, Any]:
        waited = 0.0
        while True:
            refs = [w.hello_ref for w in self.workers if w.hello_ref is not None]
            ready, _ = self.ray.wait(refs, num_returns=1, timeout=STARTUP_NOTICE_SECONDS)
            if not ready:
                waited += STARTUP_NOTICE_SECONDS
                cl = self.cluster
                print(
                    f"seqgen: still waiting after {waited:.0f}s for a worker to load the model (each needs "
                    f"{cl.cpus_per_worker:g} CPUs, {cl.gpus_per_worker:g} GPUs; free in the cluster: "
                    f"{self.ray.available_resources()})",
                    file=sys.stderr,
                )
                continue
            w = next(w for w in self.workers if w.hello_ref == ready[0])
            info = self.hello(w)
            if info is not None:
                return info

    def wait(self) -> list[Any]:
        """Wait briefly for a result or a restarted worker's hello; the one that came, if any."""
        refs = [w.task_ref for w in self.workers if w.task_ref is not None]
        refs += [w.hello_ref for w in self.workers if w.hello_ref is not None]
        if not refs:
            time.sleep(0.05)  # waiting for the reader
            return []
        return self.ray.wait(refs, num_returns=1, timeout=0.2)[0]

    def owner(self, ref: Any) -> _Worker:
        """The worker whose result or hello ``ref`` is."""
        return next(w for w in self.workers if ref in (w.task_ref, w.hello_ref))

    def poll(self, events: Events) -> int:
        """Ask busy workers how far they are (``events``: ``"progress"``); the inputs done in their shards."""
        polls = [w.poll_ref for w in self.workers if w.poll_ref is not None]
        ready = set(self.ray.wait(polls, num_returns=len(polls), timeout=0)[0]) if polls else set()
        for w in self.workers:
            if w.poll_ref is not None and w.poll_ref in ready:
                try:
                    w.progress = self.ray.get(w.poll_ref)
                except self.ray.exceptions.RayError:
                    w.progress = 0
                w.poll_ref = None
                if w.shard is not None:
                    events("progress", {"pid": w.pid, "seq": w.shard.seq, "done": w.progress})
            if w.shard is not None and w.poll_ref is None:
                w.poll_ref = w.handle.progress.remote()
        return sum(w.progress for w in self.workers if w.shard is not None)

    def kill(self) -> None:
        for w in self.workers + self.lost_workers:
            self.ray.kill(w.handle, no_restart=True)

    def report(self) -> list[dict[str, Any]]:
        return [w.report() for w in sorted(self.workers + self.lost_workers, key=lambda w: w.index)]


def _open_output(
    job: Job, settings: dict[str, Any], parts: Path, stdout: TextIO
) -> tuple[Sink, IndexEntry | None]:
    """The output and, resumed, where its index says the last run stopped; the parts folder keeps only the parts
    a resumed run can still use."""
    sink, state = open_sink(job.output, settings, job.opts, part=job.shard is not None, stdout=stdout.buffer)
    if is_stream(job.output):
        return sink, None
    if state is None:
        shutil.rmtree(parts, ignore_errors=True)  # parts of a run that is not being resumed
        parts.mkdir()
        return sink, None
    parts.mkdir(exist_ok=True)
    for old in parts.iterdir():  # parts merged before the driver was lost
        head = old.name.split("-", 1)[0]
        if head.isdigit() and int(head) < state.done:
            old.unlink(missing_ok=True)
    return sink, state


class _Driver:
    """One ``--workers`` run: the output opened (or resumed), shards handed to the pool's workers and their
    results merged in order (the :class:`~.ledger.ShardLedger` keeps the account), the summary."""

    def __init__(
        self,
        ray: Any,
        generator: GeneratorSpec,
        job: Job,
        cluster: ClusterOptions,
        events: Events | None,
        t0: float,
    ) -> None:
        self.ray, self.job, self.cluster, self.t0 = ray, job, cluster, t0
        self.paths, self.output, self.opts = job.paths, job.output, job.opts
        self.events = events or (lambda kind, info: None)
        self.summary = Summary(
            output=job.output if job.output != "-" else "<stdout>", rss_at_start_mb=peak_rss_mb()
        )
        self.pool = _Pool(ray, generator, job.opts, cluster)
        self.shards_merged = self.retried = self.size = self.start = 0

    # -- the run -----------------------------------------------------------------------------------
    def run(self, stdout: TextIO) -> Summary:
        check_resources(self.ray, self.cluster)
        tmp = tempfile.mkdtemp(prefix="seqgen-parts-") if is_stream(self.output) else None
        parts = Path(tmp) if tmp else parts_dir(self.output)
        if tmp is None:
            parts.mkdir(exist_ok=True)
        self.pool.start(parts)
        sink: Sink | None = None
        complete = False
        try:
            first = self.pool.first_hello()
            self.worker_settings = first["settings"]
            # one of N drivers (--shard I/N --workers M): the shard is in the settings, as in one process
            settings = {**first["settings"], **(self.job.shard.settings() if self.job.shard else {})}
            self.summary.backend = first["backend"]
            self.info = first
            sink, state = _open_output(self.job, settings, parts, stdout)
            (parts / DRIVER_MARK).write_text(node_id(), encoding="utf-8")
            self.start = self.summary.resumed_from = state.done if state else 0
            startup = time.perf_counter() - self.t0
            complete = self._run_loop(sink, state, parts)
            self.summary.distributed = self._report(startup)
        finally:
            self.pool.kill()
            if sink is not None:
                sink.close(complete)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            elif complete:
                shutil.rmtree(parts, ignore_errors=True)
        self.summary.seconds = time.perf_counter() - self.t0
        if self.opts.reference and complete:
            self.summary.metrics = score(self.output, None, self.opts, self.info["num_return_sequences"])
        if self.opts.stats:
            write_stats(self.opts.stats, self.summary)
        return self.summary

    def _run_loop(self, sink: Sink, state: IndexEntry | None, parts: Path) -> bool:
        """:meth:`_loop`, guarded as one process's run is (:func:`~.job.guarded`); Ctrl-C is an interrupt."""
        with guarded(self.output, sink):
            try:
                return self._loop(sink, state, parts)
            except KeyboardInterrupt:
                self.summary.interrupted = True
                return False

    def _report(self, startup: float) -> dict[str, Any]:
        """``Summary.distributed``: the workers, shards, retries and start-up."""
        return dict(
            workers=self.pool.report(),
            shards=self.shards_merged,
            shard_size=self.size,
            retried_shards=self.retried,
            startup_seconds=startup,
            address=self.cluster.address or "local",
            max_source_length=self.info["max_source_length"],
        )

    # -- the loop: hand out, merge, wait, take results, poll -----------------------------------------
    def _loop(self, sink: Sink, state: IndexEntry | None, parts: Path) -> bool:
        """Hand out shards, collect and merge results; True when every input is written."""
        self._start_cutter(state)
        try:
            while True:
                self._hand_out()
                if not self._merge_in_order(sink, parts):
                    return False
                if self.ledger.finished:
                    return True
                for ref in self.pool.wait():
                    self._take(ref)
                self._poll()
        finally:
            self.ledger.cutter.stop()
            self.progress.close()

    def _start_cutter(self, state: IndexEntry | None) -> None:
        """Read the input (past what a resumed run merged) into the cutter and its ledger; the progress bar."""
        opts, cl = self.opts, self.cluster
        total = self.job.shard.size if self.job.shard is not None else count_lines(self.paths)
        records = read_records(
            self.paths,
            opts.input_format,
            opts.input_field,
            "skip",
            select=self.job.select,
            reserved=opts.fields(),
            chat=opts.chat,
        )
        digest = InputDigest()
        if state is not None:
            records = resume.skip_done(records, state, digest)
        self.size = cl.shard_size or auto_shard_size(total, cl.workers)
        ahead = LOOKAHEAD_PER_WORKER * cl.workers + 1
        self.ledger = ShardLedger(Cutter(records, self.start, self.size, digest, ahead), ahead)
        self.progress = Progress(opts.progress, self.paths, initial=self.start, total=total)

    def _hand_out(self) -> None:
        """A shard to every idle worker."""
        for w in self.pool.workers:
            if not w.ready or w.shard is not None:
                continue
            shard = self.ledger.next_shard()
            if shard is None:
                break
            w.start(shard)

    def _merge_in_order(self, sink: Sink, parts: Path) -> bool:
        """Append the results that are next in shard order to the output; False when one ended in a failing
        input (the run stops there, every output before it written)."""
        while (merged := self.ledger.take_next()) is not None:
            shard, r = merged
            for message in r.warnings:
                self.progress.warn(message)
            sink.write(r.data, inputs=r.done)
            self.summary.inputs += r.done
            self.summary.add_counts(r.summary)
            if r.error is not None:
                partial = shard.before.copy()
                for record in shard.records[: r.done]:
                    partial.update(record)
                sink.commit(partial.hexdigest())
                remove_part(parts / shard.name)
                self.summary.error = r.error
                return False
            sink.commit(shard.after)
            remove_part(parts / shard.name)
            self.shards_merged += 1
            self.events("merged", {"seq": shard.seq, "name": shard.name})
        return True

    def _take(self, ref: Any) -> None:
        w = self.pool.owner(ref)
        if ref is w.hello_ref:
            self._on_hello(w)
        else:
            self._on_result(w, ref)

    def _on_hello(self, w: _Worker) -> None:
        """A restarted worker is back: it must resolve the settings the first one did."""
        info = self.pool.hello(w)
        if info is not None and info["settings"] != self.worker_settings:
            raise SeqgenError(
                f"the worker on node {info['node']} resolves other settings than the first "
                "(same model folder and software on every node?)"
            )

    def _on_result(self, w: _Worker, ref: Any) -> None:
        """A worker finished its shard (or died on it): the ledger keeps the result for merging in order."""
        shard = w.shard
        assert shard is not None
        try:
            r = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as err:
            self._on_death(w, shard, err)
            return
        w.finish(r)
        if r.fatal is not None:
            raise SeqgenError(r.fatal)
        self.ledger.done(shard, r)

    def _on_death(self, w: _Worker, shard: Shard, err: Exception) -> None:
        """A worker died running ``shard``: the shard goes back in the queue, up to ``max_attempts``."""
        self.pool.lost(w)
        if shard.attempts >= self.cluster.max_attempts:
            raise SeqgenError(
                f"{shard.span}: the worker running them died {shard.attempts} times ({type(err).__name__})"
            ) from None
        self.retried += 1
        self.ledger.put_back(shard)

    def _poll(self) -> None:
        """Ask busy workers how far they are; show the sum on the one progress bar."""
        busy = self.pool.poll(self.events)
        done = self.start + self.summary.inputs + self.ledger.waiting_inputs + busy
        self.progress.set(done, self.summary.generated_tokens / max(time.perf_counter() - self.t0, 1e-9))
