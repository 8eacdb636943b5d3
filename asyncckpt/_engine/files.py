"""Durable file writes with checksums, for the background writer.

``DurableWriter`` writes buffers straight from host staging memory, computes
a checksum of each file (``fastcrc.default_algorithm``: CRC32C where the
hardware one is installed, else zlib's CRC32) while its bytes are hot in the
CPU cache, and fsyncs each finished file on the process's fsync threads:
the disk's write-back of one file overlaps the writing of the next, and a
save's fsyncs (its directories' too) run at once, so the file system commits
them together. Nothing here runs on the training thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from asyncckpt._engine import fastcrc
from asyncckpt._engine.metrics import CHECKSUM, FSYNC, READ_BACK, WRITE, Phases

logger = logging.getLogger(__name__)

_CHUNK = 64 << 20  # bytes per write() call; bounds the size of one memoryview slice.
# Bytes per write() call of a writer with a ``pause``: it pauses between them, so
# this bounds how long a write runs on after a save starts copying.
_PAUSE_CHUNK = 1 << 20


@dataclass(frozen=True)
class Checksummed:
    """A chunk for ``DurableWriter.write`` whose checksum the caller has already.

    The writer combines it into the file's checksum instead of reading the
    bytes a second time (a caller that checksums each array for its own
    index, say).

    Attributes:
        data: The bytes (any object supporting the buffer protocol).
        crc: Their checksum in the writer's algorithm.
    """

    data: object
    crc: int


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint.

    In the manifest, the checksum is stored under its algorithm's name
    (``{"name", "size", "crc32c": ...}``); records of manifests from before
    CRC32C hold ``"crc32"`` (zlib). A reader that knows only ``"crc32"``
    sees no checksum in a CRC32C record and checks the size alone.

    Attributes:
        name: Path relative to the checkpoint's root, with ``/`` separators.
        size: Size in bytes.
        crc: Checksum of the contents, or None when checksums are off.
        algorithm: ``fastcrc.CRC32`` (zlib) or ``fastcrc.CRC32C``.
    """

    name: str
    size: int
    crc: int | None
    algorithm: str = fastcrc.CRC32

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, self.algorithm: self.crc}

    @classmethod
    def from_json(cls, d: dict) -> FileRecord:
        algorithm = fastcrc.CRC32C if fastcrc.CRC32C in d else fastcrc.CRC32
        crc = d.get(algorithm)
        return cls(name=str(d["name"]), size=int(d["size"]),
                   crc=None if crc is None else int(crc), algorithm=algorithm)

    def check(self, path: str) -> int | None:
        """Recomputes the file's checksum; None when it matches (or none is recorded)."""
        if self.crc is None:
            return None
        _, crc = fastcrc.checksum_file(path, self.algorithm)
        return None if crc == self.crc else crc

    def mismatch(self, computed: int) -> str:
        """Words for a failed check, naming the algorithm and both values."""
        return (f"{self.algorithm.upper()} check (stored {self.crc:#010x}, "
                f"computed {computed:#010x})")


def fsync_path(path: str) -> None:
    """Flushes a file's (or a directory's) data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_file(path: str) -> tuple[int, int]:
    """Returns ``(size, zlib crc32)`` of a file, read in large chunks."""
    return fastcrc.checksum_file(path, fastcrc.CRC32)


class DurableWriter:
    """Writes the files of one checkpoint under a root directory.

    Call order: ``write``/``add_existing`` for every file, then ``finish``
    (which waits for every fsync and fsyncs the directories), or ``abort``.

    Args:
        root: Directory the file names are relative to.
        fsync: Whether to fsync files and directories.
        checksums: Whether to compute checksums.
        algorithm: Their algorithm; default ``fastcrc.default_algorithm()``.
        pause: Called before each file, each write of ``_PAUSE_CHUNK``
            bytes and each fsync: the engine's ``SaveGate.wait``, which holds
            the writer while a save copies (see ``engine._gate``). None
            writes in ``_CHUNK`` pieces without pausing.
        mode: Permission bits of the files and directories it creates
            (orbax's ``FileOptions.path_permission_mode``; files without the
            execute bits); None: the umask's default.
        phases: Where the time goes (``SaveStats.phases``): each kind of
            file's writes, checksums, fsyncs. None: a recorder of its own.
    """

    def __init__(self, root: str, *, fsync: bool, checksums: bool,
                 algorithm: str | None = None, pause: Callable[[], None] | None = None,
                 mode: int | None = None, phases: Phases | None = None):
        self.root = root
        self._fsync = fsync
        self._checksums = checksums
        self.algorithm = algorithm or fastcrc.default_algorithm()
        self._update = fastcrc.updater(self.algorithm)
        self._records: list[FileRecord] = []
        self._dirs: set[str] = {root}
        self._flusher = _Flusher(pause) if fsync else None
        self._pause = pause
        self.mode = mode
        self.phases = Phases() if phases is None else phases
        self._kind = "files"

    def _path(self, name: str) -> str:
        path = os.path.join(self.root, *name.split("/"))
        parent = os.path.dirname(path)
        if parent not in self._dirs:
            self._make_dirs(parent)
        return path

    def _make_dirs(self, path: str) -> None:
        """Creates ``path`` and missing parents (with ``mode``); ``finish`` fsyncs each."""
        below = []  # path and its parents up to one already known
        while path not in self._dirs and len(path) > len(self.root):
            below.append(path)
            path = os.path.dirname(path)
        for d in reversed(below):
            if not os.path.isdir(d):
                os.makedirs(d, exist_ok=True)
                if self.mode is not None:
                    os.chmod(d, self.mode)
        self._dirs.update(below)

    @contextlib.contextmanager
    def kind(self, kind: str) -> Iterator[None]:
        """The files written in the block count in phase ``write:<kind>`` (default ``files``)."""
        before, self._kind = self._kind, kind
        try:
            yield
        finally:
            self._kind = before

    def write(self, name: str, chunks: Iterable[object]) -> FileRecord:
        """Writes ``chunks`` to a new file.

        Args:
            name: The file, relative to the root.
            chunks: Objects supporting the buffer protocol, or ``Checksummed``
                ones carrying their checksum in this writer's algorithm.
        """
        record = self._write(name, chunks)
        self._records.append(record)
        return record

    def write_unlisted(self, name: str, data: bytes) -> None:
        """Writes a file made durable with the others but not among ``records``.

        The manifest that lists the others (``Transaction.commit``): written
        before ``finish``, so its fsync joins theirs.
        """
        self._write(name, (data,), listed=False)

    def _write(self, name: str, chunks: Iterable[object], *, listed: bool = True) -> FileRecord:
        """Writes a file (``listed``: checksummed, and its time counted in ``write:<kind>``)."""
        pause = self._pause
        step = _CHUNK if pause is None else _PAUSE_CHUNK
        clock = time.perf_counter
        t0 = clock()
        crc_s = 0.0
        path = self._path(name)
        crc = 0
        size = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if self.mode is not None:
                os.fchmod(fd, self.mode & 0o666)
            for chunk in chunks:
                known = isinstance(chunk, Checksummed)
                view = memoryview(chunk.data if known else chunk).cast("B")
                if known and self._checksums:
                    crc = fastcrc.crc_combine(crc, chunk.crc, len(view), self.algorithm)
                for start in range(0, len(view), step):
                    if pause is not None:
                        pause()
                    part = view[start : start + step]
                    if listed and self._checksums and not known:
                        t = clock()
                        crc = self._update(part, crc)
                        crc_s += clock() - t
                    while part:
                        written = os.write(fd, part)
                        part = part[written:]
                size += len(view)
        finally:
            os.close(fd)
        if listed:
            if crc_s:
                self.phases.add(CHECKSUM, crc_s, 1, size)
            self.phases.add(WRITE + self._kind, clock() - t0 - crc_s, 1, size)
        record = FileRecord(name, size, crc if self._checksums else None, self.algorithm)
        self._schedule_fsync(path)
        return record

    def prepare(self, name: str) -> str:
        """The path of a file that something else will write under the root.

        Its missing directories are made (with ``mode``) and fsynced by
        ``finish``; record the file with ``add_existing`` once written.
        """
        return self._path(name)

    def add_existing(self, name: str, *,
                     known: tuple[int, int, str] | None = None) -> FileRecord:
        """Records a file that something else (e.g. TensorFlow) wrote.

        Args:
            name: The file, relative to the root.
            known: ``(size, checksum, algorithm)`` of the bytes the writer
                put in the file, computed from its source buffers as it
                wrote them; spares reading the file back. The size is
                checked against the file.
        """
        path = self._path(name)
        # Start the flush first so the disk works while we read the file back.
        self._schedule_fsync(path)
        if known is not None:
            size = os.path.getsize(path)
            if size != known[0]:
                raise OSError(f"{path} holds {size} bytes, {known[0]} were written")
            record = FileRecord(name, size, known[1] if self._checksums else None, known[2])
        elif self._checksums:
            t0 = time.perf_counter()
            size, crc = fastcrc.checksum_file(path, self.algorithm)
            self.phases.add(READ_BACK, time.perf_counter() - t0, 1, size)
            record = FileRecord(name, size, crc, self.algorithm)
        else:
            record = FileRecord(name, os.path.getsize(path), None, self.algorithm)
        self._records.append(record)
        return record

    def sync(self, path: str) -> None:
        """Makes one file or directory durable: every fsync of the writer is this call
        (on the process's fsync threads, files and directories alike)."""
        fsync_path(path)

    def _schedule_fsync(self, path: str) -> None:
        if self._flusher is not None:
            self._flusher.submit(path, self.sync)

    @property
    def records(self) -> list[FileRecord]:
        return list(self._records)

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self._records)

    def finish(self) -> list[FileRecord]:
        """Waits until every file and directory written is durable.

        The directories' fsyncs run beside the files' still in flight: each
        makes durable the entries its directory holds now, all of them
        written by then.
        """
        if self._flusher is not None:
            for d in sorted(self._dirs, key=len, reverse=True):
                self._flusher.submit(d, self.sync)
            self._flusher.join()
            self.phases.merge(self._flusher.phases)
            # Files written after this: a new batch.
            self._flusher = _Flusher(self._pause)
        return self.records

    def abort(self) -> None:
        """Stops the flushing thread without waiting for durability."""
        if self._flusher is not None:
            self._flusher.join(raise_errors=False)


# Threads that fsync for every writer of the process: the fsyncs of a save run
# at once, so the file system commits them together (ext4: one journal commit
# for the small files beside the data file's; one after the other, each small
# file's fsync was a commit of its own, +20 ms on a 16 MiB save on this
# project's VM). A thread of the pool mostly waits in the kernel.
_FSYNC_THREADS = 8


class _FsyncPool:
    """Plain daemon threads that run queued fsyncs (see ``_FSYNC_THREADS``).

    Plain threads rather than an executor: executors refuse new work once the
    interpreter has begun to shut down, which is exactly when the exit flush of
    in-flight saves needs them. Started on first use; a ``fork()`` child
    starts its own (``_after_fork_in_child``).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[_Flusher, str, Callable[[str], None]]] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self._threads = 0

    def submit(self, batch: _Flusher, path: str, sync: Callable[[str], None]) -> None:
        with self._lock:
            if self._threads < _FSYNC_THREADS:
                self._threads += 1
                threading.Thread(target=self._run, name="asyncckpt-fsync", daemon=True).start()
        self._queue.put((batch, path, sync))

    def _run(self) -> None:
        while True:
            batch, path, sync = self._queue.get()
            batch.run(path, sync)
            del batch, sync


_pool = _FsyncPool()


def _after_fork_in_child() -> None:
    global _pool
    _pool = _FsyncPool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Flusher:
    """One writer's fsyncs, run by the process's fsync threads (``_FsyncPool``) as submitted.

    Counts what is in flight, keeps the first error and sums the time of each
    fsync (``FSYNC``); ``join`` waits for all of them. Each fsync comes with
    its function (``DurableWriter.sync``), held only until it has run: a
    writer holding its flusher holding the writer would be a reference cycle.
    """

    def __init__(self, pause: Callable[[], None] | None = None):
        self._pause = pause  # called before each fsync (see DurableWriter)
        self._cv = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self.phases = Phases()  # read once joined

    def submit(self, path: str, sync: Callable[[str], None]) -> None:
        """Queues ``sync(path)``, the fsync of one path."""
        with self._cv:
            self._pending += 1
        _pool.submit(self, path, sync)

    def run(self, path: str, sync: Callable[[str], None]) -> None:
        """On a pool thread: ``sync(path)`` (unless an earlier fsync of this writer failed)."""
        seconds = 0.0
        error = None
        if self._error is None:
            try:
                if self._pause is not None:
                    self._pause()
                t0 = time.perf_counter()
                sync(path)
                seconds = time.perf_counter() - t0
            except BaseException as e:  # surfaced by join()
                error = e
        with self._cv:
            if error is not None and self._error is None:
                self._error = error
            if seconds:
                self.phases.add(FSYNC, seconds)
            self._pending -= 1
            self._cv.notify_all()

    def join(self, *, raise_errors: bool = True) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)
            error = self._error
        if raise_errors and error is not None:
            raise error
