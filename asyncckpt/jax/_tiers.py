"""The JAX manager's storage tiers: a local directory, and optionally a remote one.

A thin layer over ``asyncckpt.storage.tier.TieredDirectory`` that speaks in
steps: it names them as the manager does, refuses what the remote tier cannot
do yet, and gives the manager the few hooks it calls (list, upload after the
publish, fetch before a restore, wait, close).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from asyncckpt.jax._options import ManagerConfig, StepNames
from asyncckpt.storage.tier import RemoteOptions, TieredDirectory


class StepTiers:
    """Where a JAX manager's steps live.

    Args:
        directory: The manager's directory: a path, or an ``s3://`` /
            ``gs://`` URL (then saves stage in a local scratch directory).
        remote: A second, persistent tier for a local ``directory``.
        remote_options: Schedule, retention and retries of the remote tier
            (default: every step, the manager's ``max_to_keep``).
        config: The manager's options (step names, ``max_to_keep``).

    Raises:
        ValueError: step names other than the plain number with a remote tier.
    """

    def __init__(self, directory: str | os.PathLike, *, remote: str | None,
                 remote_options: RemoteOptions | None, config: ManagerConfig):
        self._names = config.names
        self._dir = TieredDirectory(
            directory, remote=remote,
            remote_options=remote_options or RemoteOptions(
                max_to_keep=config.max_to_keep or None))
        if self.has_remote and self._names.name(12) != "12":
            self._dir.close()
            raise ValueError("step_prefix / step_format_fixed_length are not supported with an "
                             "object-storage directory or remote tier yet (steps are named by "
                             "their number there)")

    @property
    def local_dir(self) -> str:
        """The local directory the engine writes into."""
        return self._dir.local_dir

    @property
    def has_remote(self) -> bool:
        return self._dir.remote is not None

    def refuse_multiprocess(self) -> None:
        """Raises (on every process) when a multi-process run asks for a remote tier.

        Raises:
            NotImplementedError: each process would stage its shards in its own
                scratch directory, which process 0 cannot commit.
        """
        if self._dir.remote is None:
            return
        url = self._dir.remote.url
        self._dir.close()
        raise NotImplementedError(
            f"multi-process saves to a remote tier ({url}) are not supported yet: each process "
            "would stage its shards in its own local scratch directory, which process 0 cannot "
            "commit. Use a directory every process shares (see docs/storage.md)")

    def steps(self, local: list[int]) -> list[int]:
        """``local`` steps plus those only the remote tier has, oldest first."""
        if not self.has_remote:
            return local
        remote = (self._names.parse(n) for n in self._dir.remote_names())
        return sorted({*local, *(s for s in remote if s is not None)})

    def on_published(self) -> Callable[[int], None] | None:
        """The job's hook run right after a local publish, or None without a remote."""
        if not self.has_remote:
            return None
        return functools.partial(_hand_over, self._dir, self._names)

    def ensure_local(self, step: int, *, checksums: bool) -> None:
        """Downloads ``step`` from the remote tier unless the local one has it."""
        if self.has_remote:
            self._dir.ensure_local(self._names.name(step), checksums=checksums)

    def raise_pending_error(self) -> None:
        """Re-raises a failed background upload (two tiers)."""
        self._dir.raise_pending_error()

    def wait(self, timeout: float | None = None) -> None:
        self._dir.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._dir.close(timeout)


def _hand_over(tiers: TieredDirectory, names: StepNames, step: int) -> None:
    # Writer thread, right after the local publish: a URL directory uploads
    # here (the save is durable only once committed remotely); two tiers hand
    # the step to the background uploader.
    tiers.after_commit(names.name(step))
