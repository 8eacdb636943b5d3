"""``ArrayStore``: numbered checkpoints of named arrays plus JSON, saved asynchronously.

The framework-neutral format under the Keras callbacks and the job runner. A
checkpoint is a directory ``<directory>/<step>/`` holding

* ``arrays.bin``: every array's bytes, each starting on a 64-byte boundary;
* ``index.json``: per array its dtype, shape, offset, size and checksum
  (under ``"crc32c"``, or ``"crc32"`` for zlib's: the engine writer's
  algorithm, see ``engine.fastcrc``), and the caller's JSON metadata
  (training position, callback state, ...);
* ``asyncckpt.manifest.json``: the engine's manifest (sizes and checksums of
  both files), as every asyncckpt checkpoint has.

The directory is written under a temporary name and published with one
rename, so arrays and metadata are committed together: a reader never pairs
new weights with an old position. Per-array offsets and checksums let a
restore read (and verify) only the arrays it selects.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncckpt import _deprecation, layout
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine import contained, fastcrc, retention
from asyncckpt._engine._copy import copy_arrays
from asyncckpt._engine._jobs import SaveJob
from asyncckpt._engine.destinations import RenamedDirectory
from asyncckpt._engine.files import Checksummed
from asyncckpt._engine.manifest import read_manifest, verify_files
from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.slots import Slot
from asyncckpt._engine.steps import StepDirectory, StepRecord, remove_dir, shared
from asyncckpt._engine.transaction import Transaction
from asyncckpt._engine.writer import AsyncEngine, SaveHandle
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.options import AsyncOptions

logger = logging.getLogger(__name__)

DATA_NAME = "arrays.bin"
INDEX_NAME = "index.json"
FRAMEWORK = "arrays"
_ALIGN = 64
_COMBINE_MIN = 1 << 20
_FORMAT = 1


def _dtype_from_name(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and friends; installed with JAX and TensorFlow

        return np.dtype(getattr(ml_dtypes, name))


def _checked_entry(name: str, e: Any, data_size: int, *, checkpoint: str,
                   file: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """An index entry's ``(dtype, shape, offset, nbytes)``, checked before anything is read.

    The index is untrusted input: its sizes must agree with each other and
    the array must lie inside the data file (``data_size`` bytes), so a
    damaged index is refused before an array is allocated.
    """
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checkpoint {checkpoint!r} is corrupt: array {name!r} in its index {why}",
            checkpoint=checkpoint, file=file)

    try:
        dtype = _dtype_from_name(e["dtype"])
        shape = tuple(e["shape"])
        offset, nbytes = e["offset"], e["nbytes"]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise bad(f"is malformed ({type(err).__name__}: {err})") from None
    if not all(type(d) is int and d >= 0 for d in (*shape, offset, nbytes)):
        raise bad(f"has an invalid shape, offset or size ({shape}, {offset!r}, {nbytes!r})")
    expected = dtype.itemsize
    for d in shape:
        expected *= d
    if nbytes != expected:
        raise bad(f"records {nbytes} bytes for a {dtype.name} array of shape {shape} "
                  f"({expected} bytes)")
    if offset + nbytes > data_size:
        raise bad(f"lies beyond the end of the data file (bytes {offset}-{offset + nbytes} "
                  f"of {data_size})")
    return dtype, shape, offset, nbytes


def select_names(
    names: Iterable[str],
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
) -> list[str]:
    """Names matching any ``include`` glob (all when None) and no ``exclude`` glob."""
    inc = list(include) if include is not None else None
    exc = list(exclude or ())
    out = []
    for n in names:
        if inc is not None and not any(fnmatch.fnmatchcase(n, p) for p in inc):
            continue
        if any(fnmatch.fnmatchcase(n, p) for p in exc):
            continue
        out.append(n)
    return out


@_deprecation.renamed_fields(seconds="restore_s")
@dataclass(frozen=True)
class Restored:
    """What ``ArrayStore.restore`` read.

    Attributes:
        step: The checkpoint's step.
        arrays: The selected arrays (fresh host copies), by name.
        metadata: The JSON metadata saved with them.
        bytes_read: Array bytes read from disk (the index not counted).
        restore_s: Wall time of the restore, in seconds (``seconds`` until
            asyncckpt 0.2, deprecated).
    """

    step: int
    arrays: dict[str, np.ndarray]
    metadata: dict
    bytes_read: int
    restore_s: float


@dataclass
class _Entry:
    name: str
    buf: np.ndarray
    dtype: str
    shape: tuple[int, ...]


class _ArraysJob(SaveJob):
    """The format writer of one staged checkpoint: ``arrays.bin`` and ``index.json``."""

    def __init__(self, store: ArrayStore, step: int, entries: list[_Entry], metadata: dict):
        super().__init__(label=str(step), step=step,
                         nbytes=sum(e.buf.nbytes for e in entries),
                         transaction=store.transaction(step))
        self._store = store
        self._entries = entries
        self._metadata = metadata

    def write(self) -> None:
        self.transaction.begin()
        index = self._write_data()
        self._write_index(index)
        self._entries = []  # the slot is released after this returns

    def _write_data(self) -> dict[str, dict]:
        index: dict[str, dict] = {}
        pad = bytes(_ALIGN)
        files = self.transaction.files
        algorithm = files.algorithm
        update = fastcrc.updater(algorithm)

        def chunks():
            offset = 0
            for e in self._entries:
                gap = (-offset) % _ALIGN
                if gap:
                    yield pad[:gap]
                    offset += gap
                data = e.buf.reshape(-1).view(np.uint8)
                crc = update(data, 0)
                index[e.name] = {
                    "dtype": e.dtype,
                    "shape": list(e.shape),
                    "offset": offset,
                    "nbytes": int(data.nbytes),
                    algorithm: crc,  # "crc32c", or "crc32" (zlib)
                }
                # The file's checksum reuses a large array's instead of reading
                # it again; combining costs ~30 us, a small array's CRC less.
                yield Checksummed(data, crc) if data.nbytes >= _COMBINE_MIN else data
                offset += data.nbytes

        files.write(DATA_NAME, chunks())
        return index

    def _write_index(self, index: dict[str, dict]) -> None:
        body = {"format": _FORMAT, "arrays": index, "metadata": self._metadata}
        self.transaction.files.write(INDEX_NAME, [json.dumps(body, sort_keys=True).encode()])

    def after_commit(self, stats: SaveStats) -> None:
        """Published: retention, then the store's ``on_commit``."""
        self._store._after_commit(self.step, stats)


def _remove_step(steps: StepDirectory, directory: str, name: str) -> None:
    remove_dir(steps, os.path.join(directory, name))


def dropped_by_retention(steps: list[int], max_to_keep: int | None) -> list[int]:
    """The steps (oldest first) that retention drops: all but the newest ``max_to_keep``."""
    decision = retention.apply([retention.Candidate(str(s), s, 0.0) for s in steps],
                               retention.RetentionPolicy(max_to_keep=max_to_keep))
    return [c.step for c in decision.delete]


def host_view(value: Any) -> np.ndarray:
    """A NumPy view of an array-like where the framework allows, else the cheapest copy.

    TensorFlow variables and CPU tensors are viewed in place (a variable read
    aliases its buffer; ``_numpy()`` does not copy), Keras variables through
    their backend value, JAX CPU arrays by ``np.asarray``; the staging copy
    is then the only copy. Frameworks are looked up, never imported.
    """
    if type(value) is np.ndarray and value.flags.c_contiguous:
        return value  # already a host view (the Keras snapshot passes these)
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(value, keras.Variable):
        value = value.value
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        if isinstance(value, tf.Variable):
            value = value.value()
        if isinstance(value, tf.Tensor):
            if "CPU" not in value.device.upper():
                with tf.device("CPU:0"):
                    value = tf.identity(value)
            value = value._numpy()
    arr = np.asarray(value)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


class ArrayStore:
    """Numbered checkpoints of ``{name: array}`` plus JSON metadata.

    ``save`` copies every array into a host staging slot and returns; the
    engine's writer thread writes, checksums, fsyncs and publishes the step
    directory with one rename, then applies retention. ``restore`` reads the
    newest checkpoint that verifies (or a given step), optionally only the
    arrays selected by glob patterns, and reads only their bytes.

    Args:
        directory: Where step directories are written.
        max_to_keep: Checkpoints to keep (None keeps all); the newest is
            never deleted. Applied at each ``save()`` call, as the managers
            apply theirs: what it drops is deleted once the save is durable.
        options: Staging slots, fsync, checksums.
        name: Engine name for logs.
        on_commit: Called on the writer thread with ``(step, stats)`` after a
            checkpoint is published.

    The directory's checkpoints are kept by the engine's ``StepDirectory``
    (``_engine/steps.py``), shared with every store of the directory in the
    process: listing, reservations, retention, deletions and the lock.
    """

    job_class = _ArraysJob  # the background part of a save (tests subclass it to inject faults)

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 2,
        options: AsyncOptions | None = None,
        name: str = "asyncckpt.arrays",
        on_commit: Callable[[int, SaveStats], None] | None = None,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep = retention.check_max_to_keep(max_to_keep, allow_zero=False)
        self.options = options or AsyncOptions()
        self._engine = AsyncEngine(options=self.options, name=name)
        self._on_commit = on_commit
        self._steps, _ = shared("arrays", self.directory,
                                lambda: StepDirectory(self.directory, order=int))
        self._steps.join(self)
        self._policy = retention.RetentionPolicy(max_to_keep=self.max_to_keep)
        self._last: SaveHandle | None = None

    # -- listing -------------------------------------------------------------

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    @property
    def last_save(self) -> SaveHandle | None:
        return self._last

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    def transaction(self, step: int) -> Transaction:
        """The commit of a save of ``step``: its directory, renamed into place."""
        return Transaction(
            RenamedDirectory(self.step_dir(step), fsync=self.options.fsync),
            framework=FRAMEWORK, label=str(step), step=step,
            manifest_name=layout.JAX_MANIFEST_NAME, options=self.options)

    @staticmethod
    def committed_steps(directory: str) -> list[int]:
        """The step directories in ``directory``, oldest first (read only, no store)."""
        try:
            with os.scandir(directory) as entries:
                return sorted(int(e.name) for e in entries if e.name.isdigit() and e.is_dir())
        except FileNotFoundError:
            return []

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (temporaries and saves in flight are never listed,
        nor steps a save's retention dropped)."""
        steps = self._steps
        steps.sync(str(s) for s in self.committed_steps(self.directory))
        return [int(n) for n in steps.listed() if steps.is_committed(n)]

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- saving ----------------------------------------------------------------

    def save(
        self, step: int, arrays: Mapping[str, Any], metadata: dict | None = None, *,
        replaces: Iterable[int] = (),
    ) -> SaveHandle:
        """Stages ``arrays`` into host memory and writes them as ``step`` in the background.

        Args:
            step: Checkpoint number (a new one; existing steps are never
                overwritten).
            arrays: Names to array-likes (NumPy, JAX, TensorFlow tensors or
                variables); copied before this returns.
            metadata: JSON-serializable data committed with the arrays.
            replaces: Steps this one replaces (a backup taken again at the
                same position): deleted once it is durable.

        Returns:
            The save's handle (``result()`` waits until it is durable).
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        meta = json.loads(json.dumps(metadata or {}))
        self._engine.raise_pending_error()
        self.claim()
        steps, name = self._steps, str(step)
        with steps.lock:
            if os.path.lexists(self.step_dir(step)) or steps.in_flight(name):
                raise ValueError(f"step {step} already exists in {self.directory!r}")
            self.all_steps()  # the listing retention sees: what is on disk now
            res = steps.reserve(name, StepRecord(time.time()))
            steps.condemn(res, [str(int(s)) for s in replaces])
            if self.max_to_keep is not None:
                policy = self._policy
                steps.retain(res, lambda listed, last: retention.apply(
                    [retention.Candidate(n, int(n), rec.timestamp) for n, rec in listed],
                    policy, last_preserved_timestamp=last))

        def stage(slot: Slot) -> _ArraysJob:
            entries, pairs = [], []
            for key, value in arrays.items():
                src = host_view(value)
                buf = slot.buffer(key, src.shape, src.dtype)
                pairs.append((buf, src))
                entries.append(_Entry(key, buf, src.dtype.name, tuple(src.shape)))
            copy_arrays(pairs)
            return self.job_class(self, step, entries, meta)

        try:
            handle = self._engine.save(stage, label=str(step), step=step)
        except BaseException:
            steps.failed(res)
            raise
        steps.attach(res, handle.committed)
        remove = functools.partial(_remove_step, steps, self.directory)
        handle.committed.add_done_callback(
            lambda f: steps.committed(res, delete=remove) if f.exception() is None
            else steps.failed(res))
        self._last = handle
        return handle

    def delete(self, step: int) -> None:
        """Deletes a committed step now (renamed out of the listing, removed in the background)."""
        self.claim()
        self._steps.delete(str(int(step)), functools.partial(_remove_step, self._steps,
                                                             self.directory))

    def claim(self) -> None:
        """Takes the directory for this store's saves: its lock, stale temporaries removed.

        Done once, by the first ``save`` (or by a caller about to change the
        directory itself); later calls return at once.
        """
        self._steps.prepare()

    def _after_commit(self, step: int, stats: SaveStats) -> None:
        if self._on_commit is not None:
            self._on_commit(step, stats)

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Waits until every save is durable; re-raises background errors."""
        self._engine.wait_until_finished(timeout)

    sync = _deprecation.renamed_method("wait_until_finished", "sync", "ArrayStore")

    def close(self) -> None:
        """Flushes saves in flight, stops the writer and releases the directory."""
        try:
            self._engine.close()
            self._steps.removals.wait(None)
        finally:
            self._steps.leave(self)  # the last store of the directory releases its lock

    def delete_all(self) -> None:
        """Waits for saves in flight, then removes every checkpoint and the directory."""
        self._engine.wait_until_finished()
        self._steps.removals.wait(None)
        self._steps.leave(self)
        commit_lib.remove_tree(self.directory)
        self._steps.join(self)  # the store can save again (into a new directory)

    def __enter__(self) -> ArrayStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------

    def read_index(self, step: int) -> dict:
        """The index of a step: ``{"arrays": {...}, "metadata": {...}}``."""
        step_dir = self.step_dir(step)
        path = os.path.join(step_dir, INDEX_NAME)
        try:
            index = json.loads(contained.read_file(path, checkpoint=step_dir))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {step} in {self.directory!r}") from None
        except ValueError as e:
            raise CorruptCheckpointError(
                f"index {path!r} is unreadable: {e}", checkpoint=step_dir, file=path
            ) from e
        if not isinstance(index, dict) or not isinstance(index.get("arrays"), dict):
            raise CorruptCheckpointError(f"index {path!r} has no table of arrays",
                                         checkpoint=step_dir, file=path)
        return index

    def restore(
        self,
        step: int | None = None,
        *,
        include: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
    ) -> Restored:
        """Reads a checkpoint: ``step``, or the newest one that verifies.

        Only the arrays selected by ``include``/``exclude`` (glob patterns on
        names) are read, each checked against its own CRC32; file sizes are
        checked against the manifest, and each array's place in the data file
        against the data file before anything is allocated. A save of the step
        in flight in this process (for ``step=None``: every save) is waited
        for first, as the managers' restores wait.

        Raises:
            CheckpointNotFoundError: no checkpoint (or no such step).
            CorruptCheckpointError: ``step`` was given and does not verify.
        """
        if step is not None:
            self._wait_for(str(int(step)))
            return self._restore_step(int(step), include, exclude)
        self._wait_for(None)
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints in {self.directory!r}")
        errors = []
        for s in reversed(steps):
            try:
                return self._restore_step(s, include, exclude)
            except CorruptCheckpointError as e:
                logger.warning("checkpoint %d in %s does not verify (%s); trying an older one",
                               s, self.directory, e)
                errors.append(e)
        raise errors[0]

    def _wait_for(self, name: str | None) -> None:
        """Waits for the save of ``name`` (None: every save) in flight in this process, as
        the managers' restores do; a failed save is raised by the next save or ``wait``."""
        names = None if name is None else [name]
        if self._steps.futures(names):
            self._steps.wait_settled(names)

    def _restore_step(self, step: int, include, exclude) -> Restored:
        t0 = time.perf_counter()
        step_dir = self.step_dir(step)
        if not os.path.isdir(step_dir):
            raise CheckpointNotFoundError(f"no checkpoint {step} in {self.directory!r}")
        try:
            manifest = read_manifest(layout.jax_manifest_path(step_dir))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"checkpoint {step_dir!r} has no manifest", checkpoint=step_dir,
                file=layout.jax_manifest_path(step_dir)) from None
        verify_files(step_dir, manifest.files, checksums=False, checkpoint=step_dir)
        index = self.read_index(step)
        table = index["arrays"]
        names = select_names(table, include, exclude)
        arrays: dict[str, np.ndarray] = {}
        read = 0
        data_path = os.path.join(step_dir, DATA_NAME)
        try:
            fd = contained.open_regular(data_path, checkpoint=step_dir)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint {step_dir!r} is incomplete: its data file "
                                         f"{data_path!r} is missing", checkpoint=step_dir,
                                         file=data_path) from None
        try:
            data_size = os.fstat(fd).st_size
            checked = {name: _checked_entry(name, table[name], data_size, checkpoint=step_dir,
                                            file=os.path.join(step_dir, INDEX_NAME))
                       for name in names}
            for name in names:
                e = table[name]
                dtype, shape, offset, nbytes = checked[name]
                out = np.empty(nbytes, dtype=np.uint8)
                view = memoryview(out)
                got = 0
                while got < nbytes:
                    n = os.preadv(fd, [view[got:]], offset + got)
                    if n <= 0:
                        raise CorruptCheckpointError(
                            f"{data_path!r} ends inside array {name!r}",
                            checkpoint=step_dir, file=data_path)
                    got += n
                read += got
                algorithm = fastcrc.CRC32C if fastcrc.CRC32C in e else fastcrc.CRC32
                if fastcrc.updater(algorithm)(out, 0) != e.get(algorithm):
                    raise CorruptCheckpointError(
                        f"array {name!r} in {data_path!r} fails its {algorithm.upper()} check",
                        checkpoint=step_dir, file=data_path)
                arrays[name] = out.view(dtype).reshape(shape)
        finally:
            os.close(fd)
        return Restored(step, arrays, index.get("metadata", {}), read, time.perf_counter() - t0)
