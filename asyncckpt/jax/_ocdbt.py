"""orbax's OCDBT layout: written by asyncckpt, merged and read through TensorStore's driver.

With OCDBT an item directory holds a few large data files instead of one
file per array shard. The layout is orbax's (``orbax.checkpoint`` writes it
by default and reads it back); a checkpointer's pytree (item ``""``) has the
same files at the top of its path, as orbax's checkpointers lay them out::

    <step>/<item>/
        _METADATA                   tree metadata, "use_ocdbt": true
        _sharding                   shardings of the jax.Array leaves
        manifest.ocdbt              the merged database: a B-tree over every process's keys
        ocdbt_meta/<hash>           its B-tree nodes (several processes; one process's
                                    manifest.ocdbt names process 0's tree instead)
        ocdbt.process_<i>/          process i's own database
            manifest.ocdbt
            ocdbt_meta/<hash>       B-tree and version tree nodes (with small values inline)
            ocdbt_data/<hash>       data files: the values (array chunks)

B-tree nodes and values are kept in files apart, as orbax does with its
``store_ocdbt_metadata_and_values_separately`` setting (by default orbax
mixes both in ``d/``; it reads either): merging needs the nodes alone, so
process 0 can merge the databases of processes whose files it only has in
an object store by fetching their few small node files.

The keys of a database are the zarr keys of the non-OCDBT layout
(``<param>/.zarray``, ``<param>/<i>.<j>``; with zarr v3 ``<param>/zarr.json``,
``<param>/c/<i>/<j>``), so every array is still an uncompressed zarr array,
only stored inside OCDBT. Each process writes its
own database (``DatabaseWriter``), from the staged host buffers, on the
background writer thread, without TensorStore: its values with plain writes
into data files, its B-tree and manifest encoded by ``_ocdbtwrite``. With
several processes the primary then merges them through TensorStore
(``merge``: the parent database's B-tree refers to the children's data
files by relative path, which is why the step directory can be renamed into
place); one process writes the item's root manifest itself. The save
commits as any other (manifest with every file's checksum, one rename).

Reading goes through TensorStore's zarr driver over the same kvstore
(``_tsarrays``), which also reads orbax's own checkpoints.

TensorStore is imported when a merge or a restore needs it, not at import.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncckpt._engine import datafile
from asyncckpt._engine.files import DurableWriter
from asyncckpt._engine.metrics import OCDBT
from asyncckpt.jax import _ocdbtwrite
from asyncckpt.jax._format import in_item

logger = logging.getLogger(__name__)

PROCESS_PREFIX = "ocdbt.process_"
MANIFEST = "manifest.ocdbt"
# orbax's prefixes for B-tree nodes and values stored apart.
META_PREFIX = "ocdbt_meta/"
DATA_PREFIX = "ocdbt_data/"
# orbax's defaults for the target size of a data file: 2 GiB, 400 MiB on GCS.
DEFAULT_TARGET_DATA_FILE_SIZE = 2**31
GCS_TARGET_DATA_FILE_SIZE = 400 * 2**20
# orbax's OCDBT configuration: small values (the .zarray keys) inline in the
# B-tree, one root node for fast traversal, a single-file manifest.
MAX_INLINE_VALUE_BYTES = 1024
MAX_DECODED_NODE_BYTES = 100_000_000
_CONFIG = {"max_inline_value_bytes": MAX_INLINE_VALUE_BYTES,
           "max_decoded_node_bytes": MAX_DECODED_NODE_BYTES, "manifest_kind": "single"}


@dataclass(frozen=True, kw_only=True)
class FormatOptions:
    """How the arrays of a JAX checkpoint are stored on disk.

    Attributes:
        use_ocdbt: Store each pytree item in orbax's OCDBT format (a few data
            files per process, written through TensorStore; the default, as in
            orbax) instead of one zarr chunk file per array shard (False).
            orbax reads both, and so does asyncckpt whatever this says. The
            spelling of orbax's ``StandardCheckpointHandler`` /
            ``PyTreeCheckpointHandler(use_ocdbt=...)``, which the manager
            honours too when given as ``item_handlers``. OCDBT made saves
            durable 10x sooner than chunk files on this project's VM (fsyncs
            per file dominate there; ``benchmarks/archive/bench_jax_ocdbt.py``).
        ocdbt_target_data_file_size: With OCDBT, the size in bytes at which a
            data file is closed and the next one started; zarr chunks of
            larger shards are split so that each fits (as orbax does).
            None: orbax's default (2 GiB, 400 MiB for a ``gs://``
            directory); 0: no limit. A save's
            ``PyTreeSave(..., ocdbt_target_data_file_size=...)`` overrides it.
        use_zarr3: Store each array as zarr v3 (``zarr.json``, chunk keys
            ``c/<i>/<j>``) instead of zarr v2 (``.zarray``, ``<i>.<j>``; the
            default, as in orbax), in either layout. orbax reads both (it
            takes the driver from the checkpoint's ``_METADATA``), and so
            does asyncckpt. The spelling of orbax's
            ``PyTreeCheckpointHandler(use_zarr3=...)``, honoured too when
            given as ``item_handlers``. Chunks are uncompressed either way.
    """

    use_ocdbt: bool = True
    ocdbt_target_data_file_size: int | None = None
    use_zarr3: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.use_ocdbt, bool):
            raise TypeError(f"use_ocdbt must be a bool, got {self.use_ocdbt!r}")
        if not isinstance(self.use_zarr3, bool):
            raise TypeError(f"use_zarr3 must be a bool, got {self.use_zarr3!r}")
        check_target_size(self.ocdbt_target_data_file_size)

    def target_for(self, directory: str, override: int | None = None) -> int:
        """The target data file size of a save into ``directory`` (``override``: the save's)."""
        if override is not None:
            return override
        if self.ocdbt_target_data_file_size is not None:
            return self.ocdbt_target_data_file_size
        if str(directory).startswith("gs://"):
            return GCS_TARGET_DATA_FILE_SIZE
        return DEFAULT_TARGET_DATA_FILE_SIZE


def check_target_size(size: Any) -> None:
    """Raises ValueError unless ``size`` is None or an int >= 0 (orbax's rule)."""
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError("ocdbt_target_data_file_size must be an int >= 0 (0: no limit), got "
                         f"{size!r}")


def _handler_setting(handler: Any, name: str, default: bool | None, what: str) -> bool | None:
    """orbax's pytree handler setting ``name`` (kept on the ``PyTreeCheckpointHandler`` a
    ``StandardCheckpointHandler`` wraps); None for any other handler.

    Raises:
        ValueError: a pytree handler whose setting cannot be read.
    """
    kind = type(handler).__name__
    if kind not in ("StandardCheckpointHandler", "PyTreeCheckpointHandler"):
        return None
    value = getattr(getattr(handler, "_impl", handler), f"_{name}", default)
    if not isinstance(value, bool):
        raise ValueError(f"cannot tell whether {kind} {handler!r} writes {what} (this orbax "
                         f"version keeps {name} elsewhere); pass "
                         f"format_options=asyncckpt.jax.FormatOptions({name}=...) instead")
    return value


def handler_uses_ocdbt(handler: Any) -> bool | None:
    """Whether an orbax pytree handler instance writes OCDBT (None: not a pytree handler).

    Raises:
        ValueError: a pytree handler whose setting cannot be read.
    """
    return _handler_setting(handler, "use_ocdbt", None, "OCDBT")


def handler_uses_zarr3(handler: Any) -> bool | None:
    """Whether an orbax pytree handler instance writes zarr v3 (None: not a pytree handler).

    A ``StandardCheckpointHandler`` has no such option: False.

    Raises:
        ValueError: a pytree handler whose setting cannot be read.
    """
    return _handler_setting(handler, "use_zarr3", False, "zarr v3")


class ItemFormats:
    """Which pytree items of a manager's saves are stored as OCDBT, and how.

    Args:
        options: The manager's ``FormatOptions`` (None: the defaults).
        item_handlers: orbax handlers by item name, as the manager got them:
            a pytree handler's ``use_ocdbt`` and ``use_zarr3`` decide for its item.
        directory: The manager's directory (a ``gs://`` one has a smaller
            default target data file size, as in orbax).

    Raises:
        ValueError: ``options`` and a handler disagree on ``use_ocdbt`` or ``use_zarr3``.
    """

    def __init__(self, options: FormatOptions | None, item_handlers: Any, directory: str):
        self.options = options or FormatOptions()
        self._directory = directory
        self._by_item: dict[str, bool] = {}
        self._zarr3: dict[str, bool] = {}
        if isinstance(item_handlers, dict):
            for name, handler in item_handlers.items():
                value = handler_uses_ocdbt(handler)
                if value is None:
                    continue
                zarr3 = bool(handler_uses_zarr3(handler))
                for option, mine in (("use_ocdbt", value), ("use_zarr3", zarr3)):
                    given = None if options is None else getattr(options, option)
                    if given is not None and mine != given:
                        raise ValueError(
                            f"item {name!r}: its handler says {option}={mine}, format_options "
                            f"says {option}={given}; give one of them")
                self._by_item[name] = value
                self._zarr3[name] = zarr3

    def zarr3(self, item: str) -> bool:
        """Whether the arrays of ``item`` are stored as zarr v3 (else zarr v2)."""
        return self._zarr3.get(item, self.options.use_zarr3)

    def ocdbt_target(self, item: str, target_override: int | None = None) -> int | None:
        """How ``item`` is saved: None (zarr files), or in OCDBT with this target file size.

        ``target_override``: the save's own ``ocdbt_target_data_file_size``.
        An item saved as zarr files has no data files to size: a target
        given for it has nothing to apply to, as in orbax (MaxText passes
        one whatever its ``use_ocdbt``).
        """
        ocdbt = self._by_item.get(item, self.options.use_ocdbt)
        if not ocdbt:
            return None
        return self.options.target_for(self._directory, target_override)


def load_tensorstore() -> Any:
    """The ``tensorstore`` module, imported when a save or restore first needs it."""
    try:
        import tensorstore
    except ImportError as e:  # pragma: no cover - a dependency of orbax and of asyncckpt[jax]
        raise ImportError("OCDBT checkpoints need TensorStore: pip install tensorstore") from e
    return tensorstore


def kvstore_spec(path: str, *, target: int | None = None) -> dict:
    """The ``ocdbt`` kvstore spec of the database in directory ``path``.

    ``target`` (a data file size; writers only) adds orbax's write settings.
    """
    plain = {"driver": "file", "path": path.rstrip("/") + "/"}
    # Data files are written in place (no rename each): the commit rename of the
    # whole step directory is what makes them visible. (A merge copies from
    # databases whose base is set up alike: TensorStore requires it.)
    spec: dict[str, Any] = {"driver": "ocdbt",
                            "base": {**plain, "file_io_locking": {"mode": "non_atomic"}}}
    if target is not None:
        spec["manifest"] = plain
        spec["btree_node_data_prefix"] = META_PREFIX
        spec["version_tree_node_data_prefix"] = META_PREFIX
        spec["value_data_prefix"] = DATA_PREFIX
        spec["config"] = dict(_CONFIG)
        spec["assume_config"] = True
        spec["target_data_file_size"] = target
    return spec


def _write_context() -> Any:
    # asyncckpt fsyncs every file itself (DurableWriter.add_existing, on its
    # fsync thread while it checksums): TensorStore's own fsyncs would only repeat them.
    return load_tensorstore().Context({"file_io_sync": False, "file_io_concurrency": {"limit": 64}})


_OS_ERROR = re.compile(r"os_error_code='(\d+)'")


def wait(future: Any, what: str) -> Any:
    """The result of a TensorStore future; its I/O failures raised as ``OSError``.

    TensorStore reports a failed system call as a ``ValueError`` whose text
    carries the errno (``[os_error_code='28']``); callers see the ``OSError``
    a file write would have raised (``ENOSPC``, ``EIO``...), with TensorStore's
    message. Other errors pass unchanged.
    """
    try:
        return future.result()
    except (ValueError, RuntimeError) as e:
        m = _OS_ERROR.search(str(e))
        if m is None:
            raise
        raise OSError(int(m.group(1)), f"{what}: {e}") from e


def process_dir_name(process_index: int) -> str:
    return f"{PROCESS_PREFIX}{process_index}"


def held_copy_bytes(values: Iterable[tuple[str, int, bool]]) -> int:
    """Most bytes a ``DatabaseWriter`` holds copied while it writes ``values``.

    ``values``: ``(key, size, is_bytes)`` of each value of one item, in the
    order they are put. A value of ``MAX_INLINE_VALUE_BYTES`` or less is
    stored in its B-tree leaf: one from a staging buffer is copied at
    ``put`` and held until the leaf is written, at the commit (``bytes``
    values are held by the plan already). Larger values go from the
    staging buffer into a data file uncopied. The host memory budget
    counts this beside the slots (``Slot.reserve(beside=...)``).
    """
    return sum(n for _, n, is_bytes in values if n <= MAX_INLINE_VALUE_BYTES and not is_bytes)


class DatabaseWriter:
    """One process's OCDBT database of one item, written by asyncckpt from staged buffers.

    ``put`` takes each value: one of ``MAX_INLINE_VALUE_BYTES`` or less
    (array metadata, tiny chunks) is copied for its B-tree leaf; a larger one
    is kept as a view of its staging buffer. ``flush`` writes those into
    data files (``ocdbt_data/<random>``) with the engine's data-file writer
    (``_engine/datafile.py``: two threads, ``O_DIRECT`` where it pays) from
    the staging buffers, in ``put`` order, checksummed as they are written,
    each recorded in the save's ``DurableWriter``, which fsyncs it once with
    the save's other files; a new file starts where the next value would
    take one past ``target`` bytes. Once ``flush`` returns nothing refers
    to the staging buffers (the slot may be reused). ``finish`` encodes the
    database
    (``_ocdbtwrite``): its B-tree nodes in one node file
    (``ocdbt_meta/<random>``), its manifest; and, for a save of one process,
    the item's root manifest, which refers to this process's tree through
    its directory (no merge, no node file of its own). Every file goes
    through ``files``, so it is in the checkpoint's manifest.

    Args:
        step_root: The temporary step directory.
        item: The item's directory name (``""``: the pytree is the
            checkpoint's root, as a checkpointer writes it).
        process_index: This process (names its database directory).
        target: Target data file size (0: no limit).
        files: The save's file writer.
        pause: The engine's gate, called between the data files' ranges.
    """

    def __init__(self, step_root: str, item: str, process_index: int, *, target: int,
                 files: DurableWriter, pause: Callable[[], None] | None = None):
        self._pause = pause
        self._item = item
        self._dir = process_dir_name(process_index)
        self._rel = in_item(item, self._dir)
        # A file of the item (``<item>/<param>/<chunk>``) is the key ``<param>/<chunk>``.
        self.strip = len(in_item(item, ""))
        self._files = files
        self._target = target
        # Large values until ``flush``: (key, the caller's buffer, its bytes). Each
        # value's place below is a plain tuple of bytes and ints, as the encoder's
        # ``Value`` is: the garbage collector stops tracking such tuples, where
        # thousands of objects it tracks (memoryviews, dataclasses) kept for a
        # whole save were promoted to its oldest generation, and a state of 4,000
        # shards then paid a full collection (45 ms) every other save.
        self._pending: list[tuple[bytes, Any, int]] = []
        self._values: dict[bytes, _ocdbtwrite.Value] = {}
        self._data_files: list[str] = []  # relative to the database's directory
        self.keys = 0
        os.makedirs(os.path.join(step_root, *self._rel.split("/")), exist_ok=True)

    def put(self, key: str, data: Any) -> None:
        """Adds one value (bytes, or any buffer) under ``key``, relative to the item.

        A buffer larger than ``MAX_INLINE_VALUE_BYTES`` is read in place by
        the next ``flush``; it must not change before then. A file name
        relative to the step is the key ``name[self.strip:]``.
        """
        name = key.encode()
        view = memoryview(data).cast("B")
        size = len(view)
        if size <= MAX_INLINE_VALUE_BYTES:
            inline = data if isinstance(data, bytes) else view.tobytes()
            self._values[name] = (name, size, inline, 0, 0)
        else:
            self._pending.append((name, data, size))
        self.keys += 1

    def flush(self) -> None:
        """Writes the large values put so far: their buffers may change once this returns."""
        pending, self._pending = self._pending, []
        start = 0
        while start < len(pending):
            end, size = start, 0
            while end < len(pending) and (end == start or not self._target
                                          or size + pending[end][2] <= self._target):
                size += pending[end][2]
                end += 1
            index = len(self._data_files)
            name = f"{DATA_PREFIX}{uuid.uuid4().hex}"
            offset = 0
            for key, _, n in pending[start:end]:
                self._values[key] = (key, n, None, index, offset)
                offset += n
            self._write_data(f"{self._rel}/{name}", [d for _, d, _ in pending[start:end]])
            self._data_files.append(name)
            start = end

    def _write_data(self, name: str, views: list[Any]) -> None:
        """One data file: by the engine's data-file writer (two threads, ``O_DIRECT`` where it
        pays), or, without the native CRC32C it needs, as any file of the save."""
        files = self._files
        if not datafile.available():
            with files.kind("ocdbt data"):
                files.write(name, views)
            return
        written = datafile.write(files.prepare(name), [(0, v) for v in views], [False],
                                 pause=self._pause, phases=files.phases, kind="ocdbt data",
                                 mode=files.mode)
        files.add_existing(name, known=written.sums)

    def finish(self, *, root: bool = False) -> None:
        """Writes what is left, the B-tree and the manifest; ``root``: the item's too.

        ``root`` is for a save of one process: the item's ``manifest.ocdbt``
        then names this database's tree, as the merge of one database would.
        """
        self.flush()
        if not self._values:
            return
        t0 = time.perf_counter()
        values = [self._values[k] for k in sorted(self._values)]
        node_file = f"{META_PREFIX}{uuid.uuid4().hex}"
        nodes, tree = _ocdbtwrite.encode_tree(
            values, [("", n) for n in self._data_files], ("", node_file),
            MAX_DECODED_NODE_BYTES)
        now = time.time_ns()
        manifests = [(f"{self._rel}/{MANIFEST}", _ocdbtwrite.encode_manifest(
            _config(), tree, ("", node_file), now))]
        if root:
            manifests.append((in_item(self._item, MANIFEST), _ocdbtwrite.encode_manifest(
                _config(), tree, (f"{self._dir}/", node_file), now)))
        phases = self._files.phases
        phases.add(OCDBT, time.perf_counter() - t0)
        with self._files.kind("ocdbt b-tree"):
            self._files.write(f"{self._rel}/{node_file}", [nodes])
            for name, manifest in manifests:
                self._files.write(name, [manifest])


def _config() -> _ocdbtwrite.Config:
    """orbax's configuration of a new database (``_CONFIG``), nodes uncompressed."""
    return _ocdbtwrite.Config(uuid=os.urandom(16), max_inline_value_bytes=MAX_INLINE_VALUE_BYTES,
                              max_decoded_node_bytes=MAX_DECODED_NODE_BYTES)


def merge(step_root: str, item: str, *, files: DurableWriter) -> int:
    """Primary: merges every process's database of ``item`` into the item's root database.

    ``item`` ``""``: the databases are at the top of the step (a checkpointer's).

    The root's B-tree refers to the values in the processes' data files (by
    path relative to the item directory); only B-tree nodes are read and
    written. Records the root's files with ``files``. Returns the number of
    databases merged (none: nothing is written).
    """
    ts = load_tensorstore()
    item_dir = os.path.join(step_root, item)
    children = sorted(n for n in os.listdir(item_dir)
                      if n.startswith(PROCESS_PREFIX)
                      and os.path.exists(os.path.join(item_dir, n, MANIFEST)))
    if not children:
        return 0
    context = _write_context()
    parent = ts.KvStore.open(kvstore_spec(item_dir, target=DEFAULT_TARGET_DATA_FILE_SIZE),
                             context=context)
    opened = [ts.KvStore.open(kvstore_spec(os.path.join(item_dir, c)), context=context)
              for c in children]
    parent_kv = wait(parent, item_dir)
    txn = ts.Transaction(atomic=True)
    target = parent_kv.with_transaction(txn)
    copies = [wait(child, item_dir).experimental_copy_range_to(target) for child in opened]
    for c in copies:
        wait(c, item_dir)
    wait(txn.commit_async(), item_dir)
    files.add_existing(in_item(item, MANIFEST))
    for prefix in (META_PREFIX, DATA_PREFIX):
        sub = os.path.join(item_dir, prefix.rstrip("/"))
        if os.path.isdir(sub):
            for name in sorted(os.listdir(sub)):
                files.add_existing(in_item(item, f"{prefix}{name}"))
    return len(children)


def merge_inputs(names: Sequence[str]) -> list[str]:
    """Of a process's files (names relative to the step), those a merge reads.

    Its databases' manifests and B-tree nodes; not its data files.
    """
    return [n for n in names if PROCESS_PREFIX in n
            and (n.endswith(f"/{MANIFEST}") or f"/{META_PREFIX}" in n)]
