"""Scale-out on Ray: one ``seqgen generate`` over many workers (GPUs, machines), written as one process.

The driver (this process) reads the input and cuts it into contiguous shards of ``shard_size`` inputs,
aligned on multiples of it. Ray actors (one model load each) take shards as they free up (a fast worker
takes more) and run the ordinary pipeline (:func:`~.job.write_records`) on each into a part file,
``OUTPUT.seqgen-parts/<start>-<count>-<digest>.part``, with its own index and journal. The driver
appends finished parts to the output in input order, recording each in the output's own index as a
one-process run does, and deletes them. A lost worker's shard goes to another worker (or the restarted
one), which resumes the part; a lost driver is rerun with ``--resume``: merged inputs are skipped and
parts are reused. Ray is imported only here, and this module only with ``--workers``.
"""

from __future__ import annotations

import fcntl
import heapq
import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from seqgen_cli.errors import SeqgenError, WriteError
from seqgen_cli.pipeline import resume
from seqgen_cli.pipeline.job import (
    JobOptions,
    aborted,
    check_job,
    score,
    shard_settings,
    sigterm_as_interrupt,
    write_records,
    write_stats,
)
from seqgen_cli.pipeline.progress import CountingProgress, Progress, count_lines
from seqgen_cli.pipeline.records import Record, read_records
from seqgen_cli.pipeline.run import MAX_WARNINGS
from seqgen_cli.pipeline.sinks import FileSink, Sink, is_stream, open_stream
from seqgen_cli.pipeline.stats import Summary, peak_rss_mb

DEFAULT_SHARD_SIZE = 4096
MIN_SHARD_SIZE = 16
LOOKAHEAD_PER_WORKER = 2  # shards cut beyond the oldest unmerged one, per worker (bounds driver memory)
PARTS_SUFFIX = ".seqgen-parts"
STARTUP_NOTICE_SECONDS = 60.0
DRIVER_MARK = ".seqgen-driver"  # in the parts folder: the driver's node id (workers that see it share it)
INSTALL_HINT = "pip install 'seqgen-cli[ray]'"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray advertises 127.0.0.1 (single-machine mode)

Events = Callable[[str, dict[str, Any]], None]


@dataclass
class ClusterOptions:
    """``--workers`` and friends."""

    workers: int
    address: str | None = None  # an existing cluster (``auto``, ``HOST:PORT``); None: start a local one
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    shard_size: int | None = None  # None: a few thousand, fewer for small inputs
    max_attempts: int = 3  # tries of one shard (on any worker) before the run fails
    max_restarts: int = 3  # restarts of one worker's process after it dies


def import_ray(local: bool = False) -> Any:
    """Ray, or a one-line error saying how to install it.

    ``local``: for a cluster on this machine only, Ray's addresses are loopback ones (Ray picks the
    machine's outward address otherwise: an environment setting read when Ray is first imported).
    """
    if local and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
    except ImportError:
        raise SeqgenError(f"--workers needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def parts_dir(output: str) -> Path:
    return Path(f"{output}{PARTS_SUFFIX}")


def auto_shard_size(total: int | None, workers: int) -> int:
    """A few thousand inputs; for a small input, fewer, so that each worker gets about four shards."""
    if total is None:
        return DEFAULT_SHARD_SIZE
    return max(MIN_SHARD_SIZE, min(DEFAULT_SHARD_SIZE, -(-total // (4 * workers))))


# -- the worker (a Ray actor) ------------------------------------------------------------------------


@dataclass
class ShardTask:
    """What the driver ships to a worker: one shard's inputs, indexed from 0 within the shard."""

    name: str  # the part file's name, in the parts folder
    records: list[Record]


@dataclass
class ShardResult:
    name: str
    data: bytes = b""  # the part's outputs: all of them, or those before the failing input
    done: int = 0  # inputs whose outputs are in ``data``
    error: str | None = None  # a bad input (--on-error fail); ``data`` stops before it
    fatal: str | None = None  # the shard cannot run (e.g. its part holds another run's settings)
    warnings: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # the worker's Summary for this shard
    pid: int = 0


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class ShardWorker:
    """Loads the model once, then runs shards through the ordinary pipeline (wrapped by ``ray.remote``)."""

    def __init__(
        self, generator: dict[str, Any], opts: JobOptions, parts: str, driver_node: str, threads: int | None
    ) -> None:
        self.pid = os.getpid()
        self.parts = Path(parts)
        self.opts = replace(opts, resume=True, progress=False, stats=None, reference=None, metrics=None)
        self.node = _node_id()
        self.driver_node = driver_node
        self._progress = CountingProgress()
        self.gen = None
        self.error: str | None = None
        try:
            import torch

            if threads:
                torch.set_num_threads(threads)
            from seqgen_cli.generator import Generator

            self.gen = Generator(**generator)
        except SeqgenError as err:
            self.error = str(err)
        except Exception as err:  # noqa: BLE001 - e.g. a torn checkpoint: told to the driver, not retried
            self.error = f"{type(err).__name__}: {err}"

    def hello(self) -> dict[str, Any]:
        """Who this worker is and the settings it resolved (or why it could not load the model)."""
        info: dict[str, Any] = {"pid": self.pid, "node": self.node, "error": self.error}
        if self.gen is not None:
            info.update(
                settings=resume.fingerprint(self.gen, self.opts),
                backend=self.gen.backend,
                max_source_length=self.gen.max_source_length,
                num_return_sequences=self.gen.num_return_sequences,
            )
        return info

    def progress(self) -> int:
        """Inputs done in the current shard (called concurrently with :meth:`run_shard`)."""
        return self._progress.done

    def run_shard(self, task: ShardTask) -> ShardResult:
        self.parts.mkdir(parents=True, exist_ok=True)
        part = self.parts / task.name
        self._progress = progress = CountingProgress()
        result = ShardResult(task.name, pid=self.pid)
        lock = open(f"{part}.lock", "w")  # noqa: SIM115 - held until the part is written
        try:
            # An attempt the driver gave up on may still run (a node cut off, not dead): wait for it.
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if part.exists() and part.stat().st_size and not resume.index_path(part).exists():
                result.data, result.done = part.read_bytes(), len(task.records)  # done before a driver loss
            else:
                records = _raise_bad(task.records, self.opts.on_error)
                summary = write_records(self.gen, records, str(part), self.opts, progress=progress)  # type: ignore[arg-type]
                if summary.interrupted:
                    raise SeqgenError(f"{task.name}: interrupted")
                state = resume.ResumeState(len(task.records), part.stat().st_size, "")
                if summary.error is not None:
                    result.error = summary.error
                    state = resume._read_index(resume.index_path(part))[1]
                with open(part, "rb") as fh:
                    result.data = fh.read(state.offset)
                result.done = state.done
                result.summary = summary.as_dict()
                result.warnings = progress.messages
        except SeqgenError as err:
            result.fatal = str(err)
        finally:
            lock.close()
        if result.fatal is None and not self._shares_parts():  # the driver cannot delete it: it has the bytes
            _remove_part(part)
        return result

    def _shares_parts(self) -> bool:
        """Whether the driver sees this parts folder (same machine, or a shared filesystem)."""
        try:
            return (self.parts / DRIVER_MARK).read_text(encoding="utf-8") == self.driver_node
        except OSError:
            return False


def _raise_bad(records: list[Record], on_error: str) -> Iterator[Record]:
    """The records; a bad line (read as an error record) raises here, in order, unless skipped."""
    for record in records:
        if record.error is not None and on_error != "skip":
            raise SeqgenError(record.error)
        yield record


def _remove_part(part: Path) -> None:
    for path in (part, resume.index_path(part), resume.journal_path(part), Path(f"{part}.lock")):
        path.unlink(missing_ok=True)


# -- the driver ----------------------------------------------------------------------------------------


@dataclass
class _Shard:
    seq: int  # position in the run's shard sequence
    start: int  # index of its first input among all inputs
    records: list[Record]
    name: str
    before: resume.InputDigest  # digest of every input before this shard
    after: str  # ... and through its last input
    attempts: int = 0

    def __lt__(self, other: _Shard) -> bool:
        return self.seq < other.seq

    @property
    def span(self) -> str:
        return f"inputs {self.start + 1}-{self.start + len(self.records)}"


class _Cutter:
    """A thread that reads records and cuts them into shards (bounded queue: the driver's read-ahead)."""

    def __init__(
        self, records: Iterator[Record], start: int, size: int, digest: resume.InputDigest, ahead: int
    ):
        self._records, self._start, self._size, self._digest = records, start, size, digest
        self.queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self.finished = False  # every shard has been taken from the queue
        threading.Thread(target=self._loop, name="seqgen-shards", daemon=True).start()

    def _put(self, obj: object) -> bool:
        while not self._stop.is_set():
            try:
                self.queue.put(obj, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _loop(self) -> None:
        try:
            seq, start, group = 0, self._start, []
            end = (start // self._size + 1) * self._size  # shards aligned on multiples of the size
            for record in self._records:
                group.append(replace(record, index=record.index - start))
                if start + len(group) == end:
                    if not self._put(self._cut(seq, start, group)):
                        return
                    seq, start, group, end = seq + 1, end, [], end + self._size
            if group and not self._put(self._cut(seq, start, group)):
                return
            self._put(None)
        except BaseException as err:  # noqa: BLE001 - raised in the driver
            self._put(err)

    def _cut(self, seq: int, start: int, records: list[Record]) -> _Shard:
        own = resume.InputDigest()
        before = self._digest.copy()
        for record in records:
            data = own.encode(record)
            own.update_encoded(data)
            self._digest.update_encoded(data)
        name = f"{start:012d}-{len(records)}-{own.hexdigest()[:16]}.part"
        return _Shard(seq, start, records, name, before, self._digest.hexdigest())

    def take(self) -> _Shard | None:
        """The next shard if one is ready (None: not yet, or no more: see ``finished``)."""
        if self.finished:
            return None
        try:
            got = self.queue.get_nowait()
        except queue.Empty:
            return None
        if got is None:
            self.finished = True
            return None
        if isinstance(got, BaseException):
            self.finished = True
            raise got
        return got

    def stop(self) -> None:
        self._stop.set()


class _Worker:
    """The driver's view of one actor."""

    def __init__(self, index: int, handle: Any) -> None:
        self.index, self.handle = index, handle
        self.hello_ref: Any = handle.hello.remote()
        self.task_ref: Any = None
        self.poll_ref: Any = None
        self.shard: _Shard | None = None
        self.ready = False
        self.progress = 0  # inputs done in the current shard, as last polled
        self.started = 0.0
        self.deaths = 0
        self.hello_failures = 0  # in a row
        self.pids: list[int] = []
        self.node = ""
        self.stats: dict[str, Any] = dict(shards=0, inputs=0, generated_tokens=0, busy_seconds=0.0)

    @property
    def pid(self) -> int:
        return self.pids[-1] if self.pids else 0

    def report(self) -> dict[str, Any]:
        busy = self.stats["busy_seconds"]
        return dict(
            worker=self.index, node=self.node, pids=self.pids, restarts=self.deaths, **self.stats,
            samples_per_second=self.stats["inputs"] / busy if busy else 0.0,
            generated_tokens_per_second=self.stats["generated_tokens"] / busy if busy else 0.0,
        )  # fmt: skip


def generate_distributed(
    generator: dict[str, Any],
    inputs: Sequence[str],
    output: str,
    opts: JobOptions,
    cluster: ClusterOptions,
    *,
    events: Events | None = None,
) -> Summary:
    """Run one ``seqgen generate`` job on ``cluster.workers`` Ray actors (``Generator(**generator)`` each).

    Joins the Ray cluster at ``cluster.address`` (or starts a local one, on loopback) unless this process
    is already connected. ``events(kind, info)`` is told of each worker's progress (``"progress"``: pid,
    shard, done) and merged shard (``"merged"``), for tests and monitoring.
    """
    check_job(inputs, output, opts)
    if opts.reference and is_stream(output):
        raise SeqgenError("--reference with --workers needs -o FILE")
    if not is_stream(output) and not opts.resume:
        resume.check_fresh(output)
    t0 = time.perf_counter()
    ray = import_ray(local=cluster.address is None)
    stdout = sys.stdout
    sys.stdout = sys.stderr  # Ray prints its notices (e.g. a worker died) to sys.stdout: not into the output
    try:
        connected = _connect(ray, cluster)
        try:
            driver = _Driver(ray, generator, list(inputs) or ["-"], output, opts, cluster, events, t0)
            return driver.run(stdout)
        finally:
            if connected:
                ray.shutdown()
    finally:
        sys.stdout = stdout


def _connect(ray: Any, cluster: ClusterOptions) -> bool:
    """Join (or start) the cluster unless already connected; True when this call connected."""
    if ray.is_initialized():
        return False
    quiet = dict(log_to_driver=False, logging_level=logging.ERROR)
    if cluster.address:
        ray.init(address=cluster.address, **quiet)
    else:  # a local cluster, on loopback, with room for every worker asked for
        need = int(cluster.workers * cluster.cpus_per_worker + 0.999)
        cpus = max(os.cpu_count() or 1, need)
        ray.init(num_cpus=cpus, include_dashboard=False, **quiet)
    return True


class _Driver:
    def __init__(
        self,
        ray: Any,
        generator: dict[str, Any],
        paths: list[str],
        output: str,
        opts: JobOptions,
        cluster: ClusterOptions,
        events: Events | None,
        t0: float,
    ) -> None:
        self.ray, self.generator, self.paths, self.output = ray, generator, paths, output
        self.opts, self.cluster, self.events, self.t0 = opts, cluster, events or (lambda k, i: None), t0
        self.summary = Summary(output=output if output != "-" else "<stdout>", rss_at_start_mb=peak_rss_mb())
        self.workers: list[_Worker] = []
        self.lost_workers: list[_Worker] = []  # dropped after too many restarts
        self.warned = self.shards_merged = self.retried = self.size = 0
        self.select: tuple[int, int] | None = None  # --shard I/N: this driver's inputs [lo, hi)

    # -- set-up ------------------------------------------------------------------------------------
    def _check_resources(self) -> None:
        total = self.ray.cluster_resources()
        cl = self.cluster
        for key, each in (("CPU", cl.cpus_per_worker), ("GPU", cl.gpus_per_worker)):
            have = total.get(key, 0.0)
            if each > have:
                raise SeqgenError(
                    f"the Ray cluster has {have:g} {key}s, fewer than --{key.lower()}s-per-worker {each:g}"
                )

    def _start_workers(self, parts: Path) -> None:
        cl = self.cluster
        actor = self.ray.remote(
            num_cpus=cl.cpus_per_worker, num_gpus=cl.gpus_per_worker, max_restarts=cl.max_restarts,
            max_concurrency=2,  # progress() answers while run_shard() works
        )(ShardWorker)  # fmt: skip
        threads = max(1, int(cl.cpus_per_worker)) if cl.gpus_per_worker == 0 else None
        node = _node_id()
        for i in range(cl.workers):
            handle = actor.remote(self.generator, self.opts, str(parts.resolve()), node, threads)
            self.workers.append(_Worker(i, handle))

    def _hello(self, w: _Worker) -> dict[str, Any] | None:
        """Take a worker's hello; None when its process died (it is restarted, or dropped)."""
        try:
            info = self.ray.get(w.hello_ref)
        except self.ray.exceptions.RayActorError:  # died loading the model, or was already dead when asked
            w.hello_failures += 1
            self._lost(w, died=False)
            return None
        w.hello_ref, w.hello_failures = None, 0
        if info["error"] is not None:
            raise SeqgenError(f"a worker could not load the model: {info['error']}")
        w.ready, w.node = True, info["node"]
        w.pids.append(info["pid"])
        return info

    def _lost(self, w: _Worker, died: bool = True) -> None:
        """A worker's process died: wait for Ray to restart it, or drop it after ``max_restarts``."""
        w.deaths += died
        w.ready, w.task_ref, w.poll_ref, w.shard, w.progress = False, None, None, None, 0
        if w.deaths > self.cluster.max_restarts or w.hello_failures > self.cluster.max_restarts + 1:
            self.workers.remove(w)
            self.lost_workers.append(w)
            if not self.workers:
                raise SeqgenError("every worker died (see the Ray logs under /tmp/ray for why)")
            return
        w.hello_ref = w.handle.hello.remote()  # answered once the restarted process has loaded the model

    def _first_hello(self) -> dict[str, Any]:
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
            info = self._hello(w)
            if info is not None:
                return info

    def _open_output(
        self, settings: dict[str, Any], parts: Path, stdout: TextIO
    ) -> tuple[Sink, resume.ResumeState | None]:
        if is_stream(self.output):
            return open_stream(self.output, stdout.buffer), None
        state = resume.load(self.output, settings) if self.opts.resume else None
        if state is None:
            shutil.rmtree(parts, ignore_errors=True)  # parts of a run that is not being resumed
            parts.mkdir()
            return FileSink(self.output, settings, part=self.select is not None), None
        parts.mkdir(exist_ok=True)
        for part in parts.iterdir():  # parts merged before the driver was lost
            head = part.name.split("-", 1)[0]
            if head.isdigit() and int(head) < state.done:
                part.unlink(missing_ok=True)
        part = self.select is not None
        return FileSink(self.output, settings, done=state.done, offset=state.offset, part=part), state

    # -- the run -----------------------------------------------------------------------------------
    def run(self, stdout: TextIO) -> Summary:
        self._check_resources()
        tmp = tempfile.mkdtemp(prefix="seqgen-parts-") if is_stream(self.output) else None
        parts = Path(tmp) if tmp else parts_dir(self.output)
        if tmp is None:
            parts.mkdir(exist_ok=True)
        self._start_workers(parts)
        sink: Sink | None = None
        complete = False
        try:
            first = self._first_hello()
            self.settings = self.worker_settings = first["settings"]
            if self.opts.shard is not None:  # one of N drivers (--shard I/N --workers M), as in one process
                self.select, extra = shard_settings(self.paths, self.opts.shard)
                self.settings = {**self.settings, **extra}
            self.summary.backend = first["backend"]
            self.info = first
            sink, state = self._open_output(self.settings, parts, stdout)
            (parts / DRIVER_MARK).write_text(_node_id(), encoding="utf-8")
            self.start = state.done if state else 0
            self.summary.resumed_from = self.start
            startup = time.perf_counter() - self.t0
            with sigterm_as_interrupt():
                try:
                    complete = self._loop(sink, state, parts)
                except KeyboardInterrupt:
                    self.summary.interrupted = True
                except BrokenPipeError:
                    raise
                except Exception as err:  # the output cannot be written (disk full), a bug: say where it is
                    if isinstance(err, SeqgenError) and not isinstance(err, WriteError):
                        raise
                    raise aborted(err, self.output, sink.kept()) from err
            self.summary.distributed = dict(
                workers=[w.report() for w in sorted(self.workers + self.lost_workers, key=lambda w: w.index)],
                shards=self.shards_merged, shard_size=self.size, retried_shards=self.retried,
                startup_seconds=startup, address=self.cluster.address or "local",
                max_source_length=first["max_source_length"],
            )  # fmt: skip
        finally:
            for w in self.workers + self.lost_workers:
                self.ray.kill(w.handle, no_restart=True)
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

    def _loop(self, sink: Sink, state: resume.ResumeState | None, parts: Path) -> bool:
        """Hand out shards, collect and merge results; True when every input is written."""
        ray, cl, opts = self.ray, self.cluster, self.opts
        select = self.select
        total = select[1] - select[0] if select is not None else count_lines(self.paths)
        records = read_records(self.paths, opts.input_format, opts.input_field, "skip", select=select)
        digest = resume.InputDigest()
        if state is not None:
            records = resume.skip_done(records, state, digest)
        self.size = size = cl.shard_size or auto_shard_size(total, cl.workers)
        ahead = LOOKAHEAD_PER_WORKER * cl.workers + 1
        cutter = _Cutter(records, self.start, size, digest, ahead)
        progress = Progress(opts.progress, self.paths, initial=self.start, total=total)
        retry: list[_Shard] = []  # a heap, by shard order
        cut: dict[int, _Shard] = {}  # cut and not merged yet
        results: dict[int, ShardResult] = {}
        next_merge = 0
        stop: int | None = None  # the shard with the first failing input
        merged_inputs = 0
        try:
            while True:
                # hand out: retries first, then new shards, never too far beyond the oldest unmerged one
                for w in self.workers:
                    if not w.ready or w.shard is not None:
                        continue
                    shard: _Shard | None = None
                    if retry and (stop is None or retry[0].seq < stop):
                        shard = heapq.heappop(retry)
                    elif stop is None and len(cut) < ahead:
                        shard = cutter.take()
                        if shard is not None:
                            cut[shard.seq] = shard
                    if shard is None:
                        break
                    shard.attempts += 1
                    w.shard, w.progress, w.started = shard, 0, time.perf_counter()
                    w.task_ref = w.handle.run_shard.remote(ShardTask(shard.name, shard.records))
                # merge what is next in order
                while next_merge in results:
                    r, shard = results.pop(next_merge), cut.pop(next_merge)
                    for message in r.warnings:
                        self._warn(progress, message)
                    sink.write(r.data, inputs=r.done)
                    merged_inputs += r.done
                    self._add(r)
                    if r.error is not None:
                        partial = shard.before.copy()
                        for record in shard.records[: r.done]:
                            partial.update(record)
                        sink.commit(partial.hexdigest(), force=True)
                        _remove_part(parts / shard.name)
                        self.summary.error = r.error
                        self.summary.inputs = merged_inputs
                        return False
                    sink.commit(shard.after, force=True)
                    _remove_part(parts / shard.name)
                    self.shards_merged += 1
                    self.events("merged", {"seq": next_merge, "name": shard.name})
                    next_merge += 1
                self.summary.inputs = merged_inputs
                busy = [w for w in self.workers if w.task_ref is not None]
                if cutter.finished and not cut:
                    return True
                # wait for a result (or a restarted worker), then poll the others' progress
                refs = [w.task_ref for w in busy] + [w.hello_ref for w in self.workers if w.hello_ref]
                if refs:
                    ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
                else:
                    time.sleep(0.05)  # waiting for the reader
                    ready = []
                for ref in ready:
                    w = next(w for w in self.workers if ref in (w.task_ref, w.hello_ref))
                    if ref is w.hello_ref:
                        info = self._hello(w)
                        if info is not None and info["settings"] != self.worker_settings:
                            raise SeqgenError(
                                f"the worker on node {info['node']} resolves other settings than the first "
                                "(same model folder and software on every node?)"
                            )
                        continue
                    shard = w.shard
                    assert shard is not None
                    try:
                        r = ray.get(ref)
                    except ray.exceptions.RayActorError as err:
                        self._lost(w)
                        if shard.attempts >= cl.max_attempts:
                            raise SeqgenError(
                                f"{shard.span}: the worker running them died {shard.attempts} times "
                                f"({type(err).__name__})"
                            ) from None
                        self.retried += 1
                        heapq.heappush(retry, shard)
                        continue
                    w.task_ref, w.shard = None, None
                    if r.fatal is not None:
                        raise SeqgenError(r.fatal)
                    w.stats["shards"] += 1
                    w.stats["inputs"] += r.summary.get("inputs", 0)
                    w.stats["generated_tokens"] += r.summary.get("generated_tokens", 0)
                    w.stats["busy_seconds"] += time.perf_counter() - w.started
                    if stop is not None and shard.seq > stop:
                        continue
                    if r.error is not None:
                        stop = shard.seq if stop is None else min(stop, shard.seq)
                    results[shard.seq] = r
                self._poll(progress, merged_inputs + sum(r.done for r in results.values()))
        finally:
            cutter.stop()
            progress.close()

    def _poll(self, progress: Progress, finished: int) -> None:
        """Ask busy workers how far they are; show the sum on the one progress bar."""
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
                    self.events("progress", {"pid": w.pid, "seq": w.shard.seq, "done": w.progress})
            if w.shard is not None and w.poll_ref is None:
                w.poll_ref = w.handle.progress.remote()
        done = self.start + finished + sum(w.progress for w in self.workers if w.shard is not None)
        progress.set(done, self.summary.generated_tokens / max(time.perf_counter() - self.t0, 1e-9))

    def _add(self, r: ShardResult) -> None:
        s, d = self.summary, r.summary  # d is empty for a part finished before a driver loss
        more = d.get("batches", 0)
        if more:
            s.padding_ratio = (s.padding_ratio * s.batches + d["padding_ratio"] * more) / (s.batches + more)
        s.batches += more
        for key in ("skipped", "truncated", "generated_tokens"):
            setattr(s, key, getattr(s, key) + d.get(key, 0))
        for key in ("read_seconds", "tokenise_seconds", "generate_seconds", "write_seconds"):
            setattr(s, key, getattr(s, key) + d.get(key, 0.0))

    def _warn(self, progress: Progress, message: str) -> None:
        self.warned += 1
        if self.warned <= MAX_WARNINGS:
            progress.write(message)
        elif self.warned == MAX_WARNINGS + 1:
            progress.write("seqgen: warning: further warnings not shown (see the counts at the end)")
