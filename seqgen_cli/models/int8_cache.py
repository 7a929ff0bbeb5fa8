"""On-disk cache of ``--dtype int8``'s quantized weights: a second run of a checkpoint loads them instead of
quantizing its float32 linear layers again.

Use: ``with int8_cache.session(model_or_folder): ...`` around the code that builds the int8 linear maps (the
:class:`~seqgen_cli.generator.Generator` around its ``_quantize``). Inside it, every weight
:func:`seqgen_cli.models.linear_maps.int8_linear` quantizes goes through :func:`quantized`: taken from the cache
when there, else quantized and, when the block ends without an error, written to it. Outside a session (or for a
model without a checkpoint folder) nothing is read or written.

**What is stored.** Per weight the int8 values, the per-channel scales and zero points (``int_repr``,
``q_per_channel_scales``, ``q_per_channel_zero_points``), never fbgemm's packed matrix: that is an in-memory
layout whose blocking depends on the CPU's instruction set, which torch itself serialises by unpacking it. A cached
run packs again (``linear_prepack``), which is most of what is left of the start-up cost (docs/BENCHMARKS.md,
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

**Where**: ``$SEQGEN_CACHE``, else ``$XDG_CACHE_HOME/seqgen``, else ``~/.cache/seqgen``; files in its ``int8/``
folder. Writers save into a temporary file in that folder, ``fsync`` it and ``os.replace`` it onto the name:
concurrent runs each write a whole file and the last one stays; readers see the old file or the new one. Nothing
is evicted: delete the folder to reclaim the space (about the size of the int8 weights, a quarter of the float32
checkpoint's linear layers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
META = "seqgen_int8"  # the safetensors header metadata field that holds the JSON
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
PARTS = ("values", "scales", "zero_points")  # the tensors of an entry: "<entry name>.<part>"
SAMPLE_STRIDE = 61  # every 61st value of a weight goes into its BLAKE2b (the CRC-32 covers all of them)

log = logging.getLogger(__name__)
_ACTIVE: ContextVar[Session | None] = ContextVar("seqgen_int8_cache", default=None)
_noted = False


def _note(message: str) -> None:
    """One debug line per process: the cache never speaks louder, and never twice."""
    global _noted
    if not _noted:
        _noted = True
        log.debug("int8 cache: %s", message)


def cache_dir() -> Path:
    """``$SEQGEN_CACHE``, else ``$XDG_CACHE_HOME/seqgen``, else ``~/.cache/seqgen`` (empty variables count as
    unset, as the XDG specification says)."""
    if os.environ.get("SEQGEN_CACHE"):
        return Path(os.environ["SEQGEN_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "seqgen"
    return Path("~/.cache/seqgen").expanduser()


def checkpoint_folder(source: Any) -> Path | None:
    """The folder of a checkpoint: ``source`` itself (a folder), a model's ``name_or_path``, or a hub name's
    snapshot in the local hub cache; ``None`` when there is none (a model built in memory)."""
    name = getattr(source, "name_or_path", source)
    if not isinstance(name, (str, os.PathLike)) or not str(name):
        return None
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(str(name), "config.json")
    except Exception:  # noqa: BLE001 - not a hub name (the hub's validation errors), no hub library
        return None
    return Path(config).parent if isinstance(config, str) else None


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


class Session:
    """The cache of one checkpoint while its int8 maps are built: the file is read on the first lookup, and
    written by :meth:`save` when something was quantized (or found broken) meanwhile."""

    def __init__(self, folder: Path, key: dict[str, Any]) -> None:
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        self.path = folder / f"{digest}.safetensors"
        self.hits = 0  # weights taken from the cache
        self.misses = 0  # weights quantized
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

    def _cached(self, name: str, shape: torch.Size) -> torch.Tensor | None:
        """The cached quantized weight ``name``, checked; ``None`` if absent or broken."""
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
            and _payload_crc(parts) == crc
        ):  # type: ignore[arg-type]
            self._entries[name] = (*parts, crc)  # type: ignore[assignment]
            return _qweight(*parts)  # type: ignore[arg-type]
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
        name = entry_name(w.contiguous())
        if name in self._entries:  # a weight seen before in this session (e.g. tied or repeated)
            self.hits += 1
            return _qweight(*self._entries[name][:3])
        qweight = self._cached(name, w.shape)
        if qweight is not None:
            self.hits += 1
            return qweight
        qweight = quantize(weight)
        self.misses += 1
        parts = _parts(qweight)
        if parts is not None:
            self._entries[name] = (*parts, _payload_crc(parts))
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
        try:
            from safetensors.torch import save_file

            self.path.parent.mkdir(parents=True, exist_ok=True)
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
    current = Session(cache_dir() / "int8", cache_key(checkpoint))
    token = _ACTIVE.set(current)
    try:
        yield current
    finally:
        _ACTIVE.reset(token)
    current.save()


def quantized(weight: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``quantize(weight)``: through the active :func:`session`'s cache, if one is open."""
    current = _ACTIVE.get()
    return quantize(weight) if current is None else current.quantized(weight, quantize)
