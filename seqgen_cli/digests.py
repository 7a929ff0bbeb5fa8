"""What a checkpoint folder *is*, by content: the SHA-256 of every file that decides the outputs
(``checkpoint.read_files``: the weight files transformers loads, shards in subfolders too, the config, the generation
config, the tokenizer files), for ``--resume``, the journal and ``seqgen merge`` (``pipeline/resume.py:
model_identity``).

Hashing runs at ~1.8 GB/s on one core (1.63 GB in 0.90 s, docs/BENCHMARKS.md "Checkpoint digests"), so each
file's digest is cached on disk (``<cache>/digests/``; :func:`cache_dir`, shared with the int8 weight cache) under
its real path, keyed by what a rewrite changes: size, modification and status-change times, inode and device. A
file saved anew, copied or touched back to its old modification time gets a new status-change time, so it is
hashed again; an unchanged one costs a ``stat``. An entry carries a check of its own fields: a damaged one (a
flipped digit, a torn write) is hashed again, never trusted. :func:`prefetch` starts the hashing in a thread while
the model loads (the same bytes, read from the page cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from seqgen_cli import checkpoint
from seqgen_cli.errors import SeqgenError

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


def _entry_path(real: str) -> Path:
    return cache_folder() / f"{hashlib.sha256(real.encode()).hexdigest()}.json"


def file_sha256(path: Path, expected: checkpoint.StatKey | None = None) -> str:
    """SHA-256 of ``path``'s bytes: from the cache when its stat key is unchanged, else hashed (and cached).
    ``expected``: the stat key the file had when the model loaded; another one is an error (the digest would be of
    other bytes than the weights in use)."""
    real = os.path.realpath(path)
    key = checkpoint.stat_key(Path(real))
    if expected is not None and key != tuple(expected):
        raise SeqgenError(f"{path} changed since the model loaded from it: run again once the checkpoint is saved")
    with _lock:
        known = _memo.get((real, key))
    if known is not None:
        return known
    entry = _entry_path(real)
    digest = _cached(entry, real, key)
    if digest is None:
        with open(real, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if checkpoint.stat_key(Path(real)) != key:  # changed while hashing: neither kept nor the loaded bytes
            raise SeqgenError(f"{path} changed while its digest was made: run again once the checkpoint is saved")
        _store(entry, {"path": real, "key": list(key), "sha256": digest})
    with _lock:
        _memo[(real, key)] = digest
    return digest


def _check(record: dict[str, Any]) -> str:
    """The entry's own check: a digest of its other fields, so a damaged entry is told from a stale one."""
    fields = json.dumps([record.get("path"), record.get("key"), record.get("sha256")])
    return hashlib.sha256(fields.encode()).hexdigest()[:16]


def _cached(entry: Path, real: str, key: tuple[int, ...]) -> str | None:
    """The cached digest of ``real`` at ``key``, or ``None``: no entry, another file's or key's, or damaged."""
    try:
        record = json.loads(entry.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("check") != _check(record):
        return None
    if record.get("path") != real or tuple(record.get("key") or ()) != key:
        return None
    return str(record["sha256"])


def _store(entry: Path, record: dict[str, Any]) -> None:
    """Write ``entry`` in place (a torn or partial entry fails its check and is hashed again: no temporary
    files to leave behind); a cache that cannot be written (read-only, full, a file where its folder goes) is
    skipped: the digest is right either way, only the next run hashes again."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text(json.dumps({**record, "check": _check(record)}), encoding="utf-8")
    except OSError:
        try:
            entry.unlink(missing_ok=True)  # what a full disk left of it
        except OSError:
            pass


def folder_digests(folder: str | os.PathLike[str], loaded: dict[str, checkpoint.StatKey] | None = None) -> dict[str, str]:
    """``{name in the folder: SHA-256}`` of ``checkpoint.read_files`` (a :func:`prefetch` under way is waited for
    first). ``loaded``: the stat keys the files had when the model loaded (``checkpoint.snapshot``); the digests are
    of exactly those files, as they were then, or an error."""
    real = os.path.realpath(folder)
    with _lock:
        thread = _pending.pop(real, None)
    if thread is not None:
        thread.join()
    base = Path(real)
    if loaded is not None:
        return {name: file_sha256(base / name, key) for name, key in loaded.items()}
    return {checkpoint.relative(base, p): file_sha256(p) for p in checkpoint.read_files(base)}


def prefetch(folder: str | os.PathLike[str]) -> None:
    """Start hashing ``folder`` in a daemon thread (while the model loads), so that :func:`folder_digests` finds
    the digests made. An error there (a file removed meanwhile) is left for :func:`folder_digests` to meet."""
    if not os.path.isdir(folder):
        return
    real = os.path.realpath(folder)

    def work() -> None:
        try:
            for p in checkpoint.read_files(Path(real)):
                file_sha256(p)
        except (OSError, SeqgenError):  # left for folder_digests to meet
            pass

    with _lock:
        if real in _pending:
            return
        thread = _pending[real] = threading.Thread(target=work, name="seqgen-digests", daemon=True)
    thread.start()
