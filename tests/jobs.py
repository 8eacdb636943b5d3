"""A save job for the engine's own tests: one file, committed through the engine's transaction.

The engine's tests drive ``AsyncEngine`` with a job that writes a directory
checkpoint (``<root>/<name>/data.bin`` beside its manifest) the way every
front end does: a ``SaveJob`` whose ``Transaction`` publishes by rename.
Faults and pauses are options of the one job rather than copies of it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable

from asyncckpt import AsyncOptions
from asyncckpt._engine._jobs import SaveJob
from asyncckpt._engine.destinations import RenamedDirectory
from asyncckpt._engine.transaction import Transaction

MANIFEST = "manifest.json"


def directory_transaction(root: str, name: str, *, fsync: bool = False) -> Transaction:
    """The transaction of a directory checkpoint ``<root>/<name>`` (renamed into place)."""
    return Transaction(RenamedDirectory(os.path.join(root, name), fsync=fsync),
                       framework="test", label=name, step=None, manifest_name=MANIFEST,
                       options=AsyncOptions(fsync=fsync))


class DirJob(SaveJob):
    """Writes ``chunks`` as ``data.bin`` of the directory checkpoint ``<root>/<name>``.

    Args:
        root: Directory the checkpoint is published in.
        name: Checkpoint name.
        chunks: The file's bytes (buffers), or a callable returning them
            (called by ``write``, so it may wait or count).
        nbytes: Bytes reported to the engine (default: the chunks' sizes, or 1).
        gate: ``write`` waits for this event first.
        fail: Raised by ``write`` after the gate, before anything is written.
        fail_after_write: Raised by ``write`` once the file is written.
        fail_in_commit: Raised by ``commit`` once the files are durable.
        after: Raised by ``after_commit``.
        written: Set once the file is written.
        fsync: The transaction's fsync.
    """

    def __init__(self, root: str, name: str,
                 chunks: Iterable[object] | Callable[[], Iterable[object]] = (b"12345678",),
                 *, nbytes: int | None = None, gate: threading.Event | None = None,
                 fail: BaseException | None = None,
                 fail_after_write: BaseException | None = None,
                 fail_in_commit: BaseException | None = None,
                 after: BaseException | None = None,
                 written: threading.Event | None = None, fsync: bool = False):
        if nbytes is None:
            nbytes = 1 if callable(chunks) else sum(memoryview(c).nbytes for c in chunks)
        super().__init__(label=name, step=None, nbytes=nbytes,
                         transaction=directory_transaction(root, name, fsync=fsync))
        self._chunks = chunks
        self._gate, self._fail, self._written = gate, fail, written
        self._fail_after_write, self._fail_in_commit, self._after = (
            fail_after_write, fail_in_commit, after)
        self.tmp: str | None = None
        self.writer_thread: threading.Thread | None = None

    def write(self) -> None:
        self.writer_thread = threading.current_thread()
        if self._gate is not None:
            assert self._gate.wait(600), "the test never opened the gate"
        if self._fail is not None:
            raise self._fail
        chunks, self._chunks = self._chunks, ()  # the slot's buffers are not kept
        self.tmp = self.transaction.begin()
        self.transaction.files.write("data.bin", chunks() if callable(chunks) else chunks)
        if self._written is not None:
            self._written.set()
        if self._fail_after_write is not None:
            raise self._fail_after_write

    def commit(self, stats) -> None:
        if self._fail_in_commit is not None:
            self.transaction.seal()
            raise self._fail_in_commit
        super().commit(stats)

    def after_commit(self, stats) -> None:
        if self._after is not None:
            raise self._after
