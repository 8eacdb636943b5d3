"""Commit stage: one save's transaction, the only way asyncckpt commits a checkpoint.

Every front end (TensorFlow, JAX, the job runner, Keras) commits through a
``Transaction``: temp -> write -> manifest -> publish.

1. ``begin``: the destination (``_engine/destinations.py``) makes the
   directory the files go into: a temporary no reader mistakes for a
   checkpoint, or the step's own directory where a marker commits it;
2. the front end's format writer writes its files through ``files`` (a
   ``DurableWriter``: checksummed as written, fsynced on a helper thread), or
   ``adopt``s files something else wrote there (TensorFlow's ``SaveV2``, an
   orbax handler): they are checksummed and fsynced the same way;
3. ``seal``: every file and directory is durable; their records;
4. ``publish``: the manifest (every file's size and checksum, the step,
   the save's stats) is written into the directory, durable, and the
   destination publishes (a rename, a marker created last, a prefix's index
   moved last), then completes it (object storage: the upload). Returning
   means committed; before the publish, ``abort`` removes everything the
   save wrote, and after it nothing (a failed upload leaves the local copy).

``commit`` is 3 and 4 for a save of one process, with the manifest written
before the seal: its fsync then joins the files' (one batch, which the file
system commits together) instead of following them.

A multi-process save is one transaction per process over a shared
directory: the others ``seal`` and ``release`` (``jax/_job.py`` hands their
records to the primary), and the primary publishes every process's files.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence

from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.destinations import Destination
from asyncckpt._engine.files import DurableWriter, FileRecord
from asyncckpt._engine.manifest import Manifest
from asyncckpt._engine.metrics import FSYNC_WAIT, MANIFEST, PUBLISH, Phases, SaveStats
from asyncckpt.options import AsyncOptions


class Transaction:
    """One checkpoint's commit (see the module docstring).

    Args:
        destination: Where and how the checkpoint is published.
        framework: Recorded in the manifest (``"tensorflow"``, ``"jax"``, ...).
        label: The checkpoint's name, recorded in the manifest.
        step: The training step, recorded in the manifest.
        manifest_name: The manifest's file name in the working directory.
        options: ``fsync`` and ``checksums``.
        mode: Permission bits of the files written (orbax's
            ``FileOptions.path_permission_mode``, less the execute bits);
            None: the umask's default.
        on_begin: Called once the working directory exists (the JAX manager
            lists its directory again then, off the training thread).

    Attributes:
        writer_class: What writes (and adopts) the checkpoint's files: a
            ``DurableWriter``, or a subclass of it (one that counts, holds or
            fails writes in a test) set on a transaction before ``files``.
    """

    writer_class: type[DurableWriter] = DurableWriter

    def __init__(self, destination: Destination, *, framework: str, label: str,
                 step: int | None, manifest_name: str, options: AsyncOptions,
                 mode: int | None = None, on_begin: Callable[[], None] | None = None):
        self.destination = destination
        self.framework = framework
        self.label = label
        self.step = step
        self.manifest_name = manifest_name
        #: Whether files and directories are fsynced (``AsyncOptions.fsync``).
        self.fsync = options.fsync
        self._checksums = options.checksums
        self._mode = mode
        self._on_begin = on_begin
        self._pause: Callable[[], None] | None = None
        self._workdir: str | None = None
        self._files: DurableWriter | None = None
        self.published = False
        #: Where the commit's time goes (``SaveStats.phases``); its writers add theirs.
        self.phases = Phases()

    @property
    def began(self) -> bool:
        return self._workdir is not None

    @property
    def workdir(self) -> str:
        """The directory the files are written into (``begin`` first)."""
        if self._workdir is None:
            raise RuntimeError(f"the transaction of {self.label!r} has not begun")
        return self._workdir

    @property
    def files(self) -> DurableWriter:
        """The writer of the checkpoint's files, relative to ``workdir``."""
        if self._files is None:
            self._files = self.writer()
        return self._files

    def set_pause(self, pause: Callable[[], None] | None) -> None:
        """Writes pause between pieces on ``pause()`` (the engine's gate); before ``files``."""
        self._pause = pause

    def begin(self) -> str:
        """Creates the working directory (once); returns it."""
        if self._workdir is None:
            self._workdir = self.destination.open()
            if self._on_begin is not None:
                self._on_begin()
        return self._workdir

    def writer(self) -> DurableWriter:
        """Another writer into ``workdir`` (its records are passed to ``publish``)."""
        return self.writer_class(self.workdir, fsync=self.fsync, checksums=self._checksums,
                                 pause=self._pause, mode=self._mode, phases=self.phases)

    def adopt(self, names: Iterable[str], *,
              known: dict[str, tuple[int, int, str]] | None = None) -> None:
        """Records files something else wrote into ``workdir`` (checksummed, made durable).

        ``known``: ``(size, checksum, algorithm)`` of files whose checksum was
        computed as they were written (spares reading them back).
        """
        known = known or {}
        for name in names:
            self.files.add_existing(name, known=known.get(name))

    def adopt_tree(self, subdir: str) -> None:
        """Records every file below ``workdir/subdir`` (an orbax handler's item)."""
        root = os.path.join(self.workdir, subdir)
        names = []
        for parent, dirs, files in os.walk(root):
            dirs.sort()
            rel = os.path.relpath(parent, self.workdir).replace(os.sep, "/")
            names += [f"{rel}/{f}" for f in sorted(files)]
        self.adopt(names)

    def seal(self) -> list[FileRecord]:
        """Waits until every file written or adopted is durable; their records."""
        if self._files is None:
            return []
        with self.phases.timed(FSYNC_WAIT):
            return self._files.finish()

    def publish(self, records: Sequence[FileRecord], stats: SaveStats | dict,
                extra: dict | None = None) -> Manifest:
        """Writes the manifest of ``records`` and publishes the checkpoint.

        For files already durable (``seal``), records from elsewhere among
        them (a multi-process save's primary). Returns the manifest. On
        return the checkpoint is committed.
        """
        manifest = self._manifest(records, stats, extra)
        workdir = self.workdir
        t0 = time.perf_counter()
        if self._mode is not None:
            self._apply_mode(workdir)
        commit_lib.write_text_atomic(os.path.join(workdir, self.manifest_name),
                                     manifest.to_json(), fsync=self.fsync,
                                     mode=self._mode)
        self.phases.add(MANIFEST, time.perf_counter() - t0)
        self._publish(workdir)
        return manifest

    def _manifest(self, records: Sequence[FileRecord], stats: SaveStats | dict,
                  extra: dict | None) -> Manifest:
        return Manifest(
            framework=self.framework,
            label=self.label,
            step=self.step,
            files=tuple(sorted(records, key=lambda r: r.name)),
            stats=stats.to_dict() if isinstance(stats, SaveStats) else dict(stats),
            extra=dict(extra or {}),
        )

    def _publish(self, workdir: str) -> None:
        """The destination's atomic step, then its completion (an upload)."""
        t0 = time.perf_counter()
        self.destination.publish(workdir, sorted(os.listdir(workdir)))
        self._workdir = None  # published: nothing of it is removed any more
        self.published = True
        self.destination.complete()  # an upload: if it fails, so does the save
        self.phases.add(PUBLISH, time.perf_counter() - t0)

    def _apply_mode(self, workdir: str) -> None:
        """Gives what others wrote (TensorStore, an orbax handler) the mode too."""
        mode = self._mode
        assert mode is not None
        for parent, dirs, files in os.walk(workdir):
            for d in dirs:
                os.chmod(os.path.join(parent, d), mode)
            for f in files:
                os.chmod(os.path.join(parent, f), mode & 0o666)

    def commit(self, stats: SaveStats | dict, extra: dict | None = None) -> Manifest:
        """The whole commit of a one-process save: manifest, durable, published.

        The manifest of every file written or adopted is written beside them
        before they are made durable, so its fsync joins theirs (``seal``,
        one batch); then the destination publishes. Returns the manifest; on
        return the checkpoint is committed.
        """
        files = self.files
        manifest = self._manifest(files.records, stats, extra)
        t0 = time.perf_counter()
        if self._mode is not None:
            self._apply_mode(self.workdir)
        files.write_unlisted(self.manifest_name, manifest.to_json().encode())
        self.phases.add(MANIFEST, time.perf_counter() - t0)
        self.seal()
        self._publish(self.workdir)
        return manifest

    def release(self, *, remove: bool = False) -> None:
        """This process is done with ``workdir``: another process publishes it
        (``remove``: it was this process's own copy, already uploaded)."""
        if self._files is not None:
            self._files.abort()
        workdir, self._workdir = self._workdir, None
        if workdir is None:
            return
        if remove:
            self.destination.discard(workdir)
        else:
            self.destination.release(workdir)

    def abort(self) -> None:
        """Removes whatever the save wrote; never raises."""
        if self._files is not None:
            self._files.abort()
        workdir, self._workdir = self._workdir, None
        if workdir is not None and not self.published:
            self.destination.discard(workdir)
