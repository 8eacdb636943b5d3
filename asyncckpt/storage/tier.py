"""The remote tier: locally committed checkpoints uploaded in the background.

``RemoteTier`` owns one store and one low-priority uploader thread. The
managers hand it a checkpoint right after its local commit; it pins the files
(hard links in a temporary directory, so local retention may delete the
checkpoint meanwhile), uploads and commits them with ``protocol``, then
applies the remote retention (only after the newer step is committed) and
removes what interrupted uploads left. At most one upload runs and one waits;
a newer checkpoint replaces a waiting one. A failure is kept and re-raised on
the next ``submit``/``wait``/``close`` call; the local tier is never touched.

Retention in the bucket: in two-tier mode the remote tier keeps its own
``RemoteOptions.max_to_keep`` newest checkpoints, decided by
``engine.retention.apply`` as every retention in asyncckpt. A URL directory
has no retention of its own: its manager's retention (``max_to_keep``,
``keep_period``, ``best_fn``, ``keep_checkpoint_every_n_hours``, orbax's
preservation policies) decides, and ``TieredDirectory.delete_remote`` deletes
what it drops.

``TieredDirectory`` is what a manager holds: given its ``directory`` (a path
or a URL) and an optional remote URL, it says where the manager writes locally
(a scratch directory when the directory is a URL) and hides the remote tier
behind four calls: ``after_commit``, ``names``, ``ensure_local`` and ``close``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

from asyncckpt import _deprecation, catalog
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine import retention
from asyncckpt._engine.manifest import read_manifest
from asyncckpt._threads import lower_thread_priority
from asyncckpt.errors import CheckpointNotFoundError, EngineClosedError
from asyncckpt.storage import protocol
from asyncckpt.storage.base import RetryPolicy
from asyncckpt.storage.lazy import LazyStep
from asyncckpt.storage.stores import open_store
from asyncckpt.storage.url import parse_location

logger = logging.getLogger(__name__)


@_deprecation.renamed_fields(every_seconds="every_s")
@dataclass(frozen=True, kw_only=True)
class RemoteOptions:
    """How and when checkpoints reach the remote tier.

    Attributes:
        every_n_steps: Upload checkpoints whose step is a multiple of this
            (two-tier mode; a URL directory uploads every save).
        every_s: Also upload when this many seconds have passed since the
            last upload was handed over (None: steps only). Spelled
            ``every_seconds`` until asyncckpt 0.2 (deprecated).
        max_to_keep: Remote checkpoints to keep in two-tier mode (None keeps
            all); one is deleted only after a newer one is committed. Not
            for a URL directory, whose manager's retention decides.
        retry: Backoff and deadline for each object.
        concurrency: Files uploaded or downloaded at once.
        part_size: Multipart part size in bytes.
        nice: Niceness added to the uploader thread (Linux).
    """

    every_n_steps: int = 1
    every_s: float | None = None
    max_to_keep: int | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    concurrency: int = 4
    part_size: int = 16 << 20
    nice: int = 10

    def __post_init__(self) -> None:
        if self.every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {self.every_n_steps}")
        retention.check_max_to_keep(self.max_to_keep, allow_zero=False)


def url_directory_options(options: RemoteOptions | None) -> RemoteOptions:
    """The options of a URL directory's tier (retries, parallelism), checked.

    Raises:
        ValueError: ``options.max_to_keep`` is set: what a URL directory keeps
            is its manager's retention, given to the manager.
    """
    if options is None:
        return RemoteOptions()
    if options.max_to_keep is not None:
        raise ValueError(
            "RemoteOptions.max_to_keep applies to a remote tier beside a local directory; "
            "an s3:// / gs:// directory keeps what its manager's retention keeps: give "
            "max_to_keep (keep_period, ...) to the manager instead")
    return options


def _kept_by_count(listing: list[protocol.RemoteCheckpoint], keep: int | None,
                   newest: str | None = None) -> tuple[list[protocol.RemoteCheckpoint],
                                                       list[protocol.RemoteCheckpoint]]:
    """The remote tier's retention over ``listing`` (oldest first): ``(kept, dropped)``.

    ``newest``: the checkpoint just committed, never dropped (even where the
    listing has newer ones, committed by another process).
    """
    decision = retention.apply(
        [retention.Candidate(c.name, c.step, c.committed) for c in listing],
        retention.RetentionPolicy(max_to_keep=keep))
    dropped = {c.key for c in decision.delete if c.key != newest}
    return ([c for c in listing if c.name not in dropped],
            [c for c in listing if c.name in dropped])


def _pin(info: catalog.CheckpointInfo, directory: str) -> tuple[catalog.CheckpointInfo, str]:
    """Hard-links a checkpoint's files into a temporary directory (copies across devices)."""
    pin = os.path.join(directory, f"{commit_lib.TEMP_PREFIX}upload-{info.name}-"
                                  f"{uuid.uuid4().hex[:8]}")
    manifest = read_manifest(info.manifest_path)
    jax = info.is_directory
    root = os.path.join(pin, info.name) if jax else pin
    names = [f.name for f in manifest.files] + [os.path.relpath(info.manifest_path, info.root)]
    for name in names:
        src = os.path.join(info.root, *name.split("/"))
        dst = os.path.join(root, *name.split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    pinned = catalog.CheckpointInfo(
        name=info.name,
        path=root if jax else os.path.join(pin, info.name),
        framework=info.framework,
        step=info.step,
        manifest_path=os.path.join(root, os.path.relpath(info.manifest_path, info.root)),
    )
    return pinned, pin


class RemoteTier:
    """Uploads committed checkpoints to one store, in the background.

    Args:
        url: ``s3://``, ``gs://`` or a local directory.
        options: Schedule, retention, retries.
    """

    def __init__(self, url: str, *, options: RemoteOptions | None = None):
        self.options = options or RemoteOptions()
        self.location = parse_location(url)
        self.store = open_store(self.location, part_size=self.options.part_size)
        self._cv = threading.Condition()
        self._pending: tuple[catalog.CheckpointInfo, str | None, Future] | None = None
        self._busy = False
        self._current: tuple[str, float] | None = None  # (name, monotonic start) uploading
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_handed = float("-inf")
        self._started_wall = time.time()
        self.stats: list[dict] = []  # per upload: name, nbytes, seconds
        # The committed listing as of the last upload (or listing): what save() consults, so
        # a save never waits on the network (None: not listed yet).
        self._listing: list[protocol.RemoteCheckpoint] | None = None
        # False where another process uploads (it would never see their commits).
        self.cache_listing = True
        # Retention after an upload made on the caller's (writer) thread runs here.
        self._retainer: ThreadPoolExecutor | None = None
        self._retentions: list[Future] = []
        # Names ``delete`` was given whose objects are not gone yet: never listed.
        self._deleting: set[str] = set()

    @property
    def url(self) -> str:
        return self.store.url

    # -- errors -----------------------------------------------------------------

    def raise_pending_error(self) -> None:
        """Re-raises a background upload failure once."""
        with self._cv:
            error, self._error = self._error, None
        if error is not None:
            raise error

    # -- scheduling ----------------------------------------------------------------

    def due(self, step: int | None) -> bool:
        """Whether a checkpoint of ``step`` is to be uploaded now."""
        if step is not None and step % self.options.every_n_steps == 0:
            return True
        every = self.options.every_s
        return every is not None and time.monotonic() - self._last_handed >= every

    def submit(self, info: catalog.CheckpointInfo, *, force: bool = False,
               raise_errors: bool = True) -> Future | None:
        """Hands a locally committed checkpoint to the uploader; returns at once.

        Returns:
            A future resolving to the ``RemoteCheckpoint`` once the remote
            marker is written, or None if the schedule skips this one. A
            waiting upload replaced by a newer one is cancelled.

        Args:
            info: The locally committed checkpoint.
            force: Upload it even if the schedule would skip it.
            raise_errors: Re-raise an earlier upload's failure here; the
                writer thread passes False, so the failure stays pending for
                the training thread's next call instead of being logged away.

        Raises:
            Exception: an earlier background upload's failure.
        """
        if raise_errors:
            self.raise_pending_error()
        if not force and not self.due(info.step):
            return None
        if self._closed:
            raise EngineClosedError(f"{self.url}: remote tier is closed")
        pinned, pin = _pin(info, os.path.dirname(info.root) if info.is_directory
                           else info.root)
        future: Future = Future()
        with self._cv:
            replaced = self._pending
            self._pending = (pinned, pin, future)
            self._last_handed = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="asyncckpt-uploader")
                self._thread.start()
            self._cv.notify_all()
        if replaced is not None:
            replaced[2].cancel()
            if replaced[1] is not None:
                shutil.rmtree(replaced[1], ignore_errors=True)
            logger.info("upload of %s skipped: %s is newer", replaced[0].name, info.name)
        return future

    def upload_now(self, info: catalog.CheckpointInfo, *, data_uploaded: bool = False
                   ) -> protocol.RemoteCheckpoint:
        """Uploads and commits in the calling thread (a URL directory's writer thread).

        ``data_uploaded``: the data files are in the store already (a
        multi-process save, see ``protocol.upload_checkpoint``).
        """
        self.raise_pending_error()
        return self._upload_and_retain(info, data_uploaded=data_uploaded, background=True)

    def _run(self) -> None:
        lower_thread_priority(self.options.nice)
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                info, pin, future = self._pending
                self._pending = None
                self._busy = True
                self._current = (info.name, time.monotonic())
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(self._upload_and_retain(info))
                    except BaseException as e:
                        logger.error("upload of %s to %s failed: %s", info.name, self.url, e)
                        with self._cv:
                            self._error = e
                        future.set_exception(e)
            finally:
                if pin is not None:
                    shutil.rmtree(pin, ignore_errors=True)
                with self._cv:
                    self._busy = False
                    self._current = None
                    self._cv.notify_all()

    def _upload_and_retain(self, info: catalog.CheckpointInfo, *, data_uploaded: bool = False,
                           background: bool = False) -> protocol.RemoteCheckpoint:
        """Uploads and commits ``info``, then applies the remote retention.

        ``background``: the retention's deletions run on the retention thread
        (the caller is the writer thread, whose next job is the next save);
        the steps it will delete leave the cached listing at once.
        """
        t0 = time.monotonic()
        remote = protocol.upload_checkpoint(
            self.store, info, retry=self.options.retry, concurrency=self.options.concurrency,
            data_uploaded=data_uploaded)
        entry = {"name": info.name, "nbytes": remote.nbytes, "seconds": time.monotonic() - t0}
        self.stats.append(entry)
        with self._cv:
            if self._listing is not None:
                self._listing = _sorted_listing(
                    [c for c in self._listing if c.name != remote.name] + [remote])
        if background:
            self._retain_in_background(remote)
            entry["total_seconds"] = time.monotonic() - t0
            return remote
        self._retain_logged(remote)
        entry["total_seconds"] = time.monotonic() - t0  # retention included
        return remote

    def _retain_logged(self, remote: protocol.RemoteCheckpoint) -> None:
        try:
            self._retain(remote)
        except Exception as e:  # retention is housekeeping: the new step is committed
            logger.warning("%s: remote retention after %s failed: %s", self.url, remote.name, e)

    def _retain_in_background(self, remote: protocol.RemoteCheckpoint) -> None:
        with self._cv:
            if self._listing is not None:
                self._listing = _kept_by_count(self._listing, self.options.max_to_keep,
                                               remote.name)[0]
        self._in_background(self._retain_logged, remote)

    def _in_background(self, fn, *args) -> None:
        """Runs ``fn(*args)`` on the retention thread (``wait`` waits for it)."""
        with self._cv:
            if self._retainer is None:
                self._retainer = ThreadPoolExecutor(
                    1, thread_name_prefix="asyncckpt-retention",
                    initializer=lower_thread_priority, initargs=(self.options.nice,))
            try:
                future = self._retainer.submit(fn, *args)
            except RuntimeError:  # closed, or the interpreter is shutting down
                future = None
            else:
                self._retentions = [f for f in self._retentions if not f.done()] + [future]
        if future is None:
            fn(*args)

    def delete(self, name: str) -> None:
        """Deletes committed checkpoint ``name`` (a URL directory's manager's retention).

        It leaves the cached listing at once; the objects are deleted on the
        retention thread (``wait`` waits for it). A failure is logged: the
        checkpoint shows up again in the next listing, for the next retention.
        """
        with self._cv:
            listed = [c for c in self._listing or () if c.name == name]
            self._deleting.add(name)
            if self._listing is not None:
                self._listing = [c for c in self._listing if c.name != name]
        self._in_background(self._delete_logged, name, listed)

    def _delete_logged(self, name: str, listed: list[protocol.RemoteCheckpoint]) -> None:
        try:
            if not listed:
                listed = [c for c in protocol.list_committed(
                    self.store, objects=self.store.list(name)) if c.name == name]
            for old in listed:
                protocol.delete_checkpoint(self.store, old)
                logger.info("%s: retention deleted %s", self.url, name)
        except Exception as e:  # housekeeping: the save that dropped it is committed
            logger.warning("%s: could not delete %s (retried at a later save): %s",
                           self.url, name, e)
        finally:
            with self._cv:
                self._deleting.discard(name)

    def _retain(self, newest: protocol.RemoteCheckpoint) -> None:
        objects = self.store.list()
        committed = protocol.list_committed(self.store, objects=objects)
        kept, dropped = _kept_by_count(committed, self.options.max_to_keep, newest.name)
        for old in dropped:
            protocol.delete_checkpoint(self.store, old)
            logger.info("%s: remote retention deleted %s", self.url, old.name)
        with self._cv:
            self._listing = [c for c in kept if c.name not in self._deleting]
        if newest.step is not None:
            protocol.delete_uncommitted(self.store, older_than_step=newest.step, objects=objects)
        self.store.abort_incomplete_uploads(older_than_s=max(0.0, time.time() -
                                                             self._started_wall))

    @property
    def uploader_thread_id(self) -> int | None:
        """The uploader thread's native id (None before the first upload)."""
        thread = self._thread
        return None if thread is None else thread.native_id

    def in_flight(self) -> tuple[tuple[str, float] | None, str | None]:
        """What the uploader holds: ``((name, seconds it has run) | None, waiting name | None)``."""
        with self._cv:
            running = (None if self._current is None
                       else (self._current[0], time.monotonic() - self._current[1]))
            waiting = None if self._pending is None else self._pending[0].name
        return running, waiting

    # -- reading -------------------------------------------------------------------

    def committed(self, *, cached: bool = False) -> list[protocol.RemoteCheckpoint]:
        """Committed remote checkpoints, oldest first.

        Args:
            cached: Return the listing as of this tier's last upload (listing
                once if there is none yet) instead of asking the store: a
                manager's ``save()`` consults it, and must not wait on the
                network. Checkpoints other processes commit meanwhile show up
                after the next upload.
        """
        if cached and self.cache_listing:
            with self._cv:
                if self._listing is not None:
                    return list(self._listing)
        # What the retention drops is being deleted in the background (by this
        # process's tier, or by the one that committed the newest): not listed.
        found = _kept_by_count(protocol.list_committed(self.store), self.options.max_to_keep)[0]
        with self._cv:
            found = [c for c in found if c.name not in self._deleting]
            self._listing = list(found)
        return found

    def download(self, remote: protocol.RemoteCheckpoint, directory: str, *,
                 checksums: bool = True) -> None:
        """Downloads one committed checkpoint into a local manager directory."""
        protocol.download_checkpoint(self.store, remote, directory, retry=self.options.retry,
                                     concurrency=self.options.concurrency, checksums=checksums)

    # -- lifecycle -----------------------------------------------------------------

    def wait_until_finished(self, timeout: float | None = None, *,
                            raise_errors: bool = True) -> None:
        """Waits until nothing is uploading or waiting; re-raises a failure.

        ``raise_errors=False`` leaves a failure pending for the next call.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"uploads to {self.url} still running after {timeout} s")
                self._cv.wait(left)
            retentions = list(self._retentions)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if retentions and futures_wait(retentions, left).not_done:
            raise TimeoutError(f"retention in {self.url} still running after {timeout} s")
        if raise_errors:
            self.raise_pending_error()

    wait = _deprecation.renamed_method("wait_until_finished", "wait", "RemoteTier")

    def close(self, timeout: float | None = None) -> None:
        """Finishes the uploads in flight, stops the uploader, re-raises a failure."""
        try:
            self.wait_until_finished(timeout)
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            if self._thread is not None:
                self._thread.join(timeout)
            if self._retainer is not None:
                self._retainer.shutdown(wait=True)
            self.store.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TieredDirectory:
    """A manager's checkpoint directory: a local tier, and optionally a remote one.

    * ``directory`` a local path, ``remote`` None: local only (no change).
    * ``directory`` a URL: saves are written to a local scratch directory and
      committed to the URL by the writer thread before the save counts as
      durable (``after_commit`` raises if the upload fails). The manager's
      retention decides what the bucket keeps (``delete_remote``).
    * ``directory`` a local path and ``remote`` a URL: two tiers; every save
      commits locally, and ``RemoteOptions.every_n_steps`` (or seconds) of
      them are uploaded in the background.

    Args:
        directory: Path or ``s3://`` / ``gs://`` URL given to the manager.
        remote: Second, persistent tier (two-tier mode).
        remote_options: Schedule, retention and retries of the remote tier
            (a URL directory: retries and parallelism only, see
            ``url_directory_options``).
        scratch_dir: URL directory only: where saves are staged (default: a
            new temporary directory, removed at ``close``).
    """

    def __init__(self, directory: str | os.PathLike, *, remote: str | None = None,
                 remote_options: RemoteOptions | None = None, scratch_dir: str | None = None):
        loc = parse_location(directory)
        self._own_scratch: str | None = None
        if loc.is_remote:
            if remote is not None:
                raise ValueError("give a remote tier only with a local directory "
                                 f"(the directory {loc.url} is remote already)")
            remote_options = url_directory_options(remote_options)
            if scratch_dir is None:
                scratch_dir = self._own_scratch = tempfile.mkdtemp(prefix="asyncckpt-scratch-")
            self.local_dir = os.path.abspath(scratch_dir)
            self.remote: RemoteTier | None = RemoteTier(loc.url, options=remote_options)
            self.remote_only = True
        else:
            self.local_dir = loc.prefix
            self.remote = None if remote is None else RemoteTier(remote, options=remote_options)
            self.remote_only = False
        self.display = loc.url
        self._fetch_dir: str | None = None  # private cache of partly fetched remote steps
        self._lazy: dict[str, LazyStep] = {}
        self._lazy_lock = threading.Lock()

    def after_commit(self, name: str, *, data_uploaded: bool = False) -> None:
        """Writer thread, right after a local commit of checkpoint ``name``.

        ``data_uploaded`` (URL directory, several processes): every process
        has uploaded its own files and the primary has checked them; the local
        checkpoint holds only this process's files, so it is removed once
        committed remotely (a restore downloads the whole step).
        """
        if self.remote is None:
            return
        info = protocol.local_info(self.local_dir, name)
        if not self.remote_only:
            self.remote.submit(info, raise_errors=False)
            return
        try:
            self.remote.upload_now(info, data_uploaded=data_uploaded)
        except BaseException:
            # Durable means committed remotely: a save that never got there is
            # not listed, and fails (the caller runs this as part of the commit).
            _discard_local(info)
            raise
        if data_uploaded:
            _discard_local(info)  # partial: never to be mistaken for a local copy

    def delete_remote(self, name: str) -> None:
        """URL directory: deletes checkpoint ``name``, which its manager's retention dropped.

        Returns at once (see ``RemoteTier.delete``); ``wait`` waits for it.
        Without a URL directory there is nothing to do: the remote tier of
        two-tier mode keeps its own ``max_to_keep``.
        """
        if self.remote_only and self.remote is not None:
            self.remote.delete(name)

    def after_step(self, step: int) -> None:
        """``after_commit`` for a checkpoint named by its step (the JAX layout)."""
        self.after_commit(str(step))

    def remote_names(self, *, fresh: bool = False) -> list[str]:
        """Names of the committed remote checkpoints, oldest first ([] without a remote).

        ``fresh``: list the store now (a restore) instead of the cached listing.
        """
        return [c.name for c in self.remote_checkpoints(fresh=fresh)]

    def remote_checkpoints(self, *, fresh: bool = False) -> list[protocol.RemoteCheckpoint]:
        """The committed remote checkpoints, oldest first ([] without a remote).

        ``fresh``: list the store now (a restore) instead of the cached listing.
        """
        if self.remote is None:
            return []
        try:
            return self.remote.committed(cached=not fresh)
        except Exception as e:  # the local tier stays usable while the remote is unreachable
            logger.warning("cannot list %s: %s", self.remote.url, e)
            return []

    def ensure_local(self, name: str, *, checksums: bool = True) -> None:
        """Downloads checkpoint ``name`` from the remote tier unless it is here already.

        Raises:
            CheckpointNotFoundError: neither tier has it.
            CorruptCheckpointError: the remote copy fails verification.
        """
        if any(c.name == name for c in _list_local(self.local_dir)):
            return
        if self.remote is not None:
            for c in self.remote.committed():
                if c.name == name:
                    self.remote.download(c, self.local_dir, checksums=checksums)
                    return
        raise CheckpointNotFoundError(f"no checkpoint {name!r} in {self.display!r}")

    def open_remote(self, name: str, *, checksums: bool = True) -> LazyStep | None:
        """Opens directory checkpoint ``name`` for reading from the remote tier, file by file.

        Returns None when the local tier has it (read it there). Otherwise a
        ``LazyStep`` in a private cache directory (never the manager's
        directory: a partly fetched step must not pass for a local one),
        holding its manifest and metadata files; the reader fetches the rest
        it needs with ``LazyStep.fetch``. The step stays cached (what was
        fetched is reused by the next restore of it) until another step is
        opened or ``close``.

        Raises:
            CheckpointNotFoundError: neither tier has it.
            CorruptCheckpointError: its manifest or metadata fail verification.
        """
        if any(c.name == name for c in _list_local(self.local_dir)):
            return None
        remote = None if self.remote is None else next(
            (c for c in self.remote.committed() if c.name == name), None)
        if remote is None:
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {self.display!r}")
        assert self.remote is not None
        with self._lazy_lock:
            cached = self._lazy.get(name)
            if cached is not None and cached.remote == remote:
                return cached
            for old in self._lazy.values():
                shutil.rmtree(old.path, ignore_errors=True)
            self._lazy.clear()
            if self._fetch_dir is None:
                self._fetch_dir = tempfile.mkdtemp(prefix="asyncckpt-fetch-")
            path = os.path.join(self._fetch_dir, f"{name}-{uuid.uuid4().hex[:8]}")
            try:
                lazy = LazyStep(self.remote.store, remote, path, retry=self.remote.options.retry,
                                concurrency=self.remote.options.concurrency,
                                checksums=checksums)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            self._lazy[name] = lazy
            return lazy

    def raise_pending_error(self) -> None:
        if self.remote is not None:
            self.remote.raise_pending_error()

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Waits until the remote tier's uploads are done; re-raises a failure."""
        if self.remote is not None:
            self.remote.wait_until_finished(timeout)

    wait = _deprecation.renamed_method("wait_until_finished", "wait", "TieredDirectory")

    def close(self, timeout: float | None = None) -> None:
        try:
            if self.remote is not None:
                self.remote.close(timeout)
        finally:
            if self._own_scratch is not None:
                shutil.rmtree(self._own_scratch, ignore_errors=True)
            with self._lazy_lock:
                self._lazy.clear()
                if self._fetch_dir is not None:
                    shutil.rmtree(self._fetch_dir, ignore_errors=True)
                    self._fetch_dir = None


# The TieredDirectory of each manager that holds one (the preemption handler asks for it).
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_owner(owner: object, tiers: TieredDirectory) -> None:
    """Records that ``owner`` (a manager) keeps its checkpoints in ``tiers``."""
    _OWNERS[owner] = tiers


def tiers_of(owner: object) -> TieredDirectory | None:
    """The ``TieredDirectory`` ``owner`` registered, or None."""
    try:
        return _OWNERS.get(owner)
    except TypeError:  # not weakly referenceable: never registered
        return None


def _sorted_listing(found: list[protocol.RemoteCheckpoint]) -> list[protocol.RemoteCheckpoint]:
    return sorted(found, key=lambda c: (c.step if c.step is not None else -1, c.name))


def _discard_local(info: catalog.CheckpointInfo) -> None:
    """Removes a local checkpoint, its commit file first (JAX: the directory, renamed away)."""
    if info.is_directory:
        doomed = os.path.join(os.path.dirname(info.path), f"{commit_lib.TEMP_PREFIX}discard-"
                                                          f"{info.name}-{uuid.uuid4().hex[:8]}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(info.path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        return
    manifest = read_manifest(info.manifest_path)
    names = [info.name + ".index"] + [f.name for f in manifest.files] + [
        os.path.basename(info.manifest_path)]
    for n in dict.fromkeys(names):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(info.root, n))


def _list_local(directory: str) -> list[catalog.CheckpointInfo]:
    with contextlib.suppress(CheckpointNotFoundError):
        return catalog.list_checkpoints(directory)
    return []


__all__ = ["RemoteOptions", "RemoteTier", "TieredDirectory", "register_owner", "tiers_of"]
