"""Where outputs go: a resumable file (complete lines only, plus a side index) or a stream.

``FileSink`` appends whole lines with one ``os.write`` per flush, so a crash or SIGKILL never leaves a
torn line, and after each ``fsync`` records the progress in the side index; outputs that wait for an
earlier input go to the journal (both in :mod:`~.formats`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import sys
from collections.abc import Iterator
from typing import BinaryIO

from seqgen_cli.errors import SeqgenError, WriteError
from seqgen_cli.pipeline.formats import (
    IndexEntry,
    IndexWriter,
    Journal,
    JsonLog,
    manifest_path,
    prefix_sha256,
    write_all,
    write_manifest,
)


def lock(fd: int, name: str) -> None:
    """Hold the file behind ``fd`` for this run (an advisory lock, released when ``fd`` is closed): a second seqgen
    run writing the same ``-o`` FILE would overwrite this one's outputs or interleave with them. A file system
    without locks (some network mounts, or a system without ``fcntl``) gives none."""
    try:
        import fcntl
    except ImportError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SeqgenError(_busy(name)) from None
    except OSError:  # no locks here: the run goes on unguarded
        pass


def check_not_busy(path: str) -> None:
    """Refuse ``-o path`` while another seqgen run writes it (it holds :func:`lock`): checked before the model
    loads, and again by the lock itself when the output opens."""
    try:
        import fcntl
    except ImportError:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not there yet (or unreadable: the writability check says so)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SeqgenError(_busy(path)) from None
    except OSError:
        pass
    finally:
        os.close(fd)


def _busy(name: str) -> str:
    return f"{name} is being written by another seqgen run: wait for it to finish, or give another -o"


class Sink:
    """Receives formatted outputs in input order."""

    done = 0  # inputs whose outputs are written
    name = "<stdout>"
    journals = False  # keeps outputs that wait for an earlier input where a resume finds them

    def write(self, data: bytes, inputs: int = 1) -> None:
        raise NotImplementedError

    def commit(self, digest: str = "") -> None:
        """Make what was written so far durable (as far as this sink can)."""

    def journal(self, entries: list[tuple[int, str, str]]) -> None:
        """Keep outputs that wait for an earlier input, ``(index, input key, text)``, where a resume can find
        them."""

    def kept(self) -> int:
        """Inputs whose outputs are in the output for good (after a failure: what a resume goes on from)."""
        return self.done

    def close(self, complete: bool) -> None:
        pass


class StreamSink(Sink):
    """Standard output (or any binary stream): flushed per output when it is a pipe or terminal.

    ``name``: what messages call it; ``owned``: the stream was opened for this run (closed with it)."""

    def __init__(
        self,
        stream: BinaryIO,
        *,
        name: str = "<stdout>",
        owned: bool = False,
    ) -> None:
        self.stream = stream
        self.flush_lines = _is_interactive(stream)
        self.name = name
        self.owned = owned

    def write(self, data: bytes, inputs: int = 1) -> None:
        with self._errors():
            self.stream.write(data)
            if self.flush_lines:
                self.stream.flush()
        self.done += inputs

    def commit(self, digest: str = "") -> None:
        with self._errors():
            self.stream.flush()

    def close(self, complete: bool) -> None:
        try:
            with self._errors():
                self.stream.flush()
        finally:
            if self.owned:
                with contextlib.suppress(OSError):
                    self.stream.close()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """An ``OSError`` (a device's I/O error, a full disk behind /dev/stdout) as a :class:`WriteError`;
        a closed pipe stays ``BrokenPipeError`` (the reader went away: not an error)."""
        try:
            yield
        except BrokenPipeError:
            raise
        except OSError as err:
            raise WriteError.of(err, self.name) from err


_FD_ALIAS = re.compile(r"/dev/(stdout|stderr|fd/\d+)|/proc/(self|thread-self|\d+)/fd/\d+")


def is_stream(output: str) -> bool:
    """Whether ``-o output`` is written as a stream: ``-``, /dev/stdout and its kin, a device, a pipe or a
    socket. A stream has no index or journal, is never cut back and cannot be resumed."""
    if output == "-":
        return True
    path = os.path.abspath(output)
    for _ in range(8):  # /dev/stdout -> /proc/self/fd/1 -> the file stdout is (which must not be rewritten)
        if _FD_ALIAS.fullmatch(path):
            return True
        if not os.path.islink(path):
            break
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    try:
        return not stat.S_ISREG(os.stat(output).st_mode)
    except OSError:  # not there yet: a new regular file
        return False


def open_stream(output: str, stdout: BinaryIO | None = None) -> StreamSink:
    """The sink for a stream output (see :func:`is_stream`; ``-``: ``stdout``, default ``sys.stdout``'s);
    appended to, never truncated (``>> FILE``)."""
    if output == "-":
        return StreamSink(stdout or sys.stdout.buffer)
    try:
        return StreamSink(open(output, "ab"), name=output, owned=True)  # noqa: SIM115 - closed with the sink
    except OSError as err:
        raise WriteError.of(err, output) from err


def _is_interactive(stream: BinaryIO) -> bool:
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)


class FileSink(Sink):
    """A regular output file with its side index; ``start`` is where a resumed run goes on from.

    A write that fails (disk full, an I/O error) raises :class:`WriteError`; closing an incomplete run cuts the
    file back to its last committed output, so it never ends in a torn line, and keeps index and journal.
    ``part``: the output of a ``--shard I/N`` run; a complete one is recorded in ``FILE.seqgen-part`` (see
    :mod:`~.merge`) before its index goes. ``resumed``: the interrupted run's last index entry, checked by
    :func:`~.resume.load` (the file's bytes up to its offset included).
    """

    journals = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        header: dict,
        *,
        resumed: IndexEntry | None = None,
        part: bool = False,
    ) -> None:
        self.name = os.fspath(path)
        self.header = header
        self.part = part  # a --shard run: a complete one leaves its manifest for `seqgen merge`
        done, offset = (resumed.done, resumed.offset) if resumed is not None else (0, 0)
        fresh = resumed is None
        self._created = fresh and not os.path.lexists(self.name)
        try:
            self.fd = os.open(self.name, os.O_WRONLY | os.O_CREAT, 0o666)
        except OSError as err:
            raise WriteError.of(err, self.name) from err
        try:
            lock(self.fd, self.name)  # before anything is changed: another run's file stays as it is
        except BaseException:
            os.close(self.fd)
            raise
        logs: list[JsonLog] = []
        try:
            logs.append(IndexWriter(path, header, fresh=fresh))
            logs.append(Journal(path, fresh=fresh))
            try:
                manifest_path(self.name).unlink(missing_ok=True)  # an earlier run's: rewritten now
                os.ftruncate(self.fd, offset)  # a resumed run drops any unindexed tail
                os.lseek(self.fd, offset, os.SEEK_SET)
            except OSError as err:
                raise WriteError.of(err, self.name) from err
        except BaseException:
            os.close(self.fd)
            for log in logs:
                log.close(complete=fresh)  # a fresh run leaves no index behind that would block a rerun
            raise
        self._index, self._journal = logs
        self._fresh, self._journaled = fresh, 0
        self.done = self.committed = done
        self.offset = offset
        self._buf: list[bytes] = []
        try:  # SHA-256 of the committed bytes, for the index and the part manifest
            self._hash = prefix_sha256(self.name, offset) if offset else hashlib.sha256()
        except OSError as err:
            self.close(complete=False)
            raise WriteError.of(err, self.name) from err

    def write(self, data: bytes, inputs: int = 1) -> None:
        self._buf.append(data)
        self.done += inputs

    def kept(self) -> int:
        return self.committed

    def commit(self, digest: str = "") -> None:
        if self.done == self.committed:
            return
        data = b"".join(self._buf)
        self._buf.clear()
        try:
            write_all(self.fd, data)
            os.fsync(self.fd)
        except OSError as err:
            raise WriteError.of(err, self.name) from err
        self.offset += len(data)
        self.committed = self.done
        self._hash.update(data)
        self._index.add(IndexEntry(self.done, self.offset, digest, self._hash.hexdigest()))

    def journal(self, entries: list[tuple[int, str, str]]) -> None:
        self._journal.add(entries)
        self._journaled += len(entries)

    def close(self, complete: bool) -> None:
        """Close; a complete run's index and journal are removed (nothing is left to resume), an incomplete
        run's file is cut back to its last committed output (a failed write may have left part of one).

        A fresh run that stopped before any output was committed or journaled leaves nothing behind (no index,
        journal, nor the output file it created): the next run starts afresh, with or without ``--resume``."""
        if not complete and self._fresh and self.committed == 0 and self._journaled == 0:
            self._discard()
            return
        try:
            if not complete:
                os.ftruncate(self.fd, self.offset)
            elif self.part:
                write_manifest(self.name, self.header, self.committed, self.offset, self._hash.hexdigest())
        except BaseException:
            complete = False  # no manifest: index and journal stay, --resume finishes the part
            raise
        finally:
            os.close(self.fd)
            self._journal.close(complete)
            self._index.close(complete)

    def _discard(self) -> None:
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)
            self._journal.close(complete=True)
            self._index.close(complete=True)
            if self._created:
                with contextlib.suppress(OSError):
                    os.unlink(self.name)
