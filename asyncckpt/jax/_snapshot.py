"""Snapshot of a pytree into host staging buffers, planned once per tree shape.

A *plan* says, for every leaf, which of this process's shards become which
zarr chunk files, and holds the metadata files (``.zarray``, or zarr v3's
``zarr.json``, ``_METADATA``, ``_sharding``) already serialized. Building
it walks key paths and shardings, which costs far more than the copy for a
tree of many small leaves, so plans are cached by the tree's structure and
each leaf's type, shape, dtype and sharding: a steady training loop pays
only for the copy.

The copy itself starts every device-to-host transfer first
(``copy_to_host_async``), then copies each shard into a reused, aligned slot
buffer, large ones in parallel. On CPU ``np.asarray(shard)`` is a view of the
device buffer, which a donating ``jit`` overwrites: the explicit copy is what
makes the snapshot hold the values at the ``save()`` call.

On accelerators that have a ``pinned_host`` memory (GPUs), the transfer is
instead one ``jax.device_put`` of every leaf into pinned host memory, the
DMA engine's fast path (pageable transfers are an order of magnitude slower);
the chunk files are then written straight from those host arrays, which are
new buffers that no later device computation touches.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import operator
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from asyncckpt._engine._copy import copy_arrays, copy_columns
from asyncckpt._engine.slots import Slot
from asyncckpt.errors import UnsupportedLeafError, UnsupportedObjectError
from asyncckpt.jax import _format as fmt
from asyncckpt.jax import _tree
from asyncckpt.jax._ocdbt import held_copy_bytes

logger = logging.getLogger(__name__)

_SCALAR_DTYPES: dict[type, np.dtype] = {
    bool: np.dtype(np.bool_),
    int: np.dtype(np.int64),
    float: np.dtype(np.float64),
}


# How a chunk is staged (Plan.steps): a jax.Array shard copied from host memory
# (a view, or the result of its transfer), one already moved to pinned host
# memory (written from there), a NumPy array copied, a scalar set, a jax.Array
# on one CPU device copied from the view of the whole array.
_JAX, _PINNED, _NUMPY, _SCALAR, _WHOLE = range(5)


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk file this process writes for a leaf.

    Attributes:
        shard: Index into the leaf's ``addressable_shards``; -1 for a host value.
        file: Path relative to the item directory (``w/0.1``; zarr v3: ``w/c/0/1``).
        shape: Shape of the chunk on disk (zarr pads edge chunks to full size).
        region: Where the shard goes in the chunk when it is smaller (an
            uneven edge shard); None when it fills the chunk.
        source: The part of the shard (or host value) this chunk holds, when
            ``SaveArgs(chunk_byte_size=...)`` splits it into several chunks;
            None for the whole of it.
        pieces: OCDBT with chunks split to fit the target data file size: the
            chunk names (relative to the item) of the equal, contiguous runs
            of the staged bytes, in order (None for padding never written);
            None when the staged chunk is one zarr chunk.
    """

    shard: int
    file: str
    shape: tuple[int, ...]
    region: tuple[slice, ...] | None = None
    source: tuple[slice, ...] | None = None
    pieces: tuple[str | None, ...] | None = None


@dataclass(frozen=True)
class LeafPlan:
    """How one leaf is staged: ``kind`` is jax, numpy, scalar or empty.

    ``host_view`` marks a jax leaf whose shards live in host memory already
    (CPU devices): ``np.asarray`` of a shard is a view of its buffer, so no
    device-to-host transfer is started for it (``copy_to_host_async`` costs
    ~10 us per shard for nothing there).

    ``whole`` marks a host-view leaf on one device: its one chunk is the view
    of the whole array (``np.asarray(leaf)``), taken without building the
    shard's single-device array (``_arrays``) first.

    ``key_impl`` marks a typed PRNG key (``jax.random.key``): as orbax, its
    key data (``jax.random.key_data``, unsigned integers with the impl's
    trailing dimensions) is what is planned and written, and the impl's name
    is recorded in ``array_metadatas`` (``_format.array_metadatas_json``).
    """

    kind: str
    display: str
    dtype: np.dtype | None
    chunks: tuple[ChunkPlan, ...]
    pinned: Any = None  # the leaf's sharding in pinned host memory, when used
    host_view: bool = False
    whole: bool = False
    key_impl: str | None = None  # a typed PRNG key: its impl; its key data is written


@dataclass(frozen=True)
class Plan:
    """Everything about a save that depends only on the tree's shape.

    Attributes:
        leaves: One entry per leaf, in flatten order.
        metadata_files: ``(file, bytes)`` the primary process writes.
        entries: The tree metadata entries (for tests and inspection).
        chunked: Indices of the leaves that have chunk files here (the others
            are skipped by ``stage`` without a look).
        live: Indices of the ``jax.Array`` leaves among them (checked for
            donation before anything is copied).
        pinned: Indices of the leaves moved to pinned host memory.
        transfers: Indices of the leaves copied to host by an explicit
            device-to-host transfer (neither host memory already nor pinned).
        nbytes: Bytes of a save staged with this plan (chunks and metadata files).
        ocdbt_copy: Bytes an OCDBT writer holds copied beside the slot while it
            writes this plan's values (``_ocdbt.held_copy_bytes``): chunks
            small enough to be stored in the B-tree's leaves; none for
            larger chunks, written from the slot into data files.
        keys: Indices of the typed PRNG key leaves (staged as their key data).
    """

    leaves: tuple[LeafPlan, ...]
    metadata_files: tuple[tuple[str, bytes], ...]
    entries: tuple[fmt.TreeEntry, ...]
    _named: dict = field(default_factory=dict, compare=False, repr=False)
    chunked: tuple[int, ...] = field(init=False, compare=False, repr=False)
    live: tuple[int, ...] = field(init=False, compare=False, repr=False)
    pinned: tuple[int, ...] = field(init=False, compare=False, repr=False)
    transfers: tuple[int, ...] = field(init=False, compare=False, repr=False)
    nbytes: int = field(init=False, compare=False, repr=False)
    ocdbt_copy: int = field(init=False, compare=False, repr=False)
    keys: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(
            i for i, lp in enumerate(self.leaves) if lp.key_impl is not None))
        chunked = tuple(i for i, lp in enumerate(self.leaves) if lp.chunks)
        live = tuple(i for i in chunked if self.leaves[i].kind == "jax")
        pinned = tuple(i for i in live if self.leaves[i].pinned is not None)
        transfers = tuple(i for i in live
                          if self.leaves[i].pinned is None and not self.leaves[i].host_view)
        sizes = [math.prod(c.shape) * lp.dtype.itemsize  # type: ignore[union-attr]
                 for lp in self.leaves for c in lp.chunks]
        ocdbt_copy = held_copy_bytes(self._database_values())
        nbytes = sum(sizes) + sum(len(data) for _, data in self.metadata_files)
        for name, value in (("chunked", chunked), ("live", live), ("pinned", pinned),
                            ("transfers", transfers), ("nbytes", nbytes),
                            ("ocdbt_copy", ocdbt_copy)):
            object.__setattr__(self, name, value)

    def _database_values(self) -> Iterator[tuple[str, int, bool]]:
        """``(key, size, is_bytes)`` of what an OCDBT save of this plan puts, in order.

        As the writer puts them (``_job``): each chunk, or its pieces that
        are written (``ChunkPlan.pieces``), then the metadata files that are
        keys of the database (``<param>/.zarray``; the item's own files
        stay files).
        """
        for lp in self.leaves:
            for c in lp.chunks:
                nbytes = math.prod(c.shape) * lp.dtype.itemsize  # type: ignore[union-attr]
                if c.pieces is None:
                    yield c.file, nbytes, False
                    continue
                size = nbytes // len(c.pieces)
                for piece in c.pieces:
                    if piece is not None:
                        yield piece, size, False
        for name, data in self.metadata_files:
            if "/" in name:
                yield name, len(data), True

    @property
    def chunk_count(self) -> int:
        return sum(len(leaf.chunks) for leaf in self.leaves)

    def names(self, item: str) -> tuple[tuple[str, ...], ...]:
        """Each leaf's chunk file names under ``item``, built once per item.

        ``item`` ``""`` is the checkpoint's root: the pytree's files are not in
        a subdirectory (orbax's checkpointers write a path that way).
        """
        named = self._named.get(item)
        if named is None:
            prefix = f"{item}/" if item else ""
            named = tuple(tuple(prefix + c.file for c in lp.chunks) for lp in self.leaves)
            self._named[item] = named
        return named

    def steps(self, item: str) -> tuple[tuple, ...]:
        """One entry per chunk file under ``item``, in leaf order, built once per item.

        ``(leaf index, chunk index in the leaf, shard index, file, chunk shape,
        dtype, region, how it is staged, source)``: the stage loop reads each
        chunk's facts from one flat tuple instead of walking leaf and chunk plans.
        """
        key = ("steps", item)
        steps = self._named.get(key)
        if steps is None:
            names = self.names(item)
            out = []
            for i in self.chunked:
                lp = self.leaves[i]
                if lp.kind == "jax":
                    kind = _PINNED if lp.pinned is not None else _WHOLE if lp.whole else _JAX
                else:
                    kind = _NUMPY if lp.kind == "numpy" else _SCALAR
                for k, (c, name) in enumerate(zip(lp.chunks, names[i], strict=True)):
                    out.append((i, k, c.shard, name, c.shape, lp.dtype, c.region, kind,
                                c.source))
            steps = self._named[key] = tuple(out)
        return steps

    def columns(self, item: str) -> tuple[tuple, ...] | None:
        """``steps(item)`` by column when every chunk is a view of a jax.Array in
        host memory filling its chunk (CPU devices), else None; built once:
        ``(files, shapes, dtypes, leaf indices, shard indices, whole leaves,
        sharded leaves)``, staged by C-level ``map``s with no Python loop per
        chunk. A whole leaf (``_WHOLE``, shard index 0) is viewed whole.
        """
        key = ("columns", item)
        if key not in self._named:
            steps, columns = self.steps(item), None
            if steps and all(st[7] in (_WHOLE, _JAX) and st[6] is None and st[8] is None
                             and self.leaves[st[0]].host_view for st in steps):
                cols = tuple(zip(*steps, strict=True))  # (leaf, k, shard, file, shape, ...)
                whole = [st[7] == _WHOLE for st in steps]
                columns = (cols[3], cols[4], cols[5], cols[0],
                           tuple(0 if w else sh for w, sh in zip(whole, cols[2], strict=True)),
                           tuple(sorted({i for i, w in zip(cols[0], whole, strict=True) if w})),
                           tuple(sorted({i for i, w in zip(cols[0], whole, strict=True) if not w})))
            self._named[key] = columns
        return self._named[key]

    def splits(self, item: str) -> dict[str, tuple[str | None, ...]]:
        """Staged chunk name -> its pieces' names under ``item`` (chunks split for OCDBT)."""
        key = ("splits", item)
        splits = self._named.get(key)
        if splits is None:
            splits = {fmt.in_item(item, c.file): tuple(None if p is None
                                                       else fmt.in_item(item, p)
                                                       for p in c.pieces)
                      for lp in self.leaves for c in lp.chunks if c.pieces is not None}
            self._named[key] = splits
        return splits

    def staging_layout(self, item: str) -> dict[str, int]:
        """Byte size of each staging buffer a save under ``item`` takes, by file."""
        return {st[3]: math.prod(st[4]) * st[5].itemsize
                for st in self.steps(item) if st[7] != _PINNED}

    def metadata_for(self, item: str) -> tuple[tuple[str, bytes], ...]:
        """``metadata_files`` named under ``item``, built once per item."""
        key = ("metadata", item)
        named = self._named.get(key)
        if named is None:
            prefix = f"{item}/" if item else ""
            named = tuple((prefix + name, data) for name, data in self.metadata_files)
            self._named[key] = named
        return named


@dataclass(frozen=True)
class StagedTree:
    """One save's bytes in host memory: chunk files and metadata files.

    File names are relative to the step directory (``default/w/0.1``).

    Attributes:
        chunks: ``(file, host array)``: slot buffers, or views of ``keepalive``.
        metadata_files: ``(file, bytes)`` written by the primary.
        keepalive: Host-memory arrays the views in ``chunks`` belong to.
        size: The bytes of both when known in advance (a plan's); -1 to count them.
        splits: Chunks stored as several zarr chunks (OCDBT): staged name ->
            the names of its equal, contiguous pieces (see ``ChunkPlan.pieces``).
    """

    chunks: tuple[tuple[str, np.ndarray], ...]
    metadata_files: tuple[tuple[str, bytes], ...]
    keepalive: tuple[Any, ...] = ()
    size: int = field(default=-1, compare=False, repr=False)
    splits: Mapping[str, tuple[str | None, ...]] = field(default_factory=dict, compare=False,
                                                         repr=False)

    @property
    def nbytes(self) -> int:
        if self.size >= 0:
            return self.size
        return sum(b.nbytes for _, b in self.chunks) + sum(len(b) for _, b in self.metadata_files)

    @staticmethod
    def combine(trees: Sequence[StagedTree]) -> StagedTree:
        """Several items' staged files as one save."""
        if len(trees) == 1:
            return trees[0]
        return StagedTree(
            tuple(c for t in trees for c in t.chunks),
            tuple(m for t in trees for m in t.metadata_files),
            tuple(k for t in trees for k in t.keepalive),
            splits={k: v for t in trees for k, v in t.splits.items()},
        )


def _kind(leaf: Any) -> str:
    if isinstance(leaf, jax.Array):
        return "jax"
    if isinstance(leaf, np.ndarray):
        return "numpy"
    if isinstance(leaf, np.generic):
        return "npscalar"
    if type(leaf) in _SCALAR_DTYPES:
        return "scalar"
    if _tree.is_empty_leaf(leaf):
        return "empty"
    return "unsupported"


try:  # the concrete jax.Array class: checked first, by identity (the common leaf)
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover - a JAX version that moved it: the generic path
    _ArrayImpl = None


# (aval, sharding) read in C (``sharding`` is a property returning ``_sharding``).
_aval_sharding = (operator.attrgetter("aval", "_sharding")
                  if _ArrayImpl is not None and hasattr(_ArrayImpl, "_sharding") else None)


def _signature(leaf: Any) -> tuple:
    """What a cached plan depends on for one leaf: its type, shape, dtype, sharding.

    A ``jax.Array``'s ``aval`` carries its shape, dtype and weak type in one
    hashable object, compared and hashed faster than the three separately
    (a hundred leaves are checked on every save).
    """
    if type(leaf) is _ArrayImpl:
        return (_ArrayImpl, leaf.aval, leaf.sharding)
    kind = _kind(leaf)
    if kind == "jax":
        return (kind, leaf.shape, leaf.dtype, leaf.sharding)
    if kind == "numpy":
        return (kind, leaf.shape, leaf.dtype)
    if kind == "npscalar":
        return (kind, leaf.dtype)
    return (kind, type(leaf))


def _chunk_grid(leaf: jax.Array, display: str) -> tuple[int, ...]:
    """The zarr chunk shape of a sharded array: its largest shard.

    Uses the global device -> index map, so every process computes the same
    chunk shape whatever shards it holds.
    """
    shape = leaf.shape
    if not shape:
        return ()
    indices = leaf.sharding.devices_indices_map(shape).values()
    chunk = [1] * len(shape)
    starts: list[list[int]] = [[] for _ in shape]
    for index in indices:
        for d, (s, dim) in enumerate(zip(index, shape, strict=True)):
            a, b, _ = s.indices(dim)
            chunk[d] = max(chunk[d], b - a)
            starts[d].append(a)
    for d, c in enumerate(chunk):
        if any(a % c for a in starts[d]):
            raise UnsupportedObjectError(
                f"leaf {display} has shards that do not start on a regular grid "
                f"(dimension {d}: starts {sorted(set(starts[d]))}, shard size {c}); "
                "reshard it onto a mesh before saving"
            )
    return tuple(chunk)


def _pinned_sharding(leaf: jax.Array) -> Any:
    """The leaf's sharding in pinned host memory, on backends where that is fast."""
    device = next(iter(leaf.sharding.device_set))
    if device.platform == "cpu":
        return None  # host memory already: the slot copy is the snapshot
    try:
        kinds = {m.kind for m in device.addressable_memories()}
        if "pinned_host" not in kinds:
            return None
        return leaf.sharding.with_memory_kind("pinned_host")
    except (AttributeError, NotImplementedError, ValueError):
        return None


def _split(origin: Sequence[int], size: Sequence[int], write: Sequence[int],
           disk: Sequence[int], shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple]]:
    """The chunks of ``disk`` shape a shard at ``origin`` of ``size`` (in a
    ``write``-shaped grid cell) is written as: ``(chunk coordinates, (lo, hi)
    of the shard's part in it per dimension)``. Chunks past the array's end
    are not written (zarr has none there)."""
    per_dim = []
    for a, n, w, c, dim in zip(origin, size, write, disk, shape, strict=True):
        starts = range(a, min(a + w, dim), c)
        per_dim.append([(s // c, (s - a, min(s + c, a + n) - a)) for s in starts])
    return [(tuple(p[0] for p in combo), tuple(p[1] for p in combo))
            for combo in itertools.product(*per_dim)]


def _chunk_plans(shard: int, param: str, origin: Sequence[int], size: tuple[int, ...],
                 write: tuple[int, ...], disk: tuple[int, ...], shape: Sequence[int],
                 zarr3: bool = False) -> list[ChunkPlan]:
    """The chunk files of one shard; with ``disk == write`` (no ``chunk_byte_size``) the one
    chunk of the shard, as before."""
    plans = []
    for coords, parts in _split(origin, size, write, disk, shape):
        extent = tuple(hi - lo for lo, hi in parts)
        region = None if extent == disk else tuple(slice(0, n) for n in extent)
        source = (None if extent == size
                  else tuple(slice(lo, hi) for lo, hi in parts))
        plans.append(ChunkPlan(shard, f"{param}/{fmt.chunk_name(coords, zarr3=zarr3)}", disk,
                               region, source))
    return plans


def _plan_jax_leaf(
    leaf: jax.Array, path: _tree.LeafPath, files: list, shardings: dict,
    sub: tuple[int | None, tuple[int, ...], int] | None = None, ocdbt: int | None = None,
    zarr3: bool = False,
) -> tuple[LeafPlan, fmt.TreeEntry]:
    display = path.display
    if leaf.is_deleted():
        raise UnsupportedObjectError(f"leaf {display} is a deleted (donated) jax.Array")
    key_impl = None
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        # As orbax: the key data is written, the impl recorded beside it.
        key_impl = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
    elif jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
        raise UnsupportedLeafError(
            f"leaf {display} has the extended dtype {leaf.dtype}, which neither orbax nor "
            "asyncckpt writes (typed PRNG keys are written as their key data)")
    dtype = np.dtype(leaf.dtype)
    zdtype = fmt.array_dtype(dtype, what=f"leaf {display}", zarr3=zarr3)
    chunk = _chunk_grid(leaf, display)
    staged_chunk = tuple(max(1, c) for c in chunk)
    if sub is not None and chunk:  # SaveArgs chunking: each disk chunk a chunk plan of its own
        size, axes, itemsize = sub
        disk_chunk = fmt.sub_chunk_shape(leaf.shape, chunk, itemsize, size, axes)
    else:  # OCDBT may split a staged chunk into pieces that fit its data files
        sub = None
        disk_chunk = fmt.split_chunk(staged_chunk, dtype.itemsize, ocdbt)
    chunks: list[ChunkPlan] = []
    if 0 not in leaf.shape:
        for i, shard in enumerate(leaf.addressable_shards):
            if shard.replica_id != 0:
                continue  # another device (maybe another process) writes this data
            bounds = [s.indices(d)[:2] for s, d in zip(shard.index, leaf.shape, strict=True)]
            size = tuple(b - a for a, b in bounds)
            if sub is not None:
                chunks += _chunk_plans(i, path.param, [a for a, _ in bounds], size, chunk,
                                       disk_chunk, leaf.shape, zarr3)
                continue
            coords = tuple(a // c for (a, _), c in zip(bounds, chunk, strict=True))
            region = None if size == chunk else tuple(slice(0, n) for n in size)
            file = f"{path.param}/{fmt.chunk_name(coords, zarr3=zarr3)}"
            chunks.append(ChunkPlan(i, file, chunk, region, pieces=_pieces(
                path, staged_chunk, disk_chunk, coords, leaf.shape, zarr3)))
    files.append((f"{path.param}/{fmt.metadata_name(zarr3=zarr3)}",
                  fmt.array_json(leaf.shape, disk_chunk, zdtype, zarr3=zarr3)))
    shardings[path.param] = fmt.sharding_json(leaf.sharding)
    entry = fmt.TreeEntry(path, fmt.JAX_ARRAY, chunk)
    pinned = _pinned_sharding(leaf) if chunks else None
    if any(c.region is not None or c.source is not None for c in chunks):
        pinned = None  # edge chunks need padding, parts need cutting: copy into slot buffers
    devices = leaf.sharding.device_set
    host_view = all(d.platform == "cpu" for d in devices)
    whole = (host_view and len(devices) == 1 and len(chunks) == 1 and chunks[0].region is None
             and chunks[0].source is None)
    return LeafPlan("jax", display, dtype, tuple(chunks), pinned, host_view, whole,
                    key_impl), entry


def _pieces(path: _tree.LeafPath, chunk: tuple[int, ...], disk_chunk: tuple[int, ...],
            coords: tuple[int, ...], shape: tuple[int, ...],
            zarr3: bool = False) -> tuple[str | None, ...] | None:
    """``ChunkPlan.pieces`` of a staged chunk (None: stored as one zarr chunk)."""
    if disk_chunk == chunk:
        return None
    return tuple(None if n is None else f"{path.param}/{n}"
                 for n in fmt.chunk_pieces(chunk, disk_chunk, coords, shape, zarr3=zarr3))


def _plan_host_leaf(
    leaf: Any, kind: str, path: _tree.LeafPath, files: list, primary: bool,
    sub: tuple[int | None, tuple[int, ...], int] | None = None, ocdbt: int | None = None,
    zarr3: bool = False,
) -> tuple[LeafPlan, fmt.TreeEntry]:
    display = path.display
    if kind == "scalar":
        dtype, shape, value_type = _SCALAR_DTYPES[type(leaf)], (), fmt.SCALAR
    else:  # a NumPy array or NumPy scalar: orbax stores both as np.ndarray
        dtype, shape, value_type = np.dtype(leaf.dtype), tuple(leaf.shape), fmt.NUMPY_ARRAY
    zdtype = fmt.array_dtype(dtype, what=f"leaf {display}", zarr3=zarr3)
    staged_chunk = tuple(max(1, d) for d in shape)
    if sub is not None and shape:
        size, axes, itemsize = sub
        disk_chunk = fmt.sub_chunk_shape(shape, shape, itemsize, size, axes)
    else:
        sub = None
        disk_chunk = fmt.split_chunk(staged_chunk, dtype.itemsize, ocdbt)
    chunks: tuple[ChunkPlan, ...] = ()
    # Host values are the same on every process; the primary writes them.
    if primary and 0 not in shape:
        coords = (0,) * len(shape)
        if sub is None:
            chunks = (ChunkPlan(-1, f"{path.param}/{fmt.chunk_name(coords, zarr3=zarr3)}", shape,
                                None, pieces=_pieces(path, staged_chunk, disk_chunk, coords,
                                                     shape, zarr3)),)
        else:
            chunks = tuple(_chunk_plans(-1, path.param, coords, shape, shape, disk_chunk, shape,
                                        zarr3))
    files.append((f"{path.param}/{fmt.metadata_name(zarr3=zarr3)}",
                  fmt.array_json(shape, disk_chunk, zdtype, zarr3=zarr3)))
    return LeafPlan(kind, display, dtype, chunks), fmt.TreeEntry(path, value_type)


def build_plan(tree: Any, leaves: list[Any], *, primary: bool,
               chunking: tuple | None = None, ocdbt: int | None = None,
               zarr3: bool = False) -> Plan:
    """Plans the save of ``tree`` (whose flattened leaves are ``leaves``).

    ``chunking``: per leaf, ``(chunk_byte_size, shard_axes, itemsize)`` of its
    ``SaveArgs`` or None (see ``_args.SaveItem``); None: every leaf written as it is.
    ``ocdbt``: None for the plain zarr layout; for OCDBT, the target data file
    size (0: no limit), which zarr chunks are split to fit (leaves chunked by
    their ``SaveArgs`` keep those chunks).
    ``zarr3``: the arrays are zarr v3 (orbax's ``use_zarr3``), else zarr v2.

    Raises:
        UnsupportedObjectError: a leaf's type, dtype, name or sharding cannot
            be stored in the orbax layout.
    """
    paths = _tree.leaf_paths(tree)
    files: list[tuple[str, str]] = []
    shardings: dict[str, str | None] = {}
    plans, entries = [], []
    subs = chunking or (None,) * len(leaves)
    if len(subs) != len(leaves):
        raise ValueError(f"a chunking of {len(subs)} leaves for a tree of {len(leaves)}")
    for leaf, path, sub in zip(leaves, paths, subs, strict=True):
        kind = _kind(leaf)
        if kind == "jax":
            plan, entry = _plan_jax_leaf(leaf, path, files, shardings, sub, ocdbt, zarr3)
        elif kind in ("numpy", "npscalar", "scalar"):
            plan, entry = _plan_host_leaf(leaf, kind, path, files, primary, sub, ocdbt, zarr3)
        elif kind == "empty":
            plan = LeafPlan("empty", path.display, None, ())
            entry = fmt.TreeEntry(path, _tree.empty_type_name(leaf) or "None")
        else:
            raise UnsupportedLeafError(
                f"leaf {path.display} is a {type(leaf).__module__}.{type(leaf).__qualname__}; "
                "asyncckpt.jax saves jax.Array, NumPy arrays and scalars, and Python "
                "bool/int/float (convert other values, or keep them out of the saved state)"
            )
        plans.append(plan)
        entries.append(entry)
    files.append((fmt.TREE_METADATA,
                  fmt.tree_metadata_json(entries, use_ocdbt=ocdbt is not None,
                                         use_zarr3=zarr3)))
    # orbax reads _sharding only if every jax.Array leaf is described in it.
    if shardings and all(v is not None for v in shardings.values()):
        files.append((fmt.SHARDING_FILE, fmt.sharding_file_json(shardings)))  # type: ignore[arg-type]
    if any(p.key_impl is not None for p in plans):  # orbax finds a key's impl there
        files.append(fmt.array_metadatas_file(
            [(e.path.param, e.write_shape, _disk_chunk(files, e.path.param), p.key_impl)
             for p, e in zip(plans, entries, strict=True) if p.kind == "jax"]))
    metadata = tuple((name, text.encode()) for name, text in files) if primary else ()
    return Plan(tuple(plans), metadata, tuple(entries))


class Snapshotter:
    """Stages pytrees into slots, with a small cache of plans.

    Args:
        primary: Whether this process writes the metadata files and host values.
        cache_size: Plans kept (one per distinct tree shape seen recently).
    """

    def __init__(self, *, primary: bool, cache_size: int = 8):
        self._primary = primary
        self._cache: OrderedDict[tuple, Plan] = OrderedDict()
        self._cache_size = cache_size
        # Plain tree definition -> whether the tree has empty subtrees (see _flatten).
        self._has_empty: OrderedDict[Any, bool] = OrderedDict()
        # The plan used last, for a tree without empty subtrees (see ``plan``):
        # (plain tree definition, leaf signatures, plan, and when every leaf is
        # a jax.Array: (leaf types, each leaf's (aval, sharding)), its layout,
        # whether it is zarr v3).
        self._last: tuple[Any, tuple, Plan, tuple | None, int | None, bool] | None = None

    def _flatten(self, tree: Any) -> tuple[list[Any], Any, bool]:
        """``_tree.flatten(tree)``, without its per-node Python callback where possible.

        ``_tree.flatten`` makes empty subtrees (None, ``{}``, ``[]``, ``()``)
        leaves, as orbax records them, through an ``is_leaf`` callback that
        costs a Python call per node. A plain flatten gives the same leaves
        unless the tree has an empty subtree, and whether it has one is fixed
        by its plain tree definition (which records None and empty containers
        as nodes): that is learnt once per definition, by comparing the leaf
        counts of the two flattens (each empty subtree is one leaf more in the
        second). Also returns whether the tree has an empty subtree.
        """
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        has_empty = self._has_empty.get(treedef)
        if has_empty is None:
            full, full_def = _tree.flatten(tree)
            has_empty = len(full) != len(leaves)
            self._has_empty[treedef] = has_empty
            while len(self._has_empty) > self._cache_size:
                self._has_empty.popitem(last=False)
            return full, full_def, has_empty
        if has_empty:
            return *_tree.flatten(tree), True
        return leaves, treedef, False

    def plan(self, tree: Any, chunking: tuple | None = None,
             ocdbt: int | None = None, *, zarr3: bool = False) -> tuple[Plan, list[Any]]:
        """The plan for ``tree`` (cached) and its flattened leaves.

        ``ocdbt``, ``zarr3``: the layout, as ``build_plan`` takes it (None:
        plain zarr files; False: zarr v2).

        The plan used last is checked first, comparing (not hashing) the tree
        definition and leaf signatures, mostly the same objects from save to
        save (a ``jit``'s outputs share aval and sharding objects). A tree with
        empty subtrees takes the general path (its full definition differs).
        ``chunking`` (``SaveArgs`` chunking, per leaf) is part of the plan's key.
        """
        plan, leaves = self._plan(tree, chunking, ocdbt, zarr3)
        if plan.keys:  # typed PRNG keys are staged as their key data (no copy: a view)
            leaves = list(leaves)
            for i in plan.keys:
                leaves[i] = jax.random.key_data(leaves[i])
        return plan, leaves

    def _plan(self, tree: Any, chunking: tuple | None, ocdbt: int | None,
              zarr3: bool) -> tuple[Plan, list[Any]]:
        if chunking is not None:
            return self._plan_general(tree, chunking, ocdbt, zarr3)
        last = self._last
        if last is not None and last[4] == ocdbt and last[5] == zarr3:
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            if treedef == last[0]:
                arrays = last[3]
                if arrays is not None:  # jax.Arrays only: their signatures, compared in C
                    if (tuple(map(type, leaves)) == arrays[0]
                            and tuple(map(_aval_sharding, leaves)) == arrays[1]):
                        return last[2], leaves
                elif tuple(map(_signature, leaves)) == last[1]:
                    return last[2], leaves
        return self._plan_general(tree, None, ocdbt, zarr3)

    def _plan_general(self, tree: Any, chunking: tuple | None,
                      ocdbt: int | None, zarr3: bool) -> tuple[Plan, list[Any]]:
        leaves, treedef, has_empty = self._flatten(tree)
        sigs = tuple(map(_signature, leaves))
        key = ((treedef, sigs, ocdbt, zarr3) if chunking is None
               else (treedef, sigs, ocdbt, zarr3, chunking))
        plan = self._cache.get(key)
        if plan is None:
            plan = build_plan(tree, leaves, primary=self._primary, chunking=chunking, ocdbt=ocdbt,
                              zarr3=zarr3)
            self._cache[key] = plan
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            logger.debug("planned a save of %d leaves (%d chunk files)",
                         len(leaves), plan.chunk_count)
        else:
            self._cache.move_to_end(key)
        arrays = None
        if _aval_sharding is not None and all(s[0] is _ArrayImpl for s in sigs):
            arrays = (tuple(map(type, leaves)), tuple(s[1:] for s in sigs))
        self._last = (None if has_empty or chunking is not None
                      else (treedef, sigs, plan, arrays, ocdbt, zarr3))
        return plan, leaves

    def stage(self, tree: Any, slot: Slot, *, item: str = fmt.ITEM,
              chunking: tuple | None = None, ocdbt: int | None = None,
              zarr3: bool = False) -> StagedTree:
        """Copies this process's part of ``tree`` into ``slot``'s buffers.

        Returns once every value is in host memory that nothing else
        references: the caller may donate, delete or update the arrays.

        Args:
            tree: The pytree.
            slot: Staging buffers, reused from save to save by file name.
            item: The item directory the files go in (several items share a
                slot); ``""`` puts them at the checkpoint's root.
            chunking: ``SaveArgs`` chunking per leaf (see ``plan``).
            ocdbt: The layout (None: plain zarr; else OCDBT, see ``build_plan``).
            zarr3: The arrays are zarr v3 (orbax's ``use_zarr3``), else v2.
        """
        plan, leaves = self.plan(tree, chunking, ocdbt, zarr3=zarr3)
        # Over the host memory budget: raises, nothing allocated.
        slot.reserve(plan.nbytes, beside=0 if ocdbt is None else plan.ocdbt_copy)
        plan_leaves = plan.leaves
        live = plan.live
        if live and any(map(_is_deleted, map(leaves.__getitem__, live))):
            i = next(i for i in live if leaves[i].is_deleted())
            raise UnsupportedObjectError(
                f"leaf {plan_leaves[i].display} is a deleted (donated) jax.Array")
        columns = plan.columns(item)
        if columns is not None:  # jax.Arrays on CPU devices: views of them, copied
            files, shapes, dtypes, index, shards, whole, sharded = columns
            buffers = slot.buffers(files, shapes, dtypes)  # the plan's own tuples: cached
            if sharded:  # each leaf: its shards' arrays, or itself whole
                held = {i: (leaves[i],) for i in whole}
                held.update({i: _shard_arrays(leaves[i]) for i in sharded})
                arrays = map(operator.getitem, map(held.__getitem__, index), shards)
            else:
                arrays = map(leaves.__getitem__, index)
            # The arrays themselves, as a column: each is viewed only when copied
            # (``copy_columns``).
            copy_columns(buffers, list(arrays))
            return StagedTree(tuple(zip(files, buffers, strict=True)), plan.metadata_for(item), (),
                              plan.nbytes, plan.splits(item))
        # 1. Start every device-to-host transfer before waiting on any.
        pinned: dict[int, Any] = {}
        if plan.pinned:
            moved = jax.device_put([leaves[i] for i in plan.pinned],
                                   [plan_leaves[i].pinned for i in plan.pinned])
            pinned = dict(zip(plan.pinned, moved, strict=True))
        transferring: dict[int, list[Any]] = {}
        for i in plan.transfers:
            shards = _shard_arrays(leaves[i])
            datas = [shards[c.shard] for c in plan_leaves[i].chunks]
            for d in datas:
                d.copy_to_host_async()
            transferring[i] = datas
        # 2. Copy into reused slot buffers (waiting for each transfer as needed).
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        chunks: list[tuple[str, np.ndarray]] = []
        buffer = slot.buffer
        last, sources, by_chunk = -1, None, False
        for i, k, shard, name, shape, dtype, region, kind, part in plan.steps(item):
            if kind == _PINNED:  # written from the pinned host copy itself
                if i != last:
                    last, sources, by_chunk = i, pinned[i].addressable_shards, False
                chunks.append((name, np.asarray(sources[shard].data)))
                continue
            buf = buffer(name, shape, dtype)
            chunks.append((name, buf))
            if kind == _WHOLE:
                pairs.append((buf, np.asarray(leaves[i])))
            elif kind == _JAX:
                if i != last:  # a new leaf: its transfers (by chunk) or its shards
                    last = i
                    sources = transferring.get(i)
                    by_chunk = sources is not None
                    if not by_chunk:  # host memory already (CPU): views, no transfer
                        sources = _shard_arrays(leaves[i])
                data = np.asarray(sources[k] if by_chunk else sources[shard])
                pairs.append((buf if region is None else buf[region],
                              data if part is None else data[part]))
            elif kind == _NUMPY:
                pairs.append((buf, leaves[i] if part is None else leaves[i][part]))
            else:
                _set_scalar(buf, leaves[i], plan_leaves[i])
        copy_arrays(pairs)
        return StagedTree(tuple(chunks), plan.metadata_for(item), tuple(pinned.values()),
                          plan.nbytes, plan.splits(item))


_is_deleted = operator.methodcaller("is_deleted")


def _shard_arrays(leaf: jax.Array) -> Sequence[Any]:
    """The leaf's addressable shards' arrays, in ``addressable_shards`` order.

    ``jax.Array._arrays``, without a ``Shard`` object per shard (0.1 ms a save
    for a few dozen); where a JAX version lacks it, ``addressable_shards``.
    """
    arrays = getattr(leaf, "_arrays", None)
    if arrays is None:
        return [s.data for s in leaf.addressable_shards]
    return arrays


def _set_scalar(buf: np.ndarray, value: Any, lp: LeafPlan) -> None:
    try:
        buf[...] = value
    except OverflowError as e:
        raise UnsupportedObjectError(
            f"leaf {lp.display} = {value!r} does not fit in {lp.dtype}"
        ) from e



def _disk_chunk(files: list[tuple[str, str]], param: str) -> tuple[int, ...]:
    """The zarr chunk shape planned for ``param`` (from its ``.zarray``, among ``files``)."""
    name = f"{param}/{fmt.ZARRAY}"
    text = next(text for f, text in files if f == name)
    return tuple(json.loads(text)["chunks"])
