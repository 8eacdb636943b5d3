"""The background half of a JAX save: the format writer of orbax's layout.

Runs on the engine's writer thread. ``write`` puts this process's chunk files
(and, on the primary, the step's metadata files) into the transaction's
directory, straight from the slot's buffers, checksummed as they are
written; items stored as OCDBT go into this process's OCDBT database
(``_ocdbt.DatabaseWriter``) instead. ``commit`` seals the files; with
several processes the others hand their records to the primary (see
``_distributed``), which merges the OCDBT databases and publishes every
process's files in one transaction. ``after_commit`` then runs the
manager's callback and tells the other processes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncckpt import layout
from asyncckpt._engine._jobs import SaveJob
from asyncckpt._engine.destinations import (
    Destination,
    MarkedDirectory,
    RenamedDirectory,
    Uploaded,
)
from asyncckpt._engine.files import FileRecord
from asyncckpt._engine.manifest import OWNER_MARKER, owner_marker_bytes
from asyncckpt._engine.metrics import FSYNC_WAIT, OCDBT, SaveStats
from asyncckpt._engine.transaction import Transaction
from asyncckpt.jax import _format as fmt
from asyncckpt.jax import _ocdbt, _parts
from asyncckpt.jax._distributed import ABSENT, CommitCoordinator, DistributedSaveError
from asyncckpt.jax._handlers import HandlerSaves
from asyncckpt.jax._snapshot import StagedTree
from asyncckpt.options import AsyncOptions

if TYPE_CHECKING:
    from asyncckpt.storage.shards import ShardUploader

logger = logging.getLogger(__name__)

# Called on the writer thread once step `step` is durable and visible.
CommitCallback = Callable[[int, SaveStats, dict], None]


@dataclass(frozen=True)
class StepInfo:
    """What a step records besides its arrays (``_CHECKPOINT_METADATA``, the manifest).

    Attributes:
        metrics: The save's metrics (orbax reads them there; ``best_fn``).
        custom_metadata: The save's ``custom_metadata``.
        item_handlers: orbax's handler of each item (a checkpointer's: the
            one handler's name), as orbax records them.
        started: When the save was called (a POSIX timestamp, from the
            manager's clock: ``datetime.datetime.now``), recorded as
            ``init_timestamp_nsecs``; None: when the job is made.
    """

    metrics: Any = None
    custom_metadata: Any = None
    item_handlers: dict[str, str] | str | None = None
    started: float | None = None


@dataclass(frozen=True)
class Peers:
    """The other processes of a multi-process save.

    Attributes:
        coordinator: The commit protocol over JAX's key-value store.
        save_key: This save's key prefix in the store.
        shards: No shared directory (a URL directory): each process has its
            own temporary directory and uploads its own files; the primary
            checks them all before the manifest (``asyncckpt.storage.shards``).
    """

    coordinator: CommitCoordinator
    save_key: str
    shards: ShardUploader | None = None

    @property
    def primary(self) -> bool:
        return self.coordinator.primary


def step_transaction(path: str, *, options: AsyncOptions, step: int | None, token: str,
                     commit_marker: str | None = None, shared: bool = False,
                     replace: bool = False, then: Callable[[], None] | None = None,
                     mode: int | None = None,
                     on_begin: Callable[[], None] | None = None) -> Transaction:
    """The transaction of a step (or a checkpointer's path) in orbax's layout.

    Args:
        path: The step's directory.
        options: fsync and checksums.
        step: The step, recorded in the manifest.
        token: Names the temporary directory; the same on every process.
        commit_marker: Write the directory in place and commit it by creating
            this file last (orbax's ``CommitFileTemporaryPath``); None: a
            temporary directory renamed into place.
        shared: Several processes write into the directory (an interrupted
            in-place step is then not removed first).
        replace: Publish over an existing checkpoint (orbax's ``force=True``).
        then: Completes the commit after the local publish (a URL
            directory's upload); if it raises, the save fails.
        mode: Permission bits of what is created (orbax's ``path_permission_mode``).
        on_begin: Called once the directory exists (see ``Transaction``).
    """
    destination: Destination
    if commit_marker is not None:
        destination = MarkedDirectory(path, commit_marker, replace_stale=not shared,
                                      fsync=options.fsync, mode=mode)
    else:
        destination = RenamedDirectory(path, token=token, replace=replace,
                                       fsync=options.fsync, mode=mode)
    if then is not None:
        destination = Uploaded(destination, then)
    return Transaction(destination, framework="jax", label=os.path.basename(path), step=step,
                       manifest_name=layout.JAX_MANIFEST_NAME, options=options, mode=mode,
                       on_begin=on_begin)


class JaxSaveJob(SaveJob):
    """Writes one staged pytree as a step in the orbax layout, through ``transaction``.

    Args:
        transaction: The step's commit (its destination: a renamed temporary,
            or the step's directory committed by a marker); its step is the
            save's (None: a checkpointer's save to a path).
        staged: The staged bytes (slot buffers).
        info: Metrics, custom metadata and handler names of the step.
        peers: The other processes, or None for a save of one process.
        ocdbt: Items stored as OCDBT -> their target data file size (0: no limit).
        deadline: ``time.monotonic()`` after which the save is not committed
            but fails with ``TimeoutError`` (orbax's ``AsyncOptions.timeout_secs``).
        on_committed: Called after the publish (the manager's post-commit work).
        handlers: Items saved by their own orbax handlers, started at the
            ``save()`` call into the transaction's directory; finished (their
            futures, ``finalize``) and their files adopted before the commit.

    Attributes:
        database_class: The writer of an OCDBT item's database (a subclass
            of ``_ocdbt.DatabaseWriter`` where a test holds or fails its writes).
    """

    database_class: type[_ocdbt.DatabaseWriter] = _ocdbt.DatabaseWriter

    def __init__(self, *, transaction: Transaction, staged: StagedTree, info: StepInfo,
                 peers: Peers | None = None, ocdbt: Mapping[str, int] | None = None,
                 deadline: float | None = None, on_committed: CommitCallback | None = None,
                 handlers: HandlerSaves | None = None):
        super().__init__(label=transaction.label, step=transaction.step, nbytes=staged.nbytes,
                         transaction=transaction)
        self._staged: StagedTree | None = staged
        self._info = info
        self._peers = peers
        self._primary = peers is None or peers.primary
        self._ocdbt = dict(ocdbt or {})
        self._dbs: dict[str, _ocdbt.DatabaseWriter] = {}
        self._deadline = deadline
        self._timeout_s = None if deadline is None else deadline - time.monotonic()
        self._on_committed = on_committed
        self._handlers = handlers
        self._init_ns = time.time_ns() if info.started is None else int(info.started * 1e9)
        self._reported = False  # this process's part was reported to the primary
        self._announced = False  # the outcome was announced (or agreed) to every process
        self._extra: dict = {}
        self._error: BaseException | None = None

    # -- write: from the slot's buffers into the transaction's directory --------------

    def write(self) -> None:
        try:
            self._write()
        except BaseException as e:
            agreed = self._failed(e)
            if agreed is e:
                raise
            raise agreed from e

    def _failed(self, error: BaseException) -> BaseException:
        """This process's part failed: the error to raise (multi-process: the agreed one)."""
        self._error = error
        peers = self._peers
        if peers is None or self._reported or self._announced:
            return error
        agreed = peers.coordinator.agree_failure(peers.save_key, self.step, error)
        self._reported = self._announced = True
        if agreed is not error:
            self._error = agreed
        return agreed

    def _check_deadline(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise TimeoutError(
                f"the save of step {self.step} did not finish within the timeout of "
                f"{self._timeout_s:.0f} s (AsyncOptions.timeout_secs): it is not committed")

    def _write(self) -> None:
        staged = self._staged
        assert staged is not None
        try:
            self._check_deadline()
            self.transaction.begin()
            files = self.transaction.files
            splits = staged.splits
            with files.kind("zarr chunks"):
                for name, buf in staged.chunks:  # names are relative to the step directory
                    # A byte view: extension dtypes (bfloat16) have no buffer format.
                    data = buf.reshape(-1).view(np.uint8)
                    if (db := self._database(name)) is None:
                        files.write(name, (data,))
                    elif (pieces := splits.get(name)) is None:
                        db.put(name[db.strip:], data)
                    else:  # equal, contiguous runs of the chunk's bytes
                        size = len(data) // len(pieces)
                        for k, piece in enumerate(pieces):
                            if piece is not None:
                                db.put(piece[db.strip:], data[k * size:(k + 1) * size])
            with files.kind("metadata"):
                for name, data in staged.metadata_files:
                    if (db := self._database(name)) is None:
                        files.write(name, (data,))
                    else:
                        db.put(name[db.strip:], data)
            for db in self._dbs.values():  # they read the slot's buffers until committed
                db.flush()
            if self._primary:
                info = self._info
                step_meta = fmt.step_metadata_json(
                    metrics=info.metrics, custom_metadata=info.custom_metadata,
                    init_ns=self._init_ns, commit_ns=time.time_ns(),
                    item_handlers=info.item_handlers)
                with files.kind("metadata"):
                    files.write(fmt.STEP_METADATA, (step_meta.encode(),))
                    # Says "asyncckpt wrote this": without its manifest it is corrupt.
                    files.write(OWNER_MARKER, (owner_marker_bytes(),))
        finally:
            self._staged = None  # the slot is reused once this returns

    def _database(self, name: str) -> _ocdbt.DatabaseWriter | None:
        """The OCDBT database a file of the step goes into (None: a file of its own).

        In an OCDBT item, the files of its arrays (``<item>/<param>/...``) are
        keys of this process's database; the item's own files (``_METADATA``,
        ``_sharding``) stay files. Item ``""`` is a checkpointer's pytree, at
        the step's root: its arrays' files are ``<param>/...``, and the
        step's own files (``_CHECKPOINT_METADATA``...) stay files too, as do
        orbax's ``array_metadatas/process_<i>``.
        """
        if fmt.ROOT_ITEM in self._ocdbt:
            if "/" not in name or name.startswith(fmt.ARRAY_METADATAS + "/"):
                return None
            item = fmt.ROOT_ITEM
        else:
            item, _, rest = name.partition("/")
            if (item not in self._ocdbt or "/" not in rest
                    or rest.startswith(fmt.ARRAY_METADATAS + "/")):
                return None
        db = self._dbs.get(item)
        if db is None:
            index = 0 if self._peers is None else self._peers.coordinator.process_index
            db = self._dbs[item] = self.database_class(
                self.transaction.workdir, item, index, target=self._ocdbt[item],
                files=self.transaction.files, pause=self.pause)
        return db

    # -- commit: durable, agreed, published ----------------------------------------

    def commit(self, stats: SaveStats) -> None:
        try:
            self._commit(stats)
        except DistributedSaveError as e:
            self._error = e  # already agreed
            raise
        except BaseException as e:
            agreed = self._failed(e)
            if agreed is e:
                raise
            raise agreed from e

    def _commit(self, stats: SaveStats) -> None:
        txn, peers, handlers = self.transaction, self._peers, self._handlers
        for db in self._dbs.values():  # the B-trees; one process's are the items' roots too
            db.finish(root=peers is None)
        # A directory of this process's own: its handlers' files are its to record.
        private = peers is None or peers.shards is not None
        if handlers:
            handlers.finish(txn.workdir)
            if private:  # (a checkpointer's handler writes beside asyncckpt's own files)
                txn.adopt(handlers.files(
                    txn.workdir, skip=frozenset(r.name for r in txn.files.records)))
        if peers is None:  # one process: its manifest joins its files' fsyncs
            self._extra = self._manifest_extra(1)
            self._check_deadline()
            txn.commit(stats, self._extra)
            return
        records = txn.seal()
        if not self._primary:
            self._hand_over(records)
            return
        shards = peers.shards
        if shards is not None:
            shards.upload(self.label, txn.workdir, records)
        records = records + self._others_records()
        if handlers and not private:  # a shared directory: every process's, once all are done
            late = txn.writer()
            for name in handlers.files(txn.workdir, skip=frozenset(r.name for r in records)):
                late.add_existing(name)
            records = records + late.finish()
        if shards is not None:  # every process's objects, before the manifest
            shards.check(self.label, records)
        if self._ocdbt:
            records = records + self._merge(records)
        self._extra = self._manifest_extra(peers.coordinator.process_count)
        self._check_deadline()
        txn.publish(records, stats, self._extra)

    def _manifest_extra(self, processes: int) -> dict:
        return {"num_processes": processes, "metrics": self._info.metrics,
                "custom_metadata": self._info.custom_metadata or {}}

    def _hand_over(self, records: list[FileRecord]) -> None:
        """Not the primary: this process's records go to the primary, which publishes."""
        peers = self._peers
        assert peers is not None
        txn, coordinator = self.transaction, peers.coordinator
        # Into this process's manifest part, next to its files; process 0 is
        # told only the part's digest.
        part, digest = _parts.write(txn.workdir, coordinator.process_index, records,
                                    fsync=txn.fsync)
        if peers.shards is not None:  # no shared directory: this process's files go up
            peers.shards.upload(self.label, txn.workdir, [*records, part])
        coordinator.report_done(peers.save_key, digest)
        self._reported = True
        error = coordinator.verdict(peers.save_key, self.step)
        if error is not None:
            raise error
        if peers.shards is not None:
            peers.shards.committed_elsewhere()  # [storage] the new step in its listing
        # Published (and owned) by the primary; a private temporary is removed.
        txn.release(remove=peers.shards is not None)

    def _others_records(self) -> list[FileRecord]:
        """Primary: every other process's file records, from their manifest parts.

        Raises:
            DistributedSaveError: a process failed, did not answer, or its part
                is not where the primary commits (a directory not shared).
        """
        peers = self._peers
        assert peers is not None
        workdir, coordinator = self.transaction.workdir, peers.coordinator
        digests, failures = coordinator.collect(peers.save_key)
        parts: dict = {}
        if not failures:
            if peers.shards is None:
                reader, where = _parts.local_reader(workdir), repr(workdir)
            else:
                reader = peers.shards.reader(self.label)
                where = f"{peers.shards.url}/{self.label}/"
            parts, failures = _parts.read_all(digests, reader, where=where)
        if failures:
            self._announced = True
            raise DistributedSaveError(
                self.step, coordinator.announce(peers.save_key, failures=failures))
        if peers.shards is None:
            _parts.remove(workdir, list(parts))  # not part of the published checkpoint
        return [r for i in sorted(parts) for r in parts[i]]

    def _merge(self, records: list[FileRecord]) -> list[FileRecord]:
        """Primary: one OCDBT database per item over every process's; the new files' records.

        Without a shared directory (``shards``), the other processes' B-tree
        nodes are fetched first (their data files are not: the merged tree
        only refers to them), and the merged root is uploaded after.
        """
        txn = self.transaction
        workdir = txn.workdir
        shards = None if self._peers is None else self._peers.shards
        if shards is not None:
            wanted = set(_ocdbt.merge_inputs([r.name for r in records]))
            here = os.path.join(workdir, "")
            shards.download(self.label, workdir, [
                r for r in records if r.name in wanted
                and not os.path.exists(here + r.name)])
        merged = txn.writer()
        with txn.phases.timed(OCDBT):
            for item in sorted(self._ocdbt):
                if os.path.isdir(os.path.join(workdir, item)):
                    _ocdbt.merge(workdir, item, files=merged)
        with txn.phases.timed(FSYNC_WAIT):
            new = merged.finish()
        if shards is not None:
            shards.upload(self.label, workdir, new)
        return new

    def after_commit(self, stats: SaveStats) -> None:
        """Published: the manager's callback, then tell the others."""
        try:
            # Retention first, so every process sees the same steps once told.
            if self._on_committed is not None:
                self._on_committed(self.step, stats, self._extra)
        finally:
            peers = self._peers
            if self.transaction.published and peers is not None:
                self._announced = True  # published: committed either way
                peers.coordinator.announce(peers.save_key)

    # -- abort: leave no temporary behind, and let the other processes know --------

    def abort(self) -> None:
        self._staged = None
        if self._handlers:
            self._handlers.abandon()
        txn, peers = self.transaction, self._peers
        if peers is None:
            txn.abort()
            return
        error = self._error or RuntimeError(f"save of step {self.step} failed")
        if not (self._reported or self._announced):
            self._failed(error)  # not agreed yet (an error outside write/commit)
        if self._primary:
            # The primary announced only after every process answered (or timed
            # out): none writes into the temporary directory any more.
            txn.abort()
        elif _primary_absent(self._error) or peers.shards is not None:
            txn.release(remove=True)  # no one else will remove it
        else:
            txn.release()  # the primary removes the shared temporary directory


def _primary_absent(error: BaseException | None) -> bool:
    """Whether the primary raised before staging this save (so it never removes its files)."""
    return isinstance(error, DistributedSaveError) and error.failures.get(0, "").startswith(
        ABSENT)
