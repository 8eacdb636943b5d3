"""Helpers of the damage-and-hostile-input tests: edits with every checksum recomputed, a canary.

A hostile checkpoint is one whose manifest still verifies: each helper that
edits a checkpoint writes its manifest again from the files as they are now
(sizes, CRC32C, the manifest's own CRC), as someone crafting it would.

``Outside`` is a directory beside the checkpoints that nothing may read or
list: an audit hook (``sys.addaudithook``: Python's ``open``, ``os.open``,
listings) records every access to it once armed, and each of its files has
an access time older than its modification time, which the kernel moves on
any read (``relatime``), also by TensorStore's or TensorFlow's own C++ code
that the audit hook does not see.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

from asyncckpt._engine import fastcrc
from asyncckpt._engine.files import FileRecord
from asyncckpt._engine.manifest import Manifest

_WATCHED: list[str] = []
_HITS: list[tuple[str, str]] = []
_EVENTS = {"open", "os.listdir", "os.scandir"}


def _audit(event: str, args: tuple) -> None:
    if not _WATCHED or event not in _EVENTS or not args:
        return
    path = args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    try:
        full = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return
    for watched in _WATCHED:
        if full == watched or full.startswith(watched + os.sep):
            _HITS.append((event, full))


sys.addaudithook(_audit)  # once per process; it does nothing until a directory is watched


class Outside:
    """A directory outside every checkpoint that a test checks nobody reads (module docstring)."""

    def __init__(self, path: Path):
        self.dir = path
        path.mkdir(parents=True, exist_ok=True)
        self._atimes: dict[str, float] = {}

    def write(self, name: str, data: bytes) -> Path:
        """A file of the outside directory, its access time set back."""
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def arm(self) -> None:
        """From now on any read of the directory is recorded."""
        self._atimes = {}
        for root, _, names in os.walk(self.dir):
            for name in names:
                path = os.path.join(root, name)
                st = os.stat(path)
                os.utime(path, (st.st_mtime - 1e6, st.st_mtime))
                self._atimes[path] = os.stat(path).st_atime
        _HITS.clear()
        _WATCHED.append(os.path.abspath(self.dir))

    def disarm(self) -> None:
        with contextlib.suppress(ValueError):
            _WATCHED.remove(os.path.abspath(self.dir))

    def assert_untouched(self) -> None:
        """Nothing in the directory was opened, listed or read since ``arm``."""
        hits = list(_HITS)
        read = [p for p, atime in self._atimes.items() if os.stat(p).st_atime != atime]
        assert not hits, f"opened or listed outside the checkpoint: {hits}"
        assert not read, f"read outside the checkpoint (access time moved): {read}"


@contextlib.contextmanager
def no_hang(seconds: float = 60.0):
    """Fails the test (``TimeoutError``) instead of blocking forever (a FIFO opened, say).

    SIGALRM interrupts a blocking system call of the main thread.
    """
    if threading.current_thread() is not threading.main_thread():  # pragma: no cover
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _record(root: Path, name: str) -> FileRecord:
    path = name if os.path.isabs(name) else os.path.join(root, *name.split("/"))
    size, crc = fastcrc.checksum_file(path, fastcrc.CRC32C)
    return FileRecord(name, size, crc, fastcrc.CRC32C)


def rewrite_manifest(manifest_path: Path, root: Path, *, names: list[str] | None = None,
                     add: tuple[str, ...] = ()) -> None:
    """Writes a manifest again from the files as they are now, its own CRC recomputed.

    Args:
        manifest_path: The manifest (read as JSON, not verified: its files may be edited).
        root: Directory its names are relative to.
        names: The files to list (default: the ones it lists); each checksummed now.
        add: Names to list too, checksummed as they resolve (``../outside/x``, say).
    """
    body = json.loads(Path(manifest_path).read_text())
    listed = [f["name"] for f in body["files"]] if names is None else names
    files = tuple(_record(root, n) for n in [*listed, *add])
    old = Manifest(framework=body["framework"], label=body["label"], step=body["step"],
                   files=files, stats=body.get("stats", {}), extra=body.get("extra", {}),
                   created=body["created"], version=body["asyncckpt_version"])
    Path(manifest_path).write_text(old.to_json())


def step_files(step_dir: Path, manifest_name: str) -> list[str]:
    """Every file under a step directory (names relative to it), its manifest left out."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
            if rel != manifest_name:
                out.append(rel)
    return sorted(out)


def replace_with(path: Path, kind: str) -> None:
    """Puts a directory or a FIFO where the file ``path`` was."""
    os.remove(path)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:  # pragma: no cover
        raise ValueError(kind)
