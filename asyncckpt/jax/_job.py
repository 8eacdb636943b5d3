"""The background half of a JAX save: write chunks, agree, commit by rename.

Runs on the engine's writer thread. ``write`` puts this process's chunk files
(and, on the primary, the metadata files) into the shared temporary
directory, straight from the slot's buffers, with CRC32s computed as they are
written; items stored as OCDBT instead go into this process's OCDBT database
(``_ocdbt.DatabaseWriter``). ``commit`` waits for the files to be durable,
lets the processes agree (see ``_distributed``), merges the OCDBT databases
(primary), writes the manifest and publishes the step directory with one
rename (or, in orbax's commit-file mode, writes the step directory in place
and commits it by creating ``commit_success.txt`` last); ``after_commit``
then runs the manager's callback (retention) and tells the other processes,
where an error no longer fails the save.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from asyncckpt import layout
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.files import DurableWriter
from asyncckpt._engine.manifest import OWNER_MARKER, Manifest, owner_marker_bytes
from asyncckpt._engine.metrics import SaveStats
from asyncckpt.jax import _format as fmt
from asyncckpt.jax import _ocdbt, _parts
from asyncckpt.jax._distributed import ABSENT, CommitCoordinator, DistributedSaveError
from asyncckpt.jax._snapshot import StagedTree
from asyncckpt.options import AsyncOptions

if TYPE_CHECKING:
    from asyncckpt.storage.shards import ShardUploader

logger = logging.getLogger(__name__)

# Called on the writer thread once step `step` is durable and visible.
CommitCallback = Callable[[int, SaveStats, dict], None]


class JaxSaveJob:
    """Writes one staged pytree as ``<directory>/<step>/`` in the orbax layout.

    Args:
        directory: The manager's directory (a checkpointer's: the path's parent).
        step: Step number; the checkpoint's directory name (None: a
            checkpointer's save to a path, named by ``dir_name``).
        staged: The staged bytes (slot buffers).
        options: fsync and checksums.
        temp_token: Names the temporary directory; the same on every process.
        coordinator: Multi-process coordination, or None for one process.
        save_key: This save's key prefix in the key-value store.
        metrics: Saved in ``_CHECKPOINT_METADATA`` (orbax reads them there).
        custom_metadata: Likewise; also copied into the manifest.
        on_committed: Called after the publish (the manager's retention).
        on_published: Called with the step right after the publish, as part of
            the commit: if it raises, the save fails (a URL directory's
            upload, which is what makes such a save durable).
        dir_name: The step directory's name (default: the step).
        item_handlers: orbax's handler of each item, for ``_CHECKPOINT_METADATA``
            (a checkpointer's: the one handler's name, as orbax records it).
        shards: Several processes and a remote directory: each process has its
            own temporary directory and uploads its own files; the primary
            checks them all before the manifest (``asyncckpt.storage.shards``).
        on_temp_made: Called on the writer thread once the temporary directory
            exists (the manager lists the directory again there, so the next
            ``save()`` does not).
        replace: Publish over an existing checkpoint of the same name (orbax's
            ``force=True``); it is removed once the new one is in place.
        commit_marker: Write the step directory in place and commit it by
            creating this file in it last (orbax's ``CommitFileTemporaryPath``);
            None: write a temporary directory and rename it.
        deadline: ``time.monotonic()`` after which the save is not committed
            but fails with ``TimeoutError`` (orbax's ``AsyncOptions.timeout_secs``).
        make_dir_now: Create the (temporary or in-place) directory in the
            constructor, on the saving thread (orbax's
            ``create_directories_asynchronously=False``).
        ocdbt: Items stored as OCDBT -> their target data file size (0: no limit).
    """

    def __init__(
        self,
        *,
        directory: str,
        step: int | None,
        staged: StagedTree,
        options: AsyncOptions,
        temp_token: str,
        coordinator: CommitCoordinator | None,
        save_key: str | None,
        metrics: dict | None,
        custom_metadata: dict | None,
        on_committed: CommitCallback | None,
        on_published: Callable[[int], None] | None = None,
        dir_name: str | None = None,
        item_handlers: dict[str, str] | str | None = None,
        shards: ShardUploader | None = None,
        on_temp_made: Callable[[], None] | None = None,
        replace: bool = False,
        commit_marker: str | None = None,
        deadline: float | None = None,
        make_dir_now: bool = False,
        ocdbt: Mapping[str, int] | None = None,
    ):
        self.label = dir_name or str(step)
        self.step = step
        self.nbytes = staged.nbytes
        self._directory = directory
        self._staged: StagedTree | None = staged
        self._options = options
        self._token = temp_token
        self._coord = coordinator
        self._save_key = save_key
        self._metrics = metrics
        self._custom = custom_metadata
        self._on_committed = on_committed
        self._on_published = on_published
        self._item_handlers = item_handlers
        self._shards = shards
        self._on_temp_made = on_temp_made
        self._replace = replace
        self._ocdbt = dict(ocdbt or {})
        self._dbs: dict[str, _ocdbt.DatabaseWriter] = {}
        self._primary = coordinator is None or coordinator.primary
        self._init_ns = time.time_ns()
        self._tmp: str | None = None
        self._writer: DurableWriter | None = None
        self._reported = False
        self._announced = False
        self._published = False
        self._extra: dict = {}
        self._error: BaseException | None = None
        self._pause: Callable[[], None] | None = None
        self._marker = commit_marker
        self._deadline = deadline
        self._timeout_s = None if deadline is None else deadline - time.monotonic()
        if make_dir_now:
            self._tmp = self._make_dir()

    def set_pause(self, pause: Callable[[], None]) -> None:
        """The engine's gate: ``write`` pauses between write pieces while a save copies."""
        self._pause = pause

    @property
    def final_dir(self) -> str:
        return os.path.join(self._directory, self.label)

    # -- write: from the slot's buffers into the temporary directory ------------

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
        if self._coord is None or self._save_key is None or self._reported or self._announced:
            return error
        agreed = self._coord.agree_failure(self._save_key, self.step, error)
        self._reported = self._announced = True
        if agreed is not error:
            self._error = agreed
        return agreed

    def _make_dir(self) -> str:
        """The directory the files go in: a temporary, or the step itself (commit-file)."""
        if self._marker is not None:
            return commit_lib.make_dir_in_place(self.final_dir,
                                                replace_stale=self._coord is None)
        return commit_lib.make_temp_dir(self._directory, self.label, token=self._token)

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
            if self._tmp is None:
                self._tmp = self._make_dir()
            if self._on_temp_made is not None:
                self._on_temp_made()
            writer = DurableWriter(
                self._tmp, fsync=self._options.fsync, checksums=self._options.checksums,
                pause=self._pause,
            )
            self._writer = writer
            splits = staged.splits
            for name, buf in staged.chunks:  # names are relative to the step directory
                # A byte view: extension dtypes (bfloat16) have no buffer format.
                data = buf.reshape(-1).view(np.uint8)
                if (db := self._database(name)) is None:
                    writer.write(name, (data,))
                elif (pieces := splits.get(name)) is None:
                    db.put(name[db.strip:], data)
                else:  # equal, contiguous runs of the chunk's bytes
                    size = len(data) // len(pieces)
                    for k, piece in enumerate(pieces):
                        if piece is not None:
                            db.put(piece[db.strip:], data[k * size:(k + 1) * size])
            for name, data in staged.metadata_files:
                if (db := self._database(name)) is None:
                    writer.write(name, (data,))
                else:
                    db.put(name[db.strip:], data)
            for db in self._dbs.values():  # they read the slot's buffers until committed
                db.flush()
            if self._primary:
                step_meta = fmt.step_metadata_json(
                    metrics=self._metrics,
                    custom_metadata=self._custom,
                    init_ns=self._init_ns,
                    commit_ns=time.time_ns(),
                    item_handlers=self._item_handlers,
                )
                writer.write(fmt.STEP_METADATA, (step_meta.encode(),))
                # Says "asyncckpt wrote this": without its manifest it is corrupt.
                writer.write(OWNER_MARKER, (owner_marker_bytes(),))
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
            assert self._tmp is not None and self._writer is not None
            index = 0 if self._coord is None else self._coord.process_index
            db = self._dbs[item] = _ocdbt.DatabaseWriter(
                self._tmp, item, index, target=self._ocdbt[item], files=self._writer,
                pause=self._pause)
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
        assert self._writer is not None and self._tmp is not None
        for db in self._dbs.values():  # the last values, and the files TensorStore wrote
            db.finish()
        records = self._writer.finish()
        if not self._primary:
            assert self._coord is not None and self._save_key is not None
            # This process's records go into its manifest part, next to its files;
            # process 0 is told only the part's digest.
            part, digest = _parts.write(self._tmp, self._coord.process_index, records,
                                        fsync=self._options.fsync)
            if self._shards is not None:  # no shared directory: this process's files go up
                self._shards.upload(self.label, self._tmp, [*records, part])
            self._coord.report_done(self._save_key, digest)
            self._reported = True
            error = self._coord.verdict(self._save_key, self.step)
            if error is not None:
                raise error
            if self._shards is not None:
                self._shards.committed_elsewhere()  # [storage] the new step in its listing
            self._release_tmp()  # published (and owned) by the primary
            return
        if self._shards is not None:
            self._shards.upload(self.label, self._tmp, records)
        if self._coord is not None:
            records = records + self._others_records()
        if self._shards is not None:  # every process's objects, before the manifest
            self._shards.check(self.label, records)
        if self._ocdbt:
            records = records + self._merge(records)
        self._extra = {
            "num_processes": 1 if self._coord is None else self._coord.process_count,
            "metrics": self._metrics,
            "custom_metadata": self._custom or {},
        }
        manifest = Manifest(
            framework="jax",
            label=self.label,
            step=self.step,
            files=tuple(sorted(records, key=lambda r: r.name)),
            stats=stats.to_dict(),
            extra=self._extra,
        )
        commit_lib.write_text_atomic(
            os.path.join(self._tmp, layout.JAX_MANIFEST_NAME),
            manifest.to_json(),
            fsync=self._options.fsync,
        )
        self._check_deadline()
        if self._marker is not None:
            commit_lib.commit_in_place(self._tmp, self._marker,
                                       f"committed by asyncckpt: {self.final_dir}",
                                       fsync=self._options.fsync)
        else:
            commit_lib.publish_dir(self._tmp, self.final_dir, fsync=self._options.fsync,
                                   replace=self._replace)
        self._tmp = None
        self._published = True
        if self._on_published is not None:
            self._on_published(self.step)

    def _others_records(self) -> list:
        """Primary: every other process's file records, from their manifest parts.

        Raises:
            DistributedSaveError: a process failed, did not answer, or its part
                is not where the primary commits (a directory not shared).
        """
        assert self._coord is not None and self._save_key is not None and self._tmp is not None
        digests, failures = self._coord.collect(self._save_key)
        parts: dict = {}
        if not failures:
            if self._shards is None:
                reader, where = _parts.local_reader(self._tmp), repr(self._tmp)
            else:
                reader, where = self._shards.reader(self.label), f"{self._shards.url}/{self.label}/"
            parts, failures = _parts.read_all(digests, reader, where=where)
        if failures:
            self._announced = True
            raise DistributedSaveError(
                self.step, self._coord.announce(self._save_key, failures=failures))
        if self._shards is None:
            _parts.remove(self._tmp, list(parts))  # not part of the published checkpoint
        return [r for i in sorted(parts) for r in parts[i]]

    def _merge(self, records: list) -> list:
        """Primary: one OCDBT database per item over every process's; the new files' records.

        Without a shared directory (``shards``), the other processes' B-tree
        nodes are fetched first (their data files are not: the merged tree
        only refers to them), and the merged root is uploaded after.
        """
        assert self._tmp is not None
        if self._shards is not None:
            wanted = set(_ocdbt.merge_inputs([r.name for r in records]))
            here = os.path.join(self._tmp, "")
            self._shards.download(self.label, self._tmp, [
                r for r in records if r.name in wanted
                and not os.path.exists(here + r.name)])
        merged = DurableWriter(self._tmp, fsync=self._options.fsync,
                               checksums=self._options.checksums, pause=self._pause)
        for item in sorted(self._ocdbt):
            if os.path.isdir(os.path.join(self._tmp, item)):
                _ocdbt.merge(self._tmp, item, files=merged)
        new = merged.finish()
        if self._shards is not None:
            self._shards.upload(self.label, self._tmp, new)
        return new

    def after_commit(self, stats: SaveStats) -> None:
        """Published: the manager's callback (retention), then tell the others."""
        try:
            # Retention first, so every process sees the same steps once told.
            if self._on_committed is not None:
                self._on_committed(self.step, stats, self._extra)
        finally:
            if self._published and self._coord is not None:
                assert self._save_key is not None
                self._announced = True  # published: committed either way
                self._coord.announce(self._save_key)

    def _release_tmp(self) -> None:
        """Non-primary: a shared temporary is the primary's; a private one is removed."""
        assert self._tmp is not None
        if self._shards is not None:
            commit_lib.remove_tree(self._tmp)
        else:
            commit_lib.forget_temp(self._tmp)
        self._tmp = None

    # -- abort: leave no temporary behind, and let the other processes know --------

    def abort(self) -> None:
        self._staged = None
        error = self._error or RuntimeError(f"save of step {self.step} failed")
        if self._writer is not None:
            self._writer.abort()
        if self._coord is not None and self._save_key is not None:
            if not (self._reported or self._announced):
                self._failed(error)  # not agreed yet (an error outside write/commit)
            if not self._primary:
                if self._tmp is not None:
                    if _primary_absent(self._error):
                        commit_lib.remove_tree(self._tmp)  # no one else will
                        self._tmp = None
                    else:
                        self._release_tmp()
                return  # the primary removes the shared temporary directory
            # The primary announced only after every process answered (or timed
            # out): none writes into the temporary directory any more.
        if self._tmp is not None:
            commit_lib.remove_tree(self._tmp)
            self._tmp = None


def _primary_absent(error: BaseException | None) -> bool:
    """Whether the primary raised before staging this save (so it never removes its files)."""
    return isinstance(error, DistributedSaveError) and error.failures.get(0, "").startswith(
        ABSENT)
