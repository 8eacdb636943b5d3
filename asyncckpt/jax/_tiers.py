"""The JAX manager's storage tiers: a local directory, and optionally a remote one.

A thin layer over ``asyncckpt.storage.tier.TieredDirectory`` that speaks in
steps: it names them as the manager does (orbax's prefixed or fixed-length
names too) and gives the manager the few hooks it calls: list, upload after
the publish, fetch before a restore, wait, close, and, for several processes
saving into a URL directory, the shard uploader of each save
(``asyncckpt.storage.shards``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncckpt.jax._options import ManagerConfig, StepNames
from asyncckpt.storage.lazy import LazyStep
from asyncckpt.storage.shards import ShardUploader
from asyncckpt.storage.tier import RemoteOptions, TieredDirectory, register_owner

if TYPE_CHECKING:
    from asyncckpt.jax._distributed import CommitCoordinator


class StepTiers:
    """Where a JAX manager's steps live.

    Args:
        directory: The manager's directory: a path, or an ``s3://`` /
            ``gs://`` URL (then saves stage in a local scratch directory).
        remote: A second, persistent tier for a local ``directory``.
        remote_options: Schedule, retention and retries of the remote tier
            (default: every step, the manager's ``max_to_keep``). A URL
            directory has no retention of its own: the manager's decides
            (``delete``), and ``RemoteOptions.max_to_keep`` is refused.
        config: The manager's options (step names, as orbax's: the remote
            tier keeps them, ``ckpt_000012/``; ``max_to_keep``).
        owner: The manager (``storage.tier.tiers_of(manager)`` finds the tiers).
    """

    def __init__(self, directory: str | os.PathLike, *, remote: str | None,
                 remote_options: RemoteOptions | None, config: ManagerConfig, owner: object):
        self._names = config.names
        self._shards: ShardUploader | None = None
        if remote_options is None and remote is not None:  # two tiers: the manager's count
            remote_options = RemoteOptions(max_to_keep=config.max_to_keep or None)
        self._dir = TieredDirectory(directory, remote=remote, remote_options=remote_options)
        register_owner(owner, self._dir)  # the preemption handler's final upload uses them

    @property
    def local_dir(self) -> str:
        """The local directory the engine writes into."""
        return self._dir.local_dir

    @property
    def shown_dir(self) -> str:
        """The directory the manager reports: the URL of a URL directory, else the local one."""
        return self._dir.display if self._dir.remote_only else self._dir.local_dir

    def shown_step_dir(self, step: int, local: str) -> str:
        """Where the manager says ``step`` is: under the URL for a URL directory."""
        return f"{self._dir.display}/{self._names.name(step)}" if self._dir.remote_only else local

    @property
    def has_remote(self) -> bool:
        return self._dir.remote is not None

    @property
    def remote_only(self) -> bool:
        """A URL directory: every step is committed in the bucket, which the manager's
        retention keeps (its steps there are the manager's to list and delete)."""
        return self._dir.remote_only

    def remote_steps(self, *, fresh: bool = False) -> frozenset[int]:
        """The steps committed in the remote tier (its cached listing unless ``fresh``)."""
        if not self.has_remote:
            return frozenset()
        parsed = (self._names.parse(n) for n in self._dir.remote_names(fresh=fresh))
        return frozenset(s for s in parsed if s is not None)

    def delete(self, step: int) -> None:
        """URL directory: deletes ``step`` in the bucket (in the background; ``wait``)."""
        self._dir.delete_remote(self._names.name(step))

    def multiprocess(self, coordinator: CommitCoordinator | None) -> ShardUploader | None:
        """Sets up several processes' saves; returns the job's shard uploader, if any.

        * A URL directory: every process stages its own shards in its own
          scratch directory and uploads them; the primary checks every
          process's objects before it commits (``asyncckpt.storage.shards``).
          Returned for the save jobs.
        * A local directory with a remote tier: the local directory is the
          multi-process checkpoint (it must be shared, as without a remote);
          the primary uploads each committed step from it in the background,
          like a single process; the other processes list the bucket each
          time they list steps. Returns None.
        """
        if coordinator is None or self._dir.remote is None:
            return None
        if not self._dir.remote_only:
            # Process 0 uploads: the others list the bucket to see its commits
            # (on every listing, as orbax lists its directory).
            self._dir.remote.cache_listing = coordinator.primary
            return None
        assert self._dir.remote is not None
        self._shards = ShardUploader(self._dir.remote, process_index=coordinator.process_index)
        return self._shards

    def steps(self, local: list[int], *, fresh: bool = False) -> list[int]:
        """``local`` steps plus those only the remote tier has, oldest first.

        ``fresh``: list the remote tier now (a restore), not its cached listing
        (which a process that never commits does not refresh).
        """
        if not self.has_remote:
            return local
        return sorted({*local, *self.remote_steps(fresh=fresh)})

    def on_published(self) -> Callable[[int], None] | None:
        """The job's hook run right after a local publish, or None without a remote."""
        if not self.has_remote:
            return None
        return functools.partial(_hand_over, self._dir, self._names,
                                 data_uploaded=self._shards is not None)

    def open_remote(self, step: int, *, checksums: bool) -> LazyStep | None:
        """``step`` opened for reading from the remote tier, fetched only as read.

        None when there is no remote tier or the local tier has the step (read
        it there); see ``TieredDirectory.open_remote``.
        """
        if not self.has_remote:
            return None
        return self._dir.open_remote(self._names.name(step), checksums=checksums)

    def raise_pending_error(self) -> None:
        """Re-raises a failed background upload (two tiers)."""
        self._dir.raise_pending_error()

    def wait_until_finished(self, timeout: float | None = None) -> None:
        self._dir.wait_until_finished(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._dir.close(timeout)


def _hand_over(tiers: TieredDirectory, names: StepNames, step: int, *,
               data_uploaded: bool) -> None:
    # Writer thread, right after the local publish: a URL directory uploads
    # here (the save is durable only once committed remotely; with several
    # processes only the manifest and markers are left, each process having
    # uploaded its own files); two tiers hand the step to the background uploader.
    tiers.after_commit(names.name(step), data_uploaded=data_uploaded)
