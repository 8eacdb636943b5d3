"""Multi-process saves to an object store: every process uploads its own shards.

Hosts of a multi-process run share no filesystem, so with an ``s3://`` or
``gs://`` directory each process stages its own files in its own local
scratch directory, and the bucket is where the checkpoint comes together.
``ShardUploader`` is the storage half of such a save's commit; the JAX job
calls it on its background writer thread, never on the training thread:

1. ``upload`` (every process, once its files are durable locally): puts its
   own files under the step's prefix, with its manifest part (the records
   of its files: name, size, checksum). Only then does a process tell the
   primary it is done; a failed upload is reported as that process's error
   instead, and fails the save everywhere. The primary reads the parts
   (``reader``).
2. ``check`` (the primary, with every process's records): one listing must
   show every object with its recorded size. A missing or wrong-size object
   fails the save on every process, naming the objects; nothing is written
   after it, so no marker ever points at a checkpoint that is not whole.
3. Then the primary writes the manifest and commits it with
   ``TieredDirectory.after_commit(name, data_uploaded=True)``: manifest,
   the same size check once more, the create-only commit marker and orbax's
   ``commit_success.txt`` (``protocol.upload_checkpoint``).

Framework-free: the records are ``asyncckpt._engine.files.FileRecord``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from asyncckpt._engine.files import FileRecord
from asyncckpt.storage import protocol
from asyncckpt.storage.base import StorageError, retry_call
from asyncckpt.storage.tier import RemoteTier

logger = logging.getLogger(__name__)


class ShardUploader:
    """One process's part of multi-process saves into a remote directory.

    Args:
        remote: The manager's remote tier (its store, retries, concurrency).
        process_index: This process, for log lines.
    """

    def __init__(self, remote: RemoteTier, *, process_index: int):
        self._remote = remote
        self.process_index = process_index

    @property
    def url(self) -> str:
        return self._remote.url

    def upload(self, name: str, directory: str, records: Sequence[FileRecord]) -> None:
        """Uploads this process's files of checkpoint ``name``, staged in ``directory``.

        Raises:
            StorageError: the checkpoint is committed already, or an upload
                failed past its retry deadline.
            OSError: a permanent error (access denied, a local file missing).
        """
        t0 = time.monotonic()
        opts, store = self._remote.options, self._remote.store
        marker = f"{name}/{protocol.JAX_MARKER_NAME}"
        try:  # never overwrite the objects of a committed checkpoint
            retry_call(lambda: store.get(marker), what=f"read {marker} ({store.url})",
                       policy=opts.retry)
        except FileNotFoundError:
            pass
        else:
            raise StorageError(f"{store.url}: checkpoint {name} is already committed; refusing "
                               f"to overwrite its objects")
        protocol.upload_files(self._remote.store, f"{name}/", directory, records,
                              retry=opts.retry, concurrency=opts.concurrency)
        logger.info("[process %d] uploaded %d file(s), %.1f MiB of %s to %s in %.2f s",
                    self.process_index, len(records), sum(r.size for r in records) / 2**20,
                    name, self.url, time.monotonic() - t0)

    def committed_elsewhere(self) -> None:
        """Non-primary, once the primary has committed: lists the remote steps again.

        The tier's cached listing (what ``all_steps`` and ``save`` consult) is
        refreshed by the process that commits; the others refresh it here, on
        the writer thread, so it holds the new step (and the primary's retention).
        """
        try:
            self._remote.committed()
        except Exception as e:  # listing is bookkeeping: the step is committed
            logger.warning("[process %d] cannot list %s: %s", self.process_index, self.url, e)

    def download(self, name: str, directory: str, records: Sequence[FileRecord]) -> None:
        """Primary: fetches these files of other processes (checked) into ``directory``.

        What the primary must read of their parts to commit (the B-tree
        nodes of their OCDBT databases, which it merges), never their data.
        """
        opts = self._remote.options
        protocol.download_files(self._remote.store, f"{name}/", directory, records,
                                retry=opts.retry, concurrency=opts.concurrency)

    def reader(self, name: str) -> Callable[[str], bytes | None]:
        """Primary: reads small files of checkpoint ``name`` by name (None: not there).

        How it reads the other processes' manifest parts, uploaded with their files.
        """
        store, retry = self._remote.store, self._remote.options.retry

        def read(file: str) -> bytes | None:
            key = f"{name}/{file}"
            try:
                return retry_call(lambda: store.get(key), what=f"read {key} ({store.url})",
                                  policy=retry)
            except FileNotFoundError:
                return None

        return read

    def check(self, name: str, records: Sequence[FileRecord]) -> None:
        """Primary: every process's objects of ``name`` exist with their recorded sizes.

        Raises:
            StorageError: naming each missing or wrong-size object.
        """
        protocol.check_objects(self._remote.store, f"{name}/", records,
                               retry=self._remote.options.retry)


__all__ = ["ShardUploader"]
