"""Arrays of a checkpoint item read through TensorStore: OCDBT, compressed or zarr v3.

asyncckpt reads the uncompressed zarr v2 chunk files it writes itself
(``_format.ZarrArray``, each file checked as it is read). Everything else an
item can hold, asyncckpt's OCDBT databases and orbax's own layouts (zstd
chunks, zarr v3, OCDBT), is read through TensorStore's zarr drivers
(``TsArray``), the library orbax reads them with; ``ItemArrays`` picks the
reader per item. The item's files are checked against the manifest before
(as a whole: one OCDBT data file holds many arrays).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

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


def uses_tensorstore(item_dir: str, entries: Sequence[fmt.TreeEntry]) -> bool:
    """Whether an item's arrays are read through TensorStore, not chunk file by chunk file.

    True for OCDBT (asyncckpt's or orbax's), zarr v3 and compressed zarr
    (orbax's defaults); false for the uncompressed zarr v2 files that
    ``_format.ZarrArray`` reads directly.
    """
    if fmt.is_ocdbt(item_dir) or fmt.tree_flag(item_dir, "use_zarr3"):
        return True
    for e in entries:
        if not e.skipped:
            try:
                return fmt.ZarrArray(os.path.join(item_dir, e.path.param),
                                     checkpoint=item_dir).compressed
            except CorruptCheckpointError:
                return False
    return False


class ItemArrays:
    """Opens the arrays of one item for reading, each at most once.

    Args:
        item_dir: The item's directory.
        entries: Its tree metadata.
        checkpoint: For error messages.
        source: Reads (and checks) chunk files, for the plain zarr layout.
    """

    def __init__(self, item_dir: str, entries: Sequence[fmt.TreeEntry], *, checkpoint: str,
                 source: fmt.ChunkSource = fmt.read_file_bytes):
        self._dir = item_dir
        self._checkpoint = checkpoint
        self._source = source
        self.through_tensorstore = uses_tensorstore(item_dir, entries)
        self._ocdbt = fmt.is_ocdbt(item_dir)
        self._zarr3 = bool(fmt.tree_flag(item_dir, "use_zarr3"))
        self._context: Any = None
        self._open: dict[str, Any] = {}

    def __call__(self, param: str) -> Any:
        """The array of ``param`` (a ``ZarrArray`` or a ``TsArray``)."""
        array = self._open.get(param)
        if array is None:
            if self.through_tensorstore:
                if self._context is None:
                    self._context = _read_context()
                array = TsArray(self._dir, param, checkpoint=self._checkpoint,
                                ocdbt=self._ocdbt, zarr3=self._zarr3, context=self._context)
            else:
                array = fmt.ZarrArray(os.path.join(self._dir, param),
                                      checkpoint=self._checkpoint, source=self._source)
            self._open[param] = array
        return array
