"""What a checkpoint folder *is*, by content: the SHA-256 of every file that decides the outputs (the weight files
transformers loads, the config, the generation config, the tokenizer files), for ``--resume``, the journal and
``seqgen merge`` (``pipeline/resume.py: model_identity``).

Hashing runs at ~1.8 GB/s on one core (1.63 GB in 0.90 s, docs/BENCHMARKS.md "Checkpoint digests"), so each
file's digest is cached on disk (``<cache>/digests/``; :func:`cache_dir`, shared with the int8 weight cache) under
its real path, keyed by what a rewrite changes: size, modification and status-change times, inode and device. A
file saved anew, copied or touched back to its old modification time gets a new status-change time, so it is
hashed again; an unchanged one costs a ``stat``. :func:`prefetch` starts the hashing in a thread while the model
loads (the same bytes, read from the page cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

# Files of a checkpoint folder that transformers does not read for a PyTorch model: other frameworks' weights
# and the model card. Everything else at the top level is hashed (tokenizer and config files are small).
NOT_READ = (".h5", ".msgpack", ".onnx", ".onnx_data", ".tflite", ".ot", ".gguf", ".mlmodel", ".md")
TORCH_WEIGHTS = (
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
)  # not read where .safetensors files are (transformers' choice)

_memo: dict[tuple[str, tuple[int, ...]], str] = {}  # (real path, stat key) -> SHA-256, this process's
_pending: dict[str, threading.Thread] = {}  # real folder -> its prefetch
_lock = threading.Lock()


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


def cache_folder() -> Path:
    return cache_dir() / "digests"


def model_files(folder: Path) -> list[Path]:
    """The files of ``folder`` (top level, sorted) whose bytes decide a run's outputs."""
    files = [p for p in sorted(folder.iterdir()) if not p.name.startswith(".") and p.is_file()]
    files = [p for p in files if not p.name.lower().endswith(NOT_READ)]
    if any(p.name.endswith(".safetensors") for p in files):
        files = [p for p in files if not p.name.endswith(TORCH_WEIGHTS)]
    return files


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _entry_path(real: str) -> Path:
    return cache_folder() / f"{hashlib.sha256(real.encode()).hexdigest()}.json"


def file_sha256(path: Path) -> str:
    """SHA-256 of ``path``'s bytes: from the cache when its stat key is unchanged, else hashed (and cached)."""
    real = os.path.realpath(path)
    key = _key(os.stat(real))
    with _lock:
        known = _memo.get((real, key))
    if known is not None:
        return known
    entry = _entry_path(real)
    try:
        cached = json.loads(entry.read_text())
        if cached.get("path") == real and tuple(cached.get("key", ())) == key:
            digest = str(cached["sha256"])
            with _lock:
                _memo[(real, key)] = digest
            return digest
    except (OSError, ValueError, AttributeError, KeyError):
        pass  # no entry, or not one of ours: hash
    with open(real, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if _key(os.stat(real)) == key:  # not changed while hashing: worth keeping
        with _lock:
            _memo[(real, key)] = digest
        _store(entry, {"path": real, "key": list(key), "sha256": digest})
    return digest


def _store(entry: Path, record: dict[str, Any]) -> None:
    """Write ``entry`` whole or not at all (a temporary file renamed over it); a cache that cannot be written
    (read-only, full) is skipped: the digest is right either way, only the next run hashes again."""
    tmp = entry.with_name(f"{entry.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record))
        os.replace(tmp, entry)
    except OSError:
        tmp.unlink(missing_ok=True)


def folder_digests(folder: str | os.PathLike[str]) -> dict[str, str]:
    """``{file name: SHA-256}`` of :func:`model_files` (a :func:`prefetch` under way is waited for first)."""
    real = os.path.realpath(folder)
    with _lock:
        thread = _pending.pop(real, None)
    if thread is not None:
        thread.join()
    return {p.name: file_sha256(p) for p in model_files(Path(real))}


def prefetch(folder: str | os.PathLike[str]) -> None:
    """Start hashing ``folder`` in a daemon thread (while the model loads), so that :func:`folder_digests` finds
    the digests made. An error there (a file removed meanwhile) is left for :func:`folder_digests` to meet."""
    if not os.path.isdir(folder):
        return
    real = os.path.realpath(folder)

    def work() -> None:
        try:
            for p in model_files(Path(real)):
                file_sha256(p)
        except OSError:
            pass

    with _lock:
        if real in _pending:
            return
        thread = _pending[real] = threading.Thread(target=work, name="seqgen-digests", daemon=True)
    thread.start()
