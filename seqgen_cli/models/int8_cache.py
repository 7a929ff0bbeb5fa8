"""On-disk cache of ``--dtype int8``'s quantized weights: a second run of a checkpoint loads them instead of
quantizing its float32 linear layers again.

Use: ``with int8_cache.session(model_or_folder): ...`` around the code that builds the int8 linear maps
(:func:`seqgen_cli.models.to_int8`). Inside it, every weight
:func:`seqgen_cli.models.linear_maps.int8_linear` quantizes goes through :func:`quantized`: taken from the cache
when there, else quantized and, when the block ends without an error, written to it. Outside a session (or for a
model without a checkpoint folder) nothing is read or written.

**What is stored.** Per weight the int8 values, the per-channel scales and zero points (``int_repr``,
``q_per_channel_scales``, ``q_per_channel_zero_points``), never fbgemm's packed matrix: that is an in-memory
layout whose blocking depends on the CPU's instruction set, which torch itself serialises by unpacking it. A cached
run packs again (``linear_prepack``), which is most of what is left of the start-up cost (docs/EXPERIMENTS.md,
"int8 weight cache"). Biases stay float32 and come from the model as before. One safetensors file per key; its
header metadata carries the JSON (``seqgen_int8``: format, key, and a CRC-32 of each entry's bytes), so the key and
the tensors change together in one ``os.replace``. No pickle.

**Key** (the file's name is a hash of it): the checkpoint folder's weight files (name, size and ``st_mtime_ns``
of every ``*.safetensors``, ``*.bin``, ... and their index files) plus the bytes of ``config.json``; the weight
scheme (observer, dtype, qscheme, range, from :func:`int8_scheme`); torch's
version; the CPU capability torch dispatches to (AVX2, AVX512, ...: quantized values are computed by vectorised
kernels, and a cache folder may be shared between machines) and the quantized engine. File metadata, not a
hash of the weight files' bytes: that would read the whole checkpoint again (GBs for large models) on every start,
when the weights are already in memory. The content is checked where it is cheap, in memory (next point), so a
``touch`` or a copy only costs one rebuild, and an edit that keeps names, sizes and times gets no stale weight
(short of a CRC-32 collision between values that also agree at every 61st place).

**Entries** are named by the float32 weight they quantize: its shape, the CRC-32 of all its bytes and a BLAKE2b
of every 61st value (0.07 s for a Marian-sized model's 70M weights). A lookup can only return the quantization of
those very values, whatever order the layers are built in (fused or not, ``--backend fast`` or ``hf``: one file
holds both). Before use an entry's tensors are checked (dtypes, shapes and the CRC-32 of their bytes); a
missing, truncated, garbage or stale file or entry is quantized again and the file rewritten. Nothing here may
stop a run: an unreadable or unwritable cache folder runs without the cache (one debug-level log line).

**Checked against the float32 weight** (``_agrees``): a file can be whole and self-consistent and still hold
other values (written by a buggy or another quantizer, edited). So before a cached weight is used a fixed sample of
it is dequantized and compared with the float32 weight it replaces: 16 consecutive values of every row, the
column block moving along the row from one row to the next (``_sample``: every row's scale and zero point, the
16-column blocks in turn, one 64-byte run of each float32 row), within half a quantization step; and every row must
reach the end of the int8 range (the quantizer maps a row's largest magnitude there), which values consistent
with a coarser scale do not. A weight that fails is quantized again from the float32 weight and the file
rewritten, with one warning line on stderr per session. Cost: 34 ms of bart-base's warm 0.6 s of quantizing
(79 weights, 138M values; docs/EXPERIMENTS.md, "int8 weight cache").

**Where**: ``$SEQGEN_CACHE``, else ``$XDG_CACHE_HOME/seqgen``, else ``~/.cache/seqgen``; files in its ``int8/``
folder. Writers save into a temporary file in that folder, ``fsync`` it and ``os.replace`` it onto the name:
concurrent runs each write a whole file and the last one stays; readers see the old file or the new one. Nothing
is evicted: delete the folder to reclaim the space (about the size of the int8 weights, a quarter of the float32
checkpoint's linear layers).

**Temporary files of killed writers** (:func:`remove_stale`): a writer holds a shared ``flock`` on the folder's
``.lock`` from before it creates its temporary files (its own ``.<name>.*.tmp`` and safetensors' ``.tmpXXXXXX``,
which ``save_file`` writes and renames onto it) until they are gone. A session that finds temporary files takes
the lock exclusively without waiting: it gets it only when no writer is alive, and then removes them all; else it
leaves them to a later run. The kernel drops a process's locks when it dies, SIGKILL included, so a killed
writer's files go with the next quiet start, and a live writer's never, whichever process it is. Process ids in
the names would not tell that: another container sharing the folder has its own ids, and a dead writer's id can
be taken by a new process. Where locks are not supported, nothing is removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from seqgen_cli.digests import cache_dir, checkpoint_folder
from seqgen_cli.models.resident import release

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so no temporary file is ever removed
    fcntl = None  # type: ignore[assignment]

FORMAT = 1
META = "seqgen_int8"  # the safetensors header metadata field that holds the JSON
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
PARTS = ("values", "scales", "zero_points")  # the tensors of an entry: "<entry name>.<part>"
SAMPLE_STRIDE = 61  # every 61st value of a weight goes into its BLAKE2b (the CRC-32 covers all of them)
CHECK_RUN = 16  # consecutive values of each row the check dequantizes: one 64-byte run of float32
# Tolerance: the quantizer rounds w * (1 / scale) to the nearest step, computed in float32 (scale, its inverse and
# the product each rounded, relative 2^-24, on at most 128 steps), so a value may land up to 3 * 2^-17 < 2^-15 of
# a step past the half-step tie; the check's own float32 arithmetic ((q - zero point) * scale - w, on at most
# 128.5 steps) adds < 2^-16. So |w - dequantized| <= (1/2 + STEP_SLACK) steps, 2^-12 covering both 5 times over.
STEP_SLACK = 2.0**-12
SCALE_FLOOR = float(torch.finfo(torch.float32).eps)  # the observer's smallest scale (a row of zeros has it)
LOCK = ".lock"  # the folder's lock file: shared by writers, exclusive for removing temporary files
TEMP = re.compile(r"\.[0-9a-f]{32}\..+\.tmp|\.tmp[A-Za-z0-9]{6}")  # ours (mkstemp), safetensors' own
LOCK_WAIT = 2.0  # seconds a writer waits for a session that removes temporary files (a few unlinks)

log = logging.getLogger(__name__)
_ACTIVE: ContextVar[Session | None] = ContextVar("seqgen_int8_cache", default=None)
_noted = False


def _note(message: str) -> None:
    """One debug line per process: the cache never speaks louder, and never twice."""
    global _noted
    if not _noted:
        _noted = True
        log.debug("int8 cache: %s", message)


def checkpoint_key(folder: Path) -> dict[str, Any] | None:
    """Names, sizes and modification times of ``folder``'s weight files and the SHA-256 of its ``config.json``;
    ``None`` without weight files."""
    files = []
    try:
        for path in sorted(folder.iterdir()):
            name = path.name
            if name.endswith(WEIGHT_SUFFIXES) or ".safetensors." in name or ".bin." in name:  # or an index
                st = path.stat()  # of the file a link (hub snapshots) points to
                files.append([name, st.st_size, st.st_mtime_ns])
        config = folder / "config.json"
        config_hash = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    except OSError:
        return None
    return {"files": files, "config": config_hash} if files else None


def int8_scheme() -> str:
    """The weight quantization ``linear_maps.quantize_weight`` applies (torch's per-channel dynamic qconfig), in
    words (part of the key)."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs = per_channel_dynamic_qconfig.weight()
    return (
        f"{type(obs).__name__} {obs.dtype} {obs.qscheme} axis {obs.ch_axis} range {obs.quant_min}..{obs.quant_max}"
        f" reduce_range {obs.reduce_range} eps {float(obs.eps)}"
    )


def cache_key(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The whole key: the checkpoint's, the weight scheme, torch's version, the CPU capability and engine."""
    return {
        "format": FORMAT,
        "checkpoint": checkpoint,
        "scheme": int8_scheme(),
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "engine": torch.backends.quantized.engine,
    }


def entry_name(weight: torch.Tensor) -> str:
    """``OxI.<crc32><blake2b of a sample>`` of a contiguous float32 CPU weight."""
    values = weight.numpy()
    crc = zlib.crc32(values)
    sample = hashlib.blake2b(values.reshape(-1)[::SAMPLE_STRIDE].tobytes(), digest_size=8).hexdigest()
    return f"{'x'.join(map(str, weight.shape))}.{crc:08x}{sample}"


def _qweight(values: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor) -> torch.Tensor:
    """The per-channel qint8 tensor (axis 0) of cached parts."""
    with warnings.catch_warnings():  # torch deprecates quantized tensors (linear_maps says why they stay)
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
        return torch._make_per_channel_quantized_tensor(values, scales, zero_points, 0)


def _payload_crc(parts: tuple[torch.Tensor, ...]) -> int:
    crc = 0
    for t in parts:
        crc = zlib.crc32(t.contiguous().view(torch.uint8).numpy(), crc)
    return crc


def _parts(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(int8 values, scales, zero points) of a per-channel qint8 weight over axis 0; ``None`` for another kind."""
    if qweight.dtype != torch.qint8 or qweight.qscheme() not in (
        torch.per_channel_affine,
        torch.per_channel_symmetric,
    ):
        return None
    if qweight.q_per_channel_axis() != 0:
        return None
    return qweight.int_repr(), qweight.q_per_channel_scales(), qweight.q_per_channel_zero_points()


def _sample(a: np.ndarray) -> np.ndarray:
    """[R, k] of a C-contiguous [R, C] ``a``: ``k = min(CHECK_RUN, C)`` consecutive values of every row, row
    ``r`` at column ``k * (r mod (C // k))`` (rows in groups of ``C // k``, each of a group on the next column
    block; the rows after the last whole group at column 0). A strided view, one small copy."""
    rows, cols = a.shape
    k = min(CHECK_RUN, cols)
    per_group = cols // k
    groups = rows // per_group
    item = a.itemsize
    head = as_strided(
        a, (groups, per_group, k), (per_group * cols * item, (cols + k) * item, item), writeable=False
    )
    return np.concatenate((head.reshape(groups * per_group, k), a[groups * per_group :, :k]))


def _agrees(
    weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor
) -> bool:
    """Whether cached per-channel int8 parts are the quantization of the contiguous float32 ``weight`` [O, I],
    as far as a fixed sample shows: its dequantized values are within half a step (``STEP_SLACK``) of the float32
    ones, and every row reaches the end of the int8 range unless its scale is the floor (a coarser scale fails).
    numpy, in float32 and in place: one thread, which a busy core beside it does not stall as it stalls torch's
    parallel ops (16x), and no large temporaries (float64 ones took 11x as long). Non-finite values fail, quietly."""
    if weight.numel() == 0:
        return True
    q, step = np.ascontiguousarray(values.numpy()), scales.numpy()
    with np.errstate(all="ignore"):
        error = _sample(q).astype(np.float32)
        error -= zero_points.numpy().astype(np.float32)[:, None]
        error *= step.astype(np.float32)[:, None]
        error -= _sample(np.ascontiguousarray(weight.numpy()))
        if not (np.abs(error, out=error) <= (step * (0.5 + STEP_SLACK)).astype(np.float32)[:, None]).all():
            return False
    return bool(((q.max(1) >= 127) | (q.min(1) <= -127) | (step <= SCALE_FLOOR)).all())


def _lock(folder: Path, exclusive: bool, wait: float) -> int | None:
    """An open descriptor of ``folder``'s lock file holding a shared or exclusive ``flock``, taken within
    ``wait`` seconds; ``None`` when not (held by others, no locks here, no folder). Close it to release."""
    if fcntl is None:
        return None
    try:
        # read-write: NFS emulates flock with fcntl locks, which need it for LOCK_EX (and which do not keep
        # threads of one process apart: there a thread could remove another's file, which costs that write)
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
        except OSError:
            pass
        os.close(fd)
        return None


def remove_stale(folder: Path) -> int:
    """Remove the temporary files of ``folder`` left by writers that died (module docstring, "Temporary
    files"): only when no live writer holds the folder's lock. Returns how many were removed; never raises."""
    try:
        if not any(TEMP.fullmatch(name) for name in os.listdir(folder)):
            return 0
    except OSError:
        return 0
    fd = _lock(folder, exclusive=True, wait=0.0)
    if fd is None:
        return 0  # a writer is alive (or no locks here): a later run removes them
    removed = 0
    try:
        for name in os.listdir(folder):
            if TEMP.fullmatch(name):
                try:
                    os.unlink(folder / name)
                    removed += 1
                except OSError:
                    pass
    except OSError:
        pass
    finally:
        os.close(fd)
    if removed:
        log.debug("int8 cache: removed %d temporary files of killed writers from %s", removed, folder)
    return removed


class Session:
    """The cache of one checkpoint while its int8 maps are built: the file is read on the first lookup, and
    written by :meth:`save` when something was quantized (or found broken) meanwhile."""

    def __init__(self, folder: Path, key: dict[str, Any]) -> None:
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        self.path = folder / f"{digest}.safetensors"
        self.hits = 0  # weights taken from the cache
        self.misses = 0  # weights quantized
        self.mismatched = 0  # cached weights that were not the quantization of their float32 weight
        self.dirty = False  # the file needs writing
        self._file: dict[str, int] | None = None  # entry name -> payload CRC, as the file says
        self._tensors: dict[str, torch.Tensor] = {}
        self._entries: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}  # for the file

    def _read(self) -> dict[str, int]:
        if self._file is not None:
            return self._file
        self._file = {}
        if not self.path.is_file():
            return self._file
        try:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                info = json.loads((f.metadata() or {})[META])
                if info.get("format") != FORMAT or info.get("key") != self.key:
                    raise ValueError("another key")  # a hash collision of the file name, or a future format
                entries = {str(k): int(v) for k, v in dict(info["entries"]).items()}
                self._tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
            self._file = entries
        except Exception as err:  # noqa: BLE001 - truncated or garbage: safetensors, json, key errors alike
            _note(f"{self.path}: unreadable ({type(err).__name__}: {err}); rebuilding it")
            self._tensors = {}
            self.dirty = True
        return self._file

    def _cached(
        self, name: str, shape: torch.Size
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """The file's entry ``name`` (values, scales, zero points, CRC), its dtypes, shapes and CRC checked;
        ``None`` if absent or damaged."""
        crc = self._read().get(name)
        if crc is None:
            return None
        parts = tuple(self._tensors.get(f"{name}.{p}") for p in PARTS)
        rows = shape[0]
        expected = ((torch.int8, tuple(shape)), (torch.float64, (rows,)), (torch.int64, (rows,)))
        if (
            all(
                t is not None and t.dtype == dtype and tuple(t.shape) == size
                for t, (dtype, size) in zip(parts, expected, strict=True)
            )
            and _payload_crc(parts) == crc  # type: ignore[arg-type]
        ):
            return (*parts, crc)  # type: ignore[return-value]
        _note(f"{self.path}: entry {name} is damaged; quantizing it again")
        del self._file[name]  # type: ignore[union-attr]
        self.dirty = True
        return None

    def quantized(
        self, weight: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``quantize(weight)``, from the cache when there."""
        w = weight.detach()
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
            return quantize(weight)
        w = w.contiguous()
        name = entry_name(w)
        if name in self._entries:  # a weight seen before in this session (e.g. tied or repeated)
            self.hits += 1
            return _qweight(*self._entries[name][:3])
        cached = self._cached(name, w.shape)
        if cached is not None and _agrees(w, *cached[:3]):
            self.hits += 1
            self._entries[name] = cached
            qweight = _qweight(*cached[:3])  # a copy: the file's pages go back (resident.py)
            release(cached[:3])
            return qweight
        qweight = quantize(weight)
        self.misses += 1
        parts = _parts(qweight)
        if parts is None:
            return qweight
        crc = _payload_crc(parts)
        if cached is not None and cached[3] == crc:  # the same bits (non-finite weights fail any comparison)
            self._entries[name] = cached
            return qweight
        if cached is not None:
            self.mismatched += 1
            _note(
                f"{self.path}: entry {name} is not the quantization of its float32 weight; quantizing it again"
            )
        self._entries[name] = (*parts, crc)
        self.dirty = True
        return qweight

    def save(self) -> None:
        """Write the file (entries used now, and the file's others) if needed: temporary file, fsync, replace.
        Never raises: an unwritable folder leaves the cache as it is."""
        if not self.dirty or not self._entries:
            return
        entries = dict(self._entries)
        for name, crc in (self._file or {}).items():  # entries of the other backend (fast / hf), unchecked
            parts = tuple(self._tensors.get(f"{name}.{p}") for p in PARTS)
            if name not in entries and all(t is not None for t in parts):
                entries[name] = (*parts, crc)  # type: ignore[assignment]
        tensors = {}
        for name, entry in entries.items():
            tensors.update({f"{name}.{p}": t.contiguous() for p, t in zip(PARTS, entry[:3], strict=True)})
        info = {"format": FORMAT, "key": self.key, "entries": {n: e[3] for n, e in entries.items()}}
        tmp: str | None = None
        lock: int | None = None
        try:
            from safetensors.torch import save_file

            self.path.parent.mkdir(parents=True, exist_ok=True)
            # held until the temporary files are gone, so that no other session removes them (remove_stale);
            # without it (no locks here, or a remover that does not let go) the write goes on unprotected
            lock = _lock(self.path.parent, exclusive=False, wait=LOCK_WAIT)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.stem}.", suffix=".tmp")
            os.close(fd)
            save_file(tensors, tmp, metadata={META: json.dumps(info, sort_keys=True)})
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
            self.dirty = False
        except Exception as err:  # noqa: BLE001 - permissions, full disk, safetensors: run on uncached
            _note(f"cannot write {self.path} ({type(err).__name__}: {err}); running without the cache")
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            if lock is not None:
                os.close(lock)

    def warn(self) -> None:
        """One line on stderr if cached weights were not the quantization of their float32 weights."""
        if self.mismatched:
            n = self.mismatched
            print(
                f"seqgen: warning: int8 cache {self.path}: {n} cached weight{'s' if n != 1 else ''} did not match "
                f"the checkpoint's float32 weight{'s' if n != 1 else ''}; quantized again"
                + ("" if self.dirty else ", file rewritten"),
                file=sys.stderr,
            )


@contextmanager
def session(source: Any) -> Iterator[Session | None]:
    """Cache the int8 weights quantized inside the block for the checkpoint of ``source`` (a folder, a hub name
    or a model loaded from one); the file is written when the block ends without an error. Yields the
    :class:`Session` (its ``hits`` and ``misses``), or ``None`` where nothing can be cached (a model without a
    checkpoint folder)."""
    folder = checkpoint_folder(source)
    checkpoint = checkpoint_key(folder) if folder is not None else None
    if checkpoint is None:
        yield None
        return
    folder = cache_dir() / "int8"
    remove_stale(folder)
    current = Session(folder, cache_key(checkpoint))
    token = _ACTIVE.set(current)
    try:
        yield current
        current.save()
    finally:
        _ACTIVE.reset(token)
        current.warn()


def quantized(weight: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``quantize(weight)``: through the active :func:`session`'s cache, if one is open."""
    current = _ACTIVE.get()
    return quantize(weight) if current is None else current.quantized(weight, quantize)
