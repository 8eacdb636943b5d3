"""How the arrays of a checkpoint item are read: chunk files, OCDBT values, or TensorStore.

asyncckpt reads uncompressed zarr arrays itself (``_format.ZarrArray``: zarr
v2 with no compressor, zarr v3 with no codec but ``bytes``, as asyncckpt
writes both): from chunk files, or, in an OCDBT database, from the byte
ranges of its data files that its B-tree names
(``asyncckpt._ocdbtindex.OcdbtIndex``, read through TensorStore's
``ocdbt.dump``, every file it names checked first), each file checked in the
same pass (``_chunks``). Compressed arrays and zarr v3 arrays with other
codecs (orbax's defaults: zstd; ``sharding_indexed``) are read through
TensorStore's zarr drivers (``TsArray``), the library orbax reads them
with, after the item's files are checked. ``ItemArrays`` picks the reader.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncckpt._ocdbtindex import Check, OcdbtIndex
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.jax import _format as fmt
from asyncckpt.jax._ocdbt import kvstore_spec, load_tensorstore


def _read_context() -> Any:
    # One per restored item: its arrays share the cache of B-tree nodes (as orbax's 100 MB).
    return load_tensorstore().Context({"file_io_concurrency": {"limit": 64},
                                  "cache_pool": {"total_bytes_limit": 100_000_000}})


class TsArray:
    """One array of an item, read through TensorStore (OCDBT or plain, any codec).

    The same reading interface as ``_format.ZarrArray``: ``shape``,
    ``dtype``, ``chunks``, ``read(index)``. Its files are checked as a whole
    (``chunk_paths`` is empty): OCDBT data files hold many arrays.

    Args:
        item_dir: The item's directory.
        param: The array's parameter name.
        checkpoint: For error messages.
        ocdbt: The item is an OCDBT database (else one directory per array).
        zarr3: The arrays are zarr v3 (orbax's ``use_zarr3``).
        context: A TensorStore context shared by the arrays of one restore.
    """

    compressed = False  # whatever the codec, TensorStore decodes it

    def __init__(self, item_dir: str, param: str, *, checkpoint: str, ocdbt: bool,
                 zarr3: bool = False, context: Any = None):
        ts = load_tensorstore()
        self.dir = os.path.join(item_dir, param)
        self._checkpoint = checkpoint
        if ocdbt:
            kvstore = {**kvstore_spec(item_dir), "path": f"{param}/",
                       "cache_pool": "cache_pool"}
        else:
            kvstore = {"driver": "file", "path": self.dir.rstrip("/") + "/"}
        spec = {"driver": "zarr3" if zarr3 else "zarr", "kvstore": kvstore,
                "recheck_cached_data": False, "recheck_cached_metadata": False,
                "fill_missing_data_reads": False}
        try:
            self._store = ts.open(spec, open=True, read=True,
                                  context=context or _read_context()).result()
        except (ValueError, RuntimeError) as e:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint!r}: array {param!r} of {item_dir!r} cannot be "
                f"opened: {e}", checkpoint=checkpoint, file=self.dir) from e
        self.shape = tuple(int(d) for d in self._store.shape)
        self.dtype = np.dtype(self._store.dtype.numpy_dtype)
        self.chunks = tuple(int(c) for c in self._store.chunk_layout.read_chunk.shape or ())

    def chunk_paths(self, index: tuple[slice, ...] | None = None) -> list[str]:
        return []

    def read(self, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Reads ``array[index]`` (unit-stride slices) into a host array."""
        view = self._store if index is None or not self.shape else self._store[index]
        try:
            return np.asarray(view.read().result())
        except (ValueError, RuntimeError) as e:
            raise CorruptCheckpointError(
                f"checkpoint {self._checkpoint!r} is corrupt: array {self.dir!r} cannot be "
                f"read: {e}", checkpoint=self._checkpoint, file=self.dir) from e


def _item_flags(item_dir: str, entries: Sequence[fmt.TreeEntry],
                index: OcdbtIndex | None, zarr3: bool) -> bool:
    """Whether an item's arrays must be read through TensorStore (not stored raw).

    Decided by its first array's metadata: an item is written by one library
    with one setting, so its arrays are all raw or none is.
    """
    name = fmt.metadata_name(zarr3=zarr3)
    for e in entries:
        if e.skipped:
            continue
        try:
            if index is not None:
                meta = index.get(f"{e.path.param}/{name}")
                if not isinstance(meta, bytes):
                    return True  # not where asyncckpt puts it: leave it to TensorStore
                return fmt.ZarrArray(os.path.join(item_dir, e.path.param), checkpoint=item_dir,
                                     metadata=meta, zarr3=zarr3).compressed
            return fmt.ZarrArray(os.path.join(item_dir, e.path.param),
                                 checkpoint=item_dir, zarr3=zarr3).compressed
        except CorruptCheckpointError:
            return False
    return False


class ItemArrays:
    """Opens the arrays of one item for reading, each at most once.

    Uncompressed zarr arrays (v2, or v3 as ``_METADATA``'s ``use_zarr3``
    says) are read by asyncckpt itself (``ZarrArray``): from their chunk
    files, or from an OCDBT database through its ``index`` (``ChunkReader``
    reads the byte ranges). Compressed ones and zarr v3 ones with other
    codecs (orbax's defaults) are read through TensorStore (``TsArray``).

    Args:
        item_dir: The item's directory.
        entries: Its tree metadata.
        checkpoint: For error messages.
        source: Reads (and checks) chunks by their file path (a ``ChunkReader``).
        check: Of an OCDBT database, every file its B-tree names, before it
            is read (``OcdbtIndex``; a restore's wants it in the manifest).

    Attributes:
        index: The item's ``OcdbtIndex``, when it is an OCDBT database.
        through_tensorstore: Its arrays are read through TensorStore.
    """

    def __init__(self, item_dir: str, entries: Sequence[fmt.TreeEntry], *, checkpoint: str,
                 source: fmt.ChunkSource = fmt.read_file_bytes, check: Check | None = None):
        self._dir = item_dir
        self._checkpoint = checkpoint
        self._source = source
        self._ocdbt = fmt.is_ocdbt(item_dir)
        self.index = (OcdbtIndex(item_dir, checkpoint=checkpoint, check=check) if self._ocdbt
                      else None)
        self._zarr3 = bool(fmt.tree_flag(item_dir, "use_zarr3"))
        self.through_tensorstore = _item_flags(item_dir, entries, self.index, self._zarr3)
        self._context: Any = None
        self._open: dict[str, Any] = {}

    def __call__(self, param: str) -> Any:
        """The array of ``param`` (a ``ZarrArray`` or a ``TsArray``)."""
        array = self._open.get(param)
        if array is None:
            path = os.path.join(self._dir, param)
            if self.through_tensorstore:
                if self._context is None:
                    self._context = _read_context()
                array = TsArray(self._dir, param, checkpoint=self._checkpoint,
                                ocdbt=self._ocdbt, zarr3=self._zarr3, context=self._context)
            elif self.index is not None:
                name = fmt.metadata_name(zarr3=self._zarr3)
                meta = self.index.get(f"{param}/{name}")
                if not isinstance(meta, bytes):
                    raise CorruptCheckpointError(
                        f"checkpoint {self._checkpoint!r} is incomplete: array {param!r} has "
                        f"no {name} in the OCDBT database {self._dir!r}",
                        checkpoint=self._checkpoint, file=os.path.join(self._dir, "manifest.ocdbt"))
                array = fmt.ZarrArray(path, checkpoint=self._checkpoint, source=self._source,
                                      metadata=meta, zarr3=self._zarr3)
            else:
                array = fmt.ZarrArray(path, checkpoint=self._checkpoint, source=self._source,
                                      zarr3=self._zarr3)
            self._open[param] = array
        return array
