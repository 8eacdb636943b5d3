"""The background half of a TensorFlow save: write, verify-able commit, callback.

The staged state is written as TensorFlow's bundle format from the staging
buffers (``_bundlewrite``), or, for what that cannot write, turned back into
tensors without copying (DLPack) and handed to TensorFlow's own bundle
writer; either way the files are TensorFlow-native (``write_bundle``).
``commit`` ends with the publish (the index rename); what follows it, the
ownership record and the ``on_committed`` callback (state file, retention),
runs in ``after_commit``, where an error no longer fails the save.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import time
from collections.abc import Callable

import numpy as np

from asyncckpt import layout
from asyncckpt._engine._jobs import SaveJob
from asyncckpt._engine.destinations import Destination, PrefixFiles, Uploaded
from asyncckpt._engine.lock import CheckpointLock
from asyncckpt._engine.manifest import OWNED_RECORD, record_owned
from asyncckpt._engine.metrics import COPY, WRITE, Phases, SaveStats
from asyncckpt._engine.transaction import Transaction
from asyncckpt.options import AsyncOptions
from asyncckpt.tf import _bundlewrite, _compat
from asyncckpt.tf._compat import tf
from asyncckpt.tf._snapshot import StagedState, StagedTensor
from asyncckpt.tf._variant import CapturedVariant

logger = logging.getLogger(__name__)


# How long a save of a checkpoint another process is writing waits for it to finish.
LOCK_WAIT_S = 60.0

# Called on the writer thread once the checkpoint at `path` is durable.
CommitCallback = Callable[[str, SaveStats], None]


def manifest_path(prefix: str) -> str:
    """Where the manifest of the TensorFlow checkpoint at ``prefix`` lives."""
    return layout.tf_manifest_path(prefix)


def checkpoint_files(prefix: str) -> list[str]:
    """Every file that belongs to the checkpoint at ``prefix``."""
    files = glob.glob(glob.escape(prefix) + ".data-?????-of-?????")
    files += [p for p in (prefix + ".index", manifest_path(prefix)) if os.path.lexists(p)]
    return files


def delete_checkpoint(prefix: str) -> None:
    """Removes a TensorFlow checkpoint, commit marker (the index) first."""
    for path in [prefix + ".index", *checkpoint_files(prefix)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _as_tensor(t: StagedTensor) -> tf.Tensor:
    """Wraps a staged buffer as a tensor without copying it, where possible."""
    if isinstance(t.host, CapturedVariant):
        return t.host.tensor
    if t.dtype == tf.string:
        return tf.constant(t.host, dtype=tf.string)
    host = t.host
    try:
        return tf.experimental.dlpack.from_dlpack(host.__dlpack__())
    except (TypeError, ValueError, BufferError, RuntimeError, tf.errors.InvalidArgumentError):
        pass
    # DLPack has no code for bfloat16 and friends: share the bytes as unsigned
    # integers of the same width and reinterpret them (also without a copy).
    if host.dtype.itemsize in (1, 2, 4, 8) and t.dtype != tf.bool:
        as_uint = host.view(np.dtype(f"u{host.dtype.itemsize}"))
        try:
            return tf.bitcast(tf.experimental.dlpack.from_dlpack(as_uint.__dlpack__()), t.dtype)
        except (TypeError, ValueError, BufferError, RuntimeError, tf.errors.InvalidArgumentError):
            pass
    return tf.constant(host, dtype=t.dtype)  # copies; correct for any dtype


def write_bundle(prefix: str, state: StagedState, *, pause: Callable[[], None] | None = None,
                 phases: Phases | None = None) -> dict[str, tuple[int, int, str]]:
    """Writes ``state`` as a TensorFlow checkpoint at ``prefix``.

    Produces ``prefix.index`` and ``prefix.data-00000-of-00001``; the object
    graph goes under the same key ``tf.train.Checkpoint`` uses, so the result
    restores with plain TensorFlow. The files are written by ``_bundlewrite``
    straight from the staging buffers, or by TensorFlow's ``SaveV2`` for what
    that cannot write. Returns the ``(size, checksum, algorithm)`` of each file whose
    checksum is already known (none after ``SaveV2``). ``pause`` is called
    between the data file's ranges (``SaveV2`` writes in one call: no pauses);
    ``phases`` records where the time goes.

    With a background copy into the slot still running (``state.copy``),
    each range of the data file is written once the copy has reached it:
    the write and the copy overlap, where the write used to wait for the
    whole copy (at 16 MiB the copy was 3 ms of a 22 ms durable time; the
    overlap took 1-4 ms off it, docs/architecture.md). ``SaveV2`` waits for
    all of it. The caller still waits for the copy to end (``TFSaveJob.write``).
    """
    copy = state.copy
    sums = _bundlewrite.write_bundle(prefix, state, pause=pause, phases=phases,
                                     ready=None if copy is None else copy.wait_for)
    if sums is not None:
        return sums
    if copy is not None:
        copy.wait()
    t0 = time.perf_counter()
    save_v2_bundle(prefix, state)
    if phases is not None:
        phases.add(WRITE + "bundle (SaveV2)", time.perf_counter() - t0, 1, state.nbytes)
    return {}


def save_v2_bundle(prefix: str, state: StagedState) -> None:
    """Writes ``state`` at ``prefix`` with TensorFlow's own ``SaveV2``."""
    names = [t.key for t in state.tensors] + [_compat.OBJECT_GRAPH_KEY]
    slices = [t.slice_spec for t in state.tensors] + [""]
    with _compat.sync_executor_scope():
        tensors = [_as_tensor(t) for t in state.tensors]
        tensors.append(tf.constant(state.object_graph, dtype=tf.string))
        _compat.save_v2(prefix, names, slices, tensors, io_device=state.io_device)


class TFSaveJob(SaveJob):
    """Writes one staged TensorFlow state as ``<prefix>.index`` + data + manifest.

    The format writer of a TensorFlow save: its transaction publishes the
    files with the index last (``PrefixFiles``), after the data file and
    the manifest.

    Args:
        prefix: Final checkpoint prefix (``dir/ckpt-3``).
        state: The staged values.
        step: Step recorded in the manifest.
        options: Engine options (fsync, checksums).
        on_committed: Called once the checkpoint is durable and visible.
        on_published: Called with the prefix right after the local publish,
            as part of the commit: if it raises, the save fails (a URL
            directory's upload, which is what makes such a save durable).
        extra: Extra manifest data.
    """

    def __init__(
        self,
        *,
        prefix: str,
        state: StagedState,
        step: int | None,
        options: AsyncOptions,
        on_committed: CommitCallback | None = None,
        extra: dict | None = None,
        on_published: Callable[[str], None] | None = None,
    ):
        label = os.path.basename(prefix)
        directory = os.path.dirname(os.path.abspath(prefix))
        destination: Destination = PrefixFiles(
            directory, label + layout.TF_INDEX_SUFFIX, fsync=options.fsync,
            # Writing again under an existing prefix: the old checkpoint stays
            # (backed up) until the new index is in place; see publish_files.
            replaces=lambda: [os.path.basename(p)
                              for p in checkpoint_files(os.path.join(directory, label))],
            # Several processes may write one directory (as TensorFlow lets
            # them): only the same checkpoint is theirs to keep apart.
            lock=CheckpointLock(directory, label), lock_wait_s=LOCK_WAIT_S)
        if on_published is not None:
            destination = Uploaded(destination, functools.partial(on_published, prefix))
        super().__init__(label=label, step=step, nbytes=state.nbytes, transaction=Transaction(
            destination, framework="tensorflow", label=label, step=step,
            manifest_name=os.path.basename(manifest_path(prefix)), options=options))
        self.prefix = prefix
        self._state: StagedState | None = state
        self._on_committed = on_committed
        self._extra = extra or {}
        self._dir = directory
        self._fsync = options.fsync
        self._sums: dict[str, tuple[int, int, str]] = {}  # file -> (size, crc, algorithm)

    def write(self) -> None:
        phases = self.transaction.phases
        state = self._state
        copy = state.copy  # the background copy into the slot, if any: the write overlaps it
        try:
            workdir = self.transaction.begin()
            self._sums = self.write_bundle(os.path.join(workdir, self.label), state) or {}
            if copy is not None:
                with phases.timed(COPY):
                    copy.wait()  # done by now, unless a subclass wrote otherwise; raises its error
            self.nbytes = state.nbytes  # with the variants (iterator state) encoded
        finally:
            self._state = None  # the slot is reused once this returns
            if copy is not None:
                copy.cancel()  # on an error: the copy thread is off the slot before it is

    def write_bundle(self, prefix: str, state: StagedState) -> dict[str, tuple[int, int, str]]:
        """Writes the bundle's files at ``prefix`` (in the transaction's directory).

        The module's ``write_bundle``, pausing on the engine's gate and
        recording its phases in the transaction's; a
        subclass may wrap it (hold or fail the write). Returns the
        checksums known from the writing (see ``write_bundle``).
        """
        return write_bundle(prefix, state, pause=self.pause, phases=self.transaction.phases)

    def start_background(self) -> None:
        """Starts the background copy into the slot (the save is queued)."""
        state = self._state
        if state is not None and state.copy is not None:
            state.copy.start()

    def discard(self) -> None:
        """The save will not be queued: stops its background copy into the slot."""
        state, self._state = self._state, None
        if state is not None and state.copy is not None:
            state.copy.cancel()

    def manifest_extra(self) -> dict:
        return self._extra

    def commit(self, stats: SaveStats) -> None:
        txn = self.transaction
        # The bundle's files: checksummed as written, or (SaveV2) read back now.
        txn.adopt(sorted(os.listdir(txn.workdir)), known=self._sums)
        super().commit(stats)

    def after_commit(self, stats: SaveStats) -> None:
        """Published: record it as asyncckpt's, then run the callback."""
        # Other processes may record theirs too: the lock keeps their cleanup off
        # its temporary (and their records from crossing).
        lock = CheckpointLock(self._dir, OWNED_RECORD)
        try:
            lock.acquire(LOCK_WAIT_S)
            try:
                record_owned(self._dir, self.label, marker_suffix=layout.TF_INDEX_SUFFIX,
                             fsync=self._fsync)
            finally:
                lock.release()
        finally:
            if self._on_committed is not None:
                self._on_committed(self.prefix, stats)
