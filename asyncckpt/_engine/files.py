"""Durable file writes with checksums, for the background writer.

``DurableWriter`` writes buffers straight from host staging memory, computes
a checksum of each file (``fastcrc.default_algorithm``: CRC32C where the
hardware one is installed, else zlib's CRC32) while its bytes are hot in the
CPU cache, and fsyncs each finished file on a helper thread so the disk's
write-back of one file overlaps the writing of the next. Nothing here runs on the training thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from asyncckpt._engine import fastcrc

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
    """

    def __init__(self, root: str, *, fsync: bool, checksums: bool,
                 algorithm: str | None = None, pause: Callable[[], None] | None = None,
                 mode: int | None = None):
        self.root = root
        self._fsync = fsync
        self._checksums = checksums
        self.algorithm = algorithm or fastcrc.default_algorithm()
        self._update = fastcrc.updater(self.algorithm)
        self._records: list[FileRecord] = []
        self._dirs: set[str] = {root}
        self._flusher = _Flusher(self.sync, pause) if fsync else None
        self._pause = pause
        self._mode = mode

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
                if self._mode is not None:
                    os.chmod(d, self._mode)
        self._dirs.update(below)

    def write(self, name: str, chunks: Iterable[object]) -> FileRecord:
        """Writes ``chunks`` to a new file.

        Args:
            name: The file, relative to the root.
            chunks: Objects supporting the buffer protocol, or ``Checksummed``
                ones carrying their checksum in this writer's algorithm.
        """
        pause = self._pause
        step = _CHUNK if pause is None else _PAUSE_CHUNK
        path = self._path(name)
        crc = 0
        size = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if self._mode is not None:
                os.fchmod(fd, self._mode & 0o666)
            for chunk in chunks:
                known = isinstance(chunk, Checksummed)
                view = memoryview(chunk.data if known else chunk).cast("B")
                if known and self._checksums:
                    crc = fastcrc.crc_combine(crc, chunk.crc, len(view), self.algorithm)
                for start in range(0, len(view), step):
                    if pause is not None:
                        pause()
                    part = view[start : start + step]
                    if self._checksums and not known:
                        crc = self._update(part, crc)
                    while part:
                        written = os.write(fd, part)
                        part = part[written:]
                size += len(view)
        finally:
            os.close(fd)
        record = FileRecord(name, size, crc if self._checksums else None, self.algorithm)
        self._records.append(record)
        self._schedule_fsync(path)
        return record

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
            size, crc = fastcrc.checksum_file(path, self.algorithm)
            record = FileRecord(name, size, crc, self.algorithm)
        else:
            record = FileRecord(name, os.path.getsize(path), None, self.algorithm)
        self._records.append(record)
        return record

    def sync(self, path: str) -> None:
        """Makes one file or directory durable: every fsync of the writer is this call
        (on the flushing thread for files, in ``finish`` for directories)."""
        fsync_path(path)

    def _schedule_fsync(self, path: str) -> None:
        if self._flusher is not None:
            self._flusher.submit(path)

    @property
    def records(self) -> list[FileRecord]:
        return list(self._records)

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self._records)

    def finish(self) -> list[FileRecord]:
        """Waits until every file and directory written is durable."""
        if self._flusher is not None:
            self._flusher.join()
            # Deepest first, so each directory's entry in its parent is flushed last.
            for d in sorted(self._dirs, key=len, reverse=True):
                self.sync(d)
        return self.records

    def abort(self) -> None:
        """Stops the flushing thread without waiting for durability."""
        if self._flusher is not None:
            self._flusher.join(raise_errors=False)


class _Flusher:
    """A helper thread that fsyncs files in the order they were finished.

    A plain thread rather than an executor: executors refuse new work once the
    interpreter has begun to shut down, which is exactly when the exit flush of
    in-flight saves needs it.
    """

    def __init__(self, sync: Callable[[str], None],
                 pause: Callable[[], None] | None = None):
        self._sync = sync  # the fsync of one path (DurableWriter.sync)
        self._pause = pause  # called before each fsync (see DurableWriter)
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncckpt-fsync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (path := self._queue.get()) is not None:
            if self._error is None:
                try:
                    if self._pause is not None:
                        self._pause()
                    self._sync(path)
                except BaseException as e:  # surfaced by join()
                    self._error = e

    def submit(self, path: str) -> None:
        self._queue.put(path)

    def join(self, *, raise_errors: bool = True) -> None:
        self._queue.put(None)
        self._thread.join()
        if raise_errors and self._error is not None:
            raise self._error
