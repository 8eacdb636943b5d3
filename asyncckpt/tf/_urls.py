"""``s3://`` and ``gs://`` prefixes for ``asyncckpt.tf.Checkpoint``.

A save to ``s3://bucket/run/ckpt-3`` is written like a local one, into a local
scratch directory kept per URL directory (``s3://bucket/run``), and its
background commit then uploads it with the storage protocol (data, manifest,
verification, create-only marker; ``asyncckpt.storage.protocol``). The save
is durable only once the marker is written: a failed upload fails that save,
whose error the engine re-raises on the next call or ``close``, and the
scratch copy is removed so nothing unfinished is ever read back. Writing
again under a prefix that is already committed with other content replaces
it, as a local save does (its marker goes first, so it is never listed half
replaced).

Restoring a URL looks the checkpoint up by its commit marker, downloads its
files into the scratch directory (verified against the manifest, the
manifest against the marker) unless the scratch directory holds the same
checkpoint already, and reads them there. The scratch directories live until
the Checkpoint is closed (TensorFlow may read the files again later, for
deferred restorations) or, at the latest, until the process exits.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from asyncckpt import layout
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.metrics import SaveStats
from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.storage import protocol
from asyncckpt.storage.base import retry_call
from asyncckpt.storage.tier import RemoteOptions, TieredDirectory, url_directory_options
from asyncckpt.storage.url import UnsupportedURLError, is_url, parse_location
from asyncckpt.tf import _statefile

logger = logging.getLogger(__name__)

#: Name of TensorFlow's state file, also kept next to the checkpoints in the bucket.
STATE_FILE = "checkpoint"


@dataclass(frozen=True)
class URLTarget:
    """Where a URL prefix is staged.

    Attributes:
        url: The canonical URL prefix (``s3://bucket/run/ckpt-3``).
        name: Its last component (``ckpt-3``), the checkpoint's name in the store.
        local_prefix: The same checkpoint in the scratch directory.
        tiers: The URL directory's scratch directory and remote tier.
    """

    url: str
    name: str
    local_prefix: str
    tiers: TieredDirectory

    @property
    def store(self):
        assert self.tiers.remote is not None
        return self.tiers.remote.store

    def _call(self, fn, what: str):
        assert self.tiers.remote is not None
        return retry_call(fn, what=f"{what} ({self.store.url})",
                          policy=self.tiers.remote.options.retry)

    def committed(self) -> protocol.RemoteCheckpoint | None:
        """The committed remote checkpoint of this name, or None."""
        objects = self._call(lambda: self.store.list(self.name), f"list {self.name}")
        # "ckpt-1." leaves out ckpt-10's objects.
        mine = [o for o in objects if o.key.startswith(self.name + ".")]
        found = [c for c in protocol.list_committed(self.store, objects=mine)
                 if c.name == self.name]
        return found[0] if found else None

    def upload(self, local_prefix: str) -> None:
        """Writer thread, right after the local publish: commits the checkpoint remotely.

        Part of the save's commit: raising here fails the save (and the
        scratch copy is removed by ``TieredDirectory.after_commit``).
        """
        del local_prefix
        with open(layout.tf_manifest_path(self.local_prefix), "rb") as f:
            crc = zlib.crc32(f.read())
        old = self.committed()
        if old is not None and old.manifest_crc32 != crc:
            # A new save under a committed prefix replaces it, as on a local disk.
            logger.info("%s: replacing committed checkpoint %s", self.store.url, self.name)
            self._call(lambda: protocol.delete_checkpoint(self.store, old),
                       f"delete {self.name}")
        self.tiers.after_commit(self.name)

    def record_latest(self, path: str, stats: SaveStats, *, fsync: bool,
                      local: Callable[..., None]) -> None:
        """``save()``'s state file: in the scratch directory and in the bucket.

        Runs after the commit (the marker is written), so the state file in
        the bucket only ever names a committed checkpoint.
        """
        del path
        local(self.local_prefix, stats, fsync=fsync)
        with open(os.path.join(os.path.dirname(self.local_prefix), STATE_FILE), "rb") as f:
            text = f.read()
        self._call(lambda: self.store.put(STATE_FILE, text), f"upload {STATE_FILE}")

    def fetch(self, *, checksums: bool,
              verify_local: Callable[[str], object]) -> str:
        """Makes the committed checkpoint readable locally; returns its local prefix.

        Raises:
            CheckpointNotFoundError: nothing is committed under this URL.
            CorruptCheckpointError: the remote copy fails verification.
        """
        remote = self.committed()
        if remote is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {self.url!r} (no commit marker "
                f"{self.name + protocol.TF_MARKER_SUFFIX!r} in {self.store.url!r})")
        manifest = layout.tf_manifest_path(self.local_prefix)
        try:
            with open(manifest, "rb") as f:
                same = zlib.crc32(f.read()) == remote.manifest_crc32
        except FileNotFoundError:
            same = False
        if same and os.path.exists(self.local_prefix + layout.TF_INDEX_SUFFIX):
            verify_local(self.local_prefix)  # the scratch copy this Checkpoint wrote or read
            return self.local_prefix
        assert self.tiers.remote is not None
        self.tiers.remote.download(remote, self.tiers.local_dir, checksums=checksums)
        return self.local_prefix


class AtURL:
    """A commit callback that reports the URL prefix instead of the scratch path."""

    def __init__(self, callback: Callable[[str, SaveStats], None], url: str):
        self.callback = callback
        self.url = url

    def __call__(self, path: str, stats: SaveStats) -> None:
        del path
        self.callback(self.url, stats)


class URLDirectories:
    """One Checkpoint's URL directories: a scratch directory and a remote tier each.

    Args:
        options: Retries and parallelism of the uploads and downloads.

    Raises:
        ValueError: ``options.max_to_keep`` is set (``url_directory_options``).
    """

    def __init__(self, options: RemoteOptions | None = None):
        self.options = url_directory_options(options)
        self._dirs: dict[str, TieredDirectory] = {}
        self._lock = threading.Lock()

    def target(self, prefix: str) -> URLTarget | None:
        """The staging target of ``prefix``; None for a local path.

        Raises:
            UnsupportedURLError: ``prefix`` is a URL of another scheme, or a
                malformed one, or names no checkpoint inside the bucket.
        """
        if not is_url(prefix):
            return None
        loc = parse_location(prefix)
        if not loc.prefix:
            raise UnsupportedURLError(
                f"{prefix!r} names a bucket, not a checkpoint prefix (such as "
                f"{loc.scheme}://{loc.bucket}/run/ckpt)")
        directory, _, name = loc.url.rpartition("/")
        with self._lock:
            tiers = self._dirs.get(directory)
            if tiers is None:
                scratch = tempfile.mkdtemp(prefix="asyncckpt-tf-scratch-")
                try:
                    tiers = TieredDirectory(directory, remote_options=self.options,
                                            scratch_dir=scratch)
                except BaseException:
                    shutil.rmtree(scratch, ignore_errors=True)
                    raise
                # Removed by close(), or when the process exits without one.
                weakref.finalize(tiers, shutil.rmtree, scratch, ignore_errors=True)
                commit_lib.ensure_writable_dir(scratch)
                self._dirs[directory] = tiers
        return URLTarget(url=loc.url, name=name, tiers=tiers,
                         local_prefix=os.path.join(tiers.local_dir, name))

    def close(self, timeout: float | None = None) -> None:
        """Closes the remote tiers and removes the scratch directories."""
        with self._lock:
            dirs, self._dirs = list(self._dirs.values()), {}
        errors = []
        for tiers in dirs:
            try:
                tiers.close(timeout)
            except BaseException as e:
                errors.append(e)
            finally:
                shutil.rmtree(tiers.local_dir, ignore_errors=True)
        if errors:
            raise errors[0]


def latest_checkpoint(checkpoint_dir: str, latest_filename: str | None = None) -> str | None:
    """``tf.train.latest_checkpoint`` for local directories and ``s3://`` / ``gs://`` URLs.

    For a URL: the checkpoint the bucket's ``checkpoint`` state file names
    (written by ``Checkpoint.save`` after each commit) if it is committed,
    otherwise the committed checkpoint with the highest save number; None if
    nothing is committed there.
    """
    if not is_url(checkpoint_dir):
        # TensorFlow's, but a damaged state file is rebuilt from the committed checkpoints.
        return _statefile.latest_checkpoint(os.fspath(checkpoint_dir), latest_filename)
    from asyncckpt.storage.stores import open_store

    loc = parse_location(checkpoint_dir)
    store = open_store(loc)
    try:
        committed = protocol.list_committed(store)
        names = {c.name for c in committed if c.framework == "tensorflow"}
        try:
            text = store.get(latest_filename or STATE_FILE).decode("utf-8", "replace")
        except FileNotFoundError:
            text = ""
        named = _state_file_latest(text)
        if named is not None and named in names:
            return f"{loc.url}/{named}"
        ordered = [c for c in committed if c.framework == "tensorflow" and c.step is not None]
        return f"{loc.url}/{ordered[-1].name}" if ordered else None
    finally:
        store.close()


def _state_file_latest(text: str) -> str | None:
    """The checkpoint a ``checkpoint`` state file names, relative to its directory."""
    state = parse_state_file(text)
    return None if state is None else _base_name(state.model_checkpoint_path)


def _base_name(path: str) -> str | None:
    return path.rstrip("/").rsplit("/", 1)[-1] or None


def parse_state_file(text: str):
    """A bucket's ``checkpoint`` state file (TensorFlow's ``CheckpointState``), or None.

    None for an empty text (no state file) and, with a warning, for an
    unreadable one.
    """
    if not text:
        return None
    from asyncckpt.tf._compat import parse_checkpoint_state

    try:
        return parse_checkpoint_state(text)
    except ValueError as e:
        logger.warning("ignoring an unreadable checkpoint state file: %s", e)
        return None


@dataclass(frozen=True)
class BucketState:
    """What a manager's state file in a URL directory says (names relative to it).

    Attributes:
        managed: The checkpoints the manager managed, ``(name, timestamp)``,
            oldest first (those retention preserved are not among them).
        last_preserved: The ``keep_checkpoint_every_n_hours`` clock.
    """

    managed: list[tuple[str, float | None]]
    last_preserved: float


class StateFileInBucket:
    """A URL directory manager's ``checkpoint`` state file, kept in the bucket too.

    The manager writes its state file in its scratch directory after each
    durable save, as TensorFlow's manager does in its directory; uploaded
    beside the checkpoints, it tells a manager made in a new process which
    checkpoints are managed and when the last one was preserved, so what
    ``keep_checkpoint_every_n_hours`` preserved stays preserved across restarts.
    """

    def __init__(self, tiers: TieredDirectory):
        assert tiers.remote is not None
        self._remote = tiers.remote

    def _call(self, fn, what: str):
        return retry_call(fn, what=f"{what} ({self._remote.url})",
                          policy=self._remote.options.retry)

    def read(self) -> BucketState | None:
        """The state file in the bucket, or None if there is none (or it is unreadable)."""
        try:
            text = self._call(lambda: self._remote.store.get(STATE_FILE), f"read {STATE_FILE}")
        except FileNotFoundError:
            return None
        state = parse_state_file(text.decode("utf-8", "replace"))
        if state is None:
            return None
        names = [_base_name(p) for p in state.all_model_checkpoint_paths]
        stamps = list(state.all_model_checkpoint_timestamps) or [None] * len(names)
        return BucketState(
            managed=[(n, t) for n, t in zip(names, stamps, strict=False) if n is not None],
            last_preserved=state.last_preserved_timestamp)

    def upload(self, text: str) -> None:
        """Writer thread, after the local state file is written: the same text in the bucket."""
        data = text.encode("utf-8")
        self._call(lambda: self._remote.store.put(STATE_FILE, data), f"upload {STATE_FILE}")
