"""The on-disk layout of a JAX checkpoint: orbax's non-OCDBT zarr tree (zarr v2 or v3).

A checkpoint is a directory named by its step::

    <directory>/<step>/
        _CHECKPOINT_METADATA        orbax step metadata: handler, metrics, custom metadata
        asyncckpt.manifest.json     asyncckpt's integrity manifest, written last
        default/                    the pytree item
            _METADATA               orbax tree metadata: key paths and value types
            _sharding               shardings of jax.Array leaves (for target-less restores)
            <param>/.zarray         zarr v2 array metadata, "compressor": null
            <param>/<i>.<j>...      one chunk file per shard: its raw C-order bytes

With orbax's ``use_zarr3=True`` each array is a zarr v3 array instead:
``<param>/zarr.json`` (its only codec ``bytes``, little-endian) and chunk
files ``<param>/c/<i>/<j>`` (zarr v3's default chunk key encoding; ``c``
for a 0-d array), holding the same bytes.

Chunk files are exactly the bytes of each shard (zarr v2 with no compressor,
zarr v3 with no codec but ``bytes``), so they are written straight from the
staging buffers and read back with a plain ``read``. orbax's own restore
reads these files through TensorStore. See ``docs/jax.md``.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncckpt._engine import contained
from asyncckpt.errors import CorruptCheckpointError, UnsupportedObjectError
from asyncckpt.jax import _handlers
from asyncckpt.jax._tree import DICT_KEY, SEQUENCE_KEY, LeafPath

ITEM = "default"
# The item of a checkpointer's pytree: its files are at the top of the checkpoint.
ROOT_ITEM = ""
TREE_METADATA = "_METADATA"
SHARDING_FILE = "_sharding"
# orbax's per-process array metadata (a typed PRNG key's impl among it).
ARRAY_METADATAS = "array_metadatas"
RANDOM_KEY_IMPL = "random_key_impl"
STEP_METADATA = "_CHECKPOINT_METADATA"
ZARRAY = ".zarray"
ZARR_JSON = "zarr.json"  # zarr v3's array metadata
OCDBT_MANIFEST = "manifest.ocdbt"
# What orbax's CheckpointManager records as the handler of the "default" item;
# it lets `orbax.checkpoint.CheckpointManager(dir).restore(step)` work without args.
STANDARD_HANDLER = (
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
)
JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
# A JSON item is one file in its directory; orbax names it "metadata", and the
# metrics item (what orbax's best_fn ranks) "metrics".
JSON_FILE = "metadata"
METRICS_ITEM = "metrics"
# Manager-level metadata (CheckpointManager(metadata=...)), written once.
ROOT_METADATA = "metadata/_ROOT_METADATA"

# orbax's value types.
JAX_ARRAY = "jax.Array"
NUMPY_ARRAY = "np.ndarray"
SCALAR = "scalar"

# Extension dtypes (from ml_dtypes, which JAX depends on) that zarr v2 names by
# their name; all others use NumPy's little-endian type string (`<f4`, `|b1`).
_NAMED_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_PLAIN_KINDS = "biufc"


def in_item(item: str, name: str) -> str:
    """``name`` (relative to an item directory) as a name relative to the step.

    ``item`` ``""`` is the checkpoint's root: a checkpointer's pytree, whose
    files are at the top of its path.
    """
    return f"{item}/{name}" if item else name


def zarr_dtype(dtype: np.dtype, *, what: str) -> str:
    """The zarr v2 ``dtype`` string of a NumPy/JAX dtype.

    Raises:
        UnsupportedObjectError: the dtype has no raw, orbax-readable zarr form.
    """
    dtype = np.dtype(dtype)
    if dtype.name in _NAMED_DTYPES:
        return dtype.name
    if dtype.kind in _PLAIN_KINDS and dtype.byteorder in ("=", "<", "|"):
        return dtype.newbyteorder("<").str if dtype.itemsize > 1 else dtype.str
    raise UnsupportedObjectError(
        f"{what} has dtype {dtype.name}, which asyncckpt cannot store in the orbax layout "
        f"(supported: bool, integers, floats, complex, {', '.join(_NAMED_DTYPES)})"
    )


# zarr v3 ``data_type`` names asyncckpt writes (and reads raw): NumPy's names,
# which TensorStore's zarr3 driver uses too.
_ZARR3_DTYPES = frozenset(("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                           "uint32", "uint64", "float16", "float32", "float64", "complex64",
                           "complex128", *_NAMED_DTYPES))


def zarr3_dtype(dtype: np.dtype, *, what: str) -> str:
    """The zarr v3 ``data_type`` of a NumPy/JAX dtype (stored little-endian).

    Raises:
        UnsupportedObjectError: the dtype has no zarr v3 form asyncckpt writes.
    """
    dtype = np.dtype(dtype)
    if dtype.name in _ZARR3_DTYPES and dtype.byteorder in ("=", "<", "|"):
        return dtype.name
    raise UnsupportedObjectError(
        f"{what} has dtype {dtype.name}, which asyncckpt cannot store as zarr v3 "
        f"(supported: {', '.join(sorted(_ZARR3_DTYPES))})"
    )


def array_dtype(dtype: np.dtype, *, what: str, zarr3: bool) -> str:
    """The dtype as the array metadata names it (``zarr_dtype`` or ``zarr3_dtype``)."""
    return zarr3_dtype(dtype, what=what) if zarr3 else zarr_dtype(dtype, what=what)


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a zarr v2 ``dtype`` string or a zarr v3 ``data_type``."""
    if name in _NAMED_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def sub_chunk_shape(global_shape: Sequence[int], write_shape: Sequence[int], itemsize: int,
                    chunk_byte_size: int | None, shard_axes: Sequence[int] = ()
                    ) -> tuple[int, ...]:
    """The zarr chunk shape orbax chooses for ``SaveArgs(chunk_byte_size, shard_axes)``.

    The chunks tile each written shard (``write_shape``) exactly: every
    dimension of the chunk divides the shard's. Axes in ``shard_axes`` are
    split down to 1 first; then, while a chunk holds more than
    ``chunk_byte_size`` bytes, the largest dimension among those already split
    (the array's sharded ones, at first) is cut to its next smaller divisor,
    the first such dimension on a tie; when none of those can be cut, every
    dimension becomes a candidate. This is orbax 0.12.8's rule, so a
    checkpoint has the chunk files orbax would write for the same arguments.

    Raises:
        ValueError: ``chunk_byte_size`` smaller than one element, or an axis
            out of range.
    """
    write = [max(1, int(d)) for d in write_shape]
    rank = len(write)
    if chunk_byte_size is None and not shard_axes:
        return tuple(write)
    options = [_divisors(d) for d in write]  # options[i][-1] is the chunk's dimension i
    split = [int(g) != w for g, w in zip(global_shape, write, strict=True)]
    for axis in shard_axes:
        if not 0 <= axis < rank:
            raise ValueError(f"shard_axes {tuple(shard_axes)} must be in [0, {rank})")
        del options[axis][1:]
        split[axis] = True
    if chunk_byte_size is not None:
        if chunk_byte_size < itemsize:
            raise ValueError(f"chunk_byte_size={chunk_byte_size} is smaller than one element "
                             f"({itemsize} bytes)")
        limit = chunk_byte_size // itemsize
        while math.prod(o[-1] for o in options) > limit:
            cuttable = [i for i in range(rank) if split[i] and options[i][-1] > 1]
            if not cuttable:
                split = [True] * rank
                continue
            largest = max(cuttable, key=lambda i: (options[i][-1], -i))
            options[largest].pop()
            split[largest] = True
    return tuple(o[-1] for o in options)


def chunk_name(coords: Sequence[int], *, zarr3: bool = False) -> str:
    """A chunk's key (relative to its array).

    zarr v2: ``.`` separators, the one chunk of a 0-d array is ``0``. zarr v3
    (its ``default`` chunk key encoding): ``c/`` and ``/`` separators, the one
    chunk of a 0-d array is ``c``.
    """
    if zarr3:
        return "/".join(("c", *(str(c) for c in coords)))
    return ".".join(str(c) for c in coords) if coords else "0"


def metadata_name(*, zarr3: bool) -> str:
    """The name of an array's metadata file (key) in its directory."""
    return ZARR_JSON if zarr3 else ZARRAY


def array_json(shape: Sequence[int], chunks: Sequence[int], dtype: str, *, zarr3: bool) -> str:
    """An uncompressed C-order array's metadata: ``.zarray`` or, for zarr v3, ``zarr.json``."""
    if zarr3:
        return zarr3_json(shape, chunks, dtype)
    return zarray_json(shape, chunks, dtype)


def _zero_fill(dtype: str) -> Any:
    """zarr v3's JSON for a zero fill value of ``dtype`` (it must name one)."""
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    return 0.0 if dtype.startswith(("float", "bfloat")) else 0


def zarr3_json(shape: Sequence[int], chunks: Sequence[int], dtype: str) -> str:
    """The ``zarr.json`` of an uncompressed zarr v3 array: its one codec ``bytes``.

    A chunk is then its raw little-endian C-order bytes, as in zarr v2 with no
    compressor (TensorStore's zarr3 driver, which orbax reads with, takes the
    codecs from this file). Single-byte types take no ``endian``. Keys sorted,
    as TensorStore writes them.
    """
    one_byte = dtype in ("bool", "int8", "uint8", "float8_e4m3fn", "float8_e5m2")
    codec: dict[str, Any] = {"name": "bytes"}
    if not one_byte:
        codec["configuration"] = {"endian": "little"}
    return json.dumps(
        {
            "chunk_grid": {"configuration": {"chunk_shape": list(chunks)}, "name": "regular"},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [codec],
            "data_type": dtype,
            "fill_value": _zero_fill(dtype),
            "node_type": "array",
            "shape": list(shape),
            "zarr_format": 3,
        }
    )


def zarray_json(shape: Sequence[int], chunks: Sequence[int], dtype: str) -> str:
    """The ``.zarray`` of an uncompressed C-order zarr v2 array."""
    return json.dumps(
        {
            "chunks": list(chunks),
            "compressor": None,
            "dimension_separator": ".",
            "dtype": dtype,
            "fill_value": None,
            "filters": None,
            "order": "C",
            "shape": list(shape),
            "zarr_format": 2,
        }
    )


def split_chunk(chunk: Sequence[int], itemsize: int, limit: int | None) -> tuple[int, ...]:
    """A chunk shape dividing ``chunk`` whose chunks hold at most ``limit`` bytes.

    orbax makes the zarr chunks of an OCDBT checkpoint no larger than the
    target data file size; this does the same with shapes of the form
    ``(1, ..., 1, c, n, ...)`` (``c`` dividing that dimension), so that each
    smaller chunk is one contiguous run of the bytes of the original chunk
    in C order and is written from the staging buffer without a copy.
    ``limit`` None or 0: ``chunk`` itself. A chunk of one element is never split.
    """
    chunk = tuple(int(c) for c in chunk)
    if not limit or math.prod(chunk) * itemsize <= limit:
        return chunk
    out = list(chunk)
    for d, n in enumerate(chunk):
        inner = math.prod(chunk[d + 1:]) * itemsize  # bytes of one step along dimension d
        fits = [c for c in range(n, 0, -1) if n % c == 0 and c * inner <= limit]
        if fits:
            out[d] = fits[0]
            return tuple(out)
        out[d] = 1  # even one step is too large: split the next dimension too
    return tuple(out)


def chunk_pieces(chunk: Sequence[int], sub: Sequence[int], coords: Sequence[int],
                 shape: Sequence[int], *, zarr3: bool = False) -> tuple[str | None, ...]:
    """The chunk names of ``sub``-shaped pieces of the chunk at ``coords``, in byte order.

    ``chunk`` is the shape the bytes were staged in (at chunk coordinates
    ``coords`` of that grid), ``sub`` a ``split_chunk`` of it. Each piece
    is a contiguous, equal run of those bytes; a piece wholly outside the
    array's ``shape`` (padding of an edge chunk) is None: never written.
    """
    factors = [c // s for c, s in zip(chunk, sub, strict=True)]
    out: list[str | None] = []
    for local in np.ndindex(*factors):
        grid = [c * f + i for c, f, i in zip(coords, factors, local, strict=True)]
        inside = all(g * s < n for g, s, n in zip(grid, sub, shape, strict=True))
        out.append(chunk_name(grid, zarr3=zarr3) if inside else None)
    return tuple(out)


@dataclass(frozen=True)
class TreeEntry:
    """One leaf in orbax's ``_METADATA``.

    Attributes:
        path: Key path of the leaf.
        value_type: ``jax.Array``, ``np.ndarray``, ``scalar`` or an empty
            type (``None``, ``Dict``, ``List``, ``Tuple``).
        write_shape: Shape of each written shard (jax.Array only).
    """

    path: LeafPath
    value_type: str
    write_shape: tuple[int, ...] | None = None

    @property
    def skipped(self) -> bool:
        """Whether the leaf has no array on disk (an empty subtree)."""
        return self.value_type not in (JAX_ARRAY, NUMPY_ARRAY, SCALAR)


def tree_metadata_json(entries: Sequence[TreeEntry], custom_metadata: Any = None, *,
                       use_ocdbt: bool = False, use_zarr3: bool = False) -> str:
    """orbax's ``_METADATA`` for a zarr v2 or v3 checkpoint, OCDBT or not.

    orbax's readers take the zarr driver from ``use_zarr3`` here, whatever
    their own handler's setting.
    """
    tree = {}
    for e in entries:
        value: dict[str, Any] = {"value_type": e.value_type, "skip_deserialize": e.skipped}
        if e.write_shape is not None:
            value["write_shape"] = list(e.write_shape)
        tree[e.path.metadata_key] = {
            "key_metadata": [
                {"key": n, "key_type": k} for n, k in zip(e.path.names, e.path.kinds, strict=True)
            ],
            "value_metadata": value,
        }
    return json.dumps(
        {
            "tree_metadata": tree,
            "use_ocdbt": use_ocdbt,
            "use_zarr3": use_zarr3,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": custom_metadata,
        }
    )


def read_tree_metadata(item_dir: str) -> list[TreeEntry]:
    """Parses ``_METADATA`` (written by asyncckpt or orbax).

    Each leaf's parameter name becomes a directory name (or a key of the
    item's database): one that could lead outside the item
    (``contained.name_problem``) is damage, and so is a list index that
    no list of this tree can have (``build_tree`` would size the list by it).

    Raises:
        CorruptCheckpointError: missing, unreadable, a directory or a FIFO,
            or naming a leaf outside the item.
    """
    path = os.path.join(item_dir, TREE_METADATA)
    checkpoint = os.path.dirname(item_dir)
    try:
        body = json.loads(contained.read_file(path, checkpoint=checkpoint))
        tree = body["tree_metadata"]
        entries = []
        for info in tree.values():
            keys = info["key_metadata"]
            names = tuple(str(k["key"]) for k in keys)
            kinds = tuple(int(k["key_type"]) for k in keys)
            if any(k not in (SEQUENCE_KEY, DICT_KEY) for k in kinds):
                raise ValueError(f"unknown key type in {keys}")
            for name, kind in zip(names, kinds, strict=True):
                if kind == SEQUENCE_KEY and not (
                        name.isascii() and name.isdigit() and int(name) < len(tree)):
                    raise ValueError(f"list index {name!r} in {keys} (the tree has "
                                     f"{len(tree)} leaves)")
            value = info["value_metadata"]
            shape = value.get("write_shape")
            entries.append(
                TreeEntry(
                    LeafPath(names, kinds),
                    str(value["value_type"]),
                    tuple(shape) if shape is not None else None,
                )
            )
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{item_dir!r} has no {TREE_METADATA} file: not an orbax/asyncckpt pytree",
            checkpoint=checkpoint,
            file=path,
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(
            f"tree metadata {path!r} is unreadable: {e}",
            checkpoint=checkpoint,
            file=path,
        ) from e
    for e in entries:
        if not e.skipped:
            contained.check_name(e.path.param, checkpoint=checkpoint, source=path)
    return entries


def _read_json(path: str) -> Any:
    """A small JSON file of a checkpoint (a FIFO, a directory...: ``CorruptCheckpointError``)."""
    return json.loads(contained.read_file(path, checkpoint=os.path.dirname(path)))


def tree_flag(item_dir: str, name: str) -> Any:
    """A top-level field of ``_METADATA`` (``use_ocdbt``, ``use_zarr3``); None if absent."""
    try:
        body = _read_json(os.path.join(item_dir, TREE_METADATA))
    except (OSError, ValueError):
        return None
    return body.get(name) if isinstance(body, dict) else None


def sharding_json(sharding: Any) -> str | None:
    """orbax's description of a sharding, or None for kinds it cannot describe."""
    import jax

    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(device)})
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        if not isinstance(mesh, jax.sharding.Mesh):
            return None

        def spec_entry(p: Any) -> Any:
            return list(p) if isinstance(p, tuple) else p

        return json.dumps(
            {
                "sharding_type": "NamedSharding",
                "shape": [int(d) for d in mesh.devices.shape],
                "axis_names": list(mesh.axis_names),
                "axis_types": [str(t) for t in mesh.axis_types],
                "partition_spec": [spec_entry(p) for p in sharding.spec],
                "device_mesh": {
                    "mesh": np.vectorize(lambda d: {"id": int(d.id)}, otypes=[object])(
                        mesh.devices
                    ).tolist()
                },
            }
        )
    return None


def sharding_file_json(shardings: dict[str, str]) -> str:
    """The ``_sharding`` file: base64url(param name) -> sharding description."""
    return json.dumps(
        {base64.urlsafe_b64encode(k.encode()).decode(): v for k, v in shardings.items()}
    )


def step_metadata_json(
    *,
    metrics: dict | None,
    custom_metadata: dict | None,
    init_ns: int,
    commit_ns: int,
    item_handlers: dict[str, str] | str | None = None,
) -> str:
    """orbax's step-level ``_CHECKPOINT_METADATA`` (metrics, custom metadata).

    ``item_handlers`` names orbax's handler of each item directory (default:
    the one ``default`` pytree item), or, for a checkpointer's save to a path,
    is the name of its one handler (orbax records a string there).
    """
    return json.dumps(
        {
            "item_handlers": item_handlers or {ITEM: STANDARD_HANDLER},
            "metrics": metrics or {},
            "performance_metrics": {},
            "init_timestamp_nsecs": init_ns,
            "commit_timestamp_nsecs": commit_ns,
            "custom_metadata": custom_metadata or {},
        }
    )


def read_step_metadata(step_dir: str) -> dict:
    """``_CHECKPOINT_METADATA`` as a dict ({} when absent or unreadable)."""
    try:
        body = _read_json(os.path.join(step_dir, STEP_METADATA))
        return body if isinstance(body, dict) else {}
    except (OSError, ValueError):
        return {}


def json_item_bytes(value: Any) -> bytes:
    """A JSON item's file, as orbax's ``JsonCheckpointHandler`` writes it."""
    return json.dumps(value).encode()


def item_files(items: Any, metrics: Any, *, primary: bool
               ) -> tuple[dict[str, str], list[tuple[str, bytes]]]:
    """Each item's orbax handler, and the JSON files a save writes besides its arrays.

    ``items`` have ``name``, ``kind`` (``"pytree"``, ``"json"``, or
    ``"handler"``: written by its own ``handler``, recorded by its type) and
    ``value``. ``metrics`` are written as orbax's metrics item, where its
    ``best_fn`` reads them (None: not written). Only the primary process
    writes files; the others get none.
    """
    handlers = {i.name: STANDARD_HANDLER if i.kind == "pytree" else JSON_HANDLER if
                i.kind == "json" else _handlers.typestr(i.handler) for i in items}
    if metrics is not None:
        handlers[METRICS_ITEM] = JSON_HANDLER
    if not primary:
        return handlers, []
    files = [(f"{i.name}/{JSON_FILE}", json_item_bytes(i.value)) for i in items
             if i.kind == "json"]
    if metrics is not None:
        files.append((f"{METRICS_ITEM}/{METRICS_ITEM}", json_item_bytes(metrics)))
    return handlers, files


def read_json_item(item_dir: str) -> Any:
    """The value of a JSON item directory (its one file).

    Raises:
        CorruptCheckpointError: no file or not JSON.
    """
    names = [n for n in (JSON_FILE, os.path.basename(item_dir)) if
             os.path.isfile(os.path.join(item_dir, n))]
    if not names:
        raise CorruptCheckpointError(f"{item_dir!r} holds no JSON item file",
                                     checkpoint=os.path.dirname(item_dir))
    path = os.path.join(item_dir, names[0])
    try:
        return _read_json(path)
    except ValueError as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"JSON item {path!r} is unreadable: {e}",
                                     checkpoint=os.path.dirname(item_dir), file=path) from e


def is_ocdbt(item_dir: str) -> bool:
    """Whether orbax wrote this item in its OCDBT format (not readable as plain zarr)."""
    return os.path.exists(os.path.join(item_dir, OCDBT_MANIFEST))


# Reads one chunk file's raw bytes (None if the file does not exist).
ChunkSource = Callable[[str], "np.ndarray | None"]


def array_metadatas_file(arrays: Sequence[tuple[str, Any, Sequence[int], str | None]],
                         process_index: int = 0) -> tuple[str, str]:
    """orbax's ``array_metadatas/process_<i>`` file: ``(name, text)`` in the item.

    ``arrays``: ``(param, write_shape, chunk_shape, key_impl)`` of each
    ``jax.Array`` leaf; ``key_impl`` (None for other arrays) is the impl of a
    typed PRNG key, which orbax reads back to wrap the key data it restores.
    """
    body = {"array_metadatas": [
        {"array_metadata": {
            "param_name": param,
            "write_shape": list(write_shape) if write_shape is not None else None,
            "chunk_shape": list(chunk_shape),
            "ext_metadata": None if impl is None else {RANDOM_KEY_IMPL: impl},
        }} for param, write_shape, chunk_shape, impl in arrays]}
    return f"{ARRAY_METADATAS}/process_{process_index}", json.dumps(body)


def read_key_impls(item_dir: str) -> dict[str, str]:
    """The typed PRNG keys of an item: parameter name -> impl (``array_metadatas``).

    orbax (and asyncckpt) record a key's impl in the ``array_metadatas``
    files; an item without them has no keys. As orbax, the first process's
    file that names a parameter is the one read.

    Raises:
        CorruptCheckpointError: a file there is not orbax's JSON.
    """
    folder = os.path.join(item_dir, ARRAY_METADATAS)
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("process_"))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    impls: dict[str, str] = {}
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                body = json.load(f)
            for entry in body.get("array_metadatas", []):
                meta = entry.get("array_metadata", entry)
                ext = meta.get("ext_metadata") or {}
                impl = ext.get(RANDOM_KEY_IMPL) if isinstance(ext, dict) else None
                if impl is not None:
                    impls.setdefault(str(meta["param_name"]), str(impl))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"array metadata {path!r} is unreadable: {e}",
                checkpoint=os.path.dirname(item_dir), file=path) from e
    return impls


def read_shardings(item_dir: str) -> dict[str, str]:
    """The item's ``_sharding`` file: parameter name -> orbax's sharding description ({}
    when there is none: orbax writes it only if it can describe every jax.Array).

    Raises:
        CorruptCheckpointError: the file is not orbax's JSON.
    """
    path = os.path.join(item_dir, SHARDING_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        return {base64.urlsafe_b64decode(k.encode()).decode(): str(v)
                for k, v in body.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"sharding file {path!r} is unreadable: {e}",
                                     checkpoint=os.path.dirname(item_dir), file=path) from e


def read_file_bytes(path: str) -> np.ndarray | None:
    """A whole file as a uint8 array (None if it does not exist)."""
    try:
        fd = contained.open_regular(path, checkpoint=os.path.dirname(path))
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return np.fromfile(f, dtype=np.uint8)
    finally:
        os.close(fd)


def _raw_codecs(codecs: Any, itemsize: int) -> bool:
    """Whether zarr v3 ``codecs`` store a chunk as its raw little-endian bytes.

    That is one ``bytes`` codec, little-endian (or, for one-byte types,
    without an ``endian``): what asyncckpt writes. Anything else (orbax's
    ``sharding_indexed``, compressors, ``transpose``, checksums) is decoded
    by TensorStore instead.
    """
    if not isinstance(codecs, list) or len(codecs) != 1 or not isinstance(codecs[0], dict):
        return False
    codec = codecs[0]
    if codec.get("name") != "bytes":
        return False
    endian = (codec.get("configuration") or {}).get("endian")
    return endian == "little" or (endian is None and itemsize == 1)


def _fill(value: Any, dtype: np.dtype) -> Any:
    """A zarr fill value (v2 or v3 JSON) as a value of ``dtype``; None and absent: 0."""
    if value is None:
        return 0
    if isinstance(value, list) and len(value) == 2:  # zarr v3 complex: [real, imaginary]
        return complex(_fill(value[0], np.dtype(np.float64)), _fill(value[1],
                                                                   np.dtype(np.float64)))
    if isinstance(value, str) and value.startswith("0x"):  # zarr v3: the raw bits, in hex
        bits = np.array(int(value, 16), dtype=f"<u{dtype.itemsize}")
        return bits.view(dtype)[()]
    if isinstance(value, str):  # "NaN", "Infinity", "-Infinity"
        return float(value)
    return value


class ZarrArray:
    """Reads regions of one uncompressed zarr array (v2, or v3) written in this layout.

    Args:
        array_dir: The parameter's directory (holding ``.zarray``, or ``zarr.json``).
        checkpoint: Checkpoint path, for error messages.
        source: Reads a chunk file's bytes; restores pass one that verifies
            and caches what it reads.
        metadata: The metadata file's contents when they are not a file (an
            OCDBT key); chunks are then still asked of ``source`` by the path
            they would have as files.
        zarr3: The array is zarr v3 (orbax's ``use_zarr3``): ``zarr.json``
            and its chunk key encoding (``c/0/1``).

    Attributes:
        compressor: Whatever stores a chunk other than as its raw bytes
            (zarr v2's compressor; zarr v3's codecs), None when nothing does.
    """

    def __init__(self, array_dir: str, *, checkpoint: str, source: ChunkSource = read_file_bytes,
                 metadata: bytes | None = None, zarr3: bool = False):
        self.dir = array_dir
        self._checkpoint = checkpoint
        self._source = source
        self._zarr3 = zarr3
        self._separator = "."
        self._prefix: tuple[str, ...] = ()  # zarr v3's ``c``
        meta_path = os.path.join(array_dir, metadata_name(zarr3=zarr3))
        order, filters = "C", None
        try:
            if metadata is None:
                metadata = contained.read_file(meta_path, checkpoint=checkpoint)
            meta = json.loads(metadata)
            self.shape = tuple(int(d) for d in meta["shape"])
            if zarr3:
                self._read_zarr3(meta)
            else:
                self.chunks = tuple(int(d) for d in meta["chunks"])
                self.dtype = numpy_dtype(meta["dtype"])
                self.compressor = meta.get("compressor")
                self.fill_value = meta.get("fill_value")
                order = meta.get("order", "C")
                filters = meta.get("filters")
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint!r} is incomplete: {meta_path!r} is missing",
                checkpoint=checkpoint,
                file=meta_path,
            ) from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(
                f"zarr metadata {meta_path!r} is unreadable: {e}",
                checkpoint=checkpoint,
                file=meta_path,
            ) from e
        if (
            len(self.chunks) != len(self.shape)
            or any(c < 1 for c in self.chunks)
            or any(d < 0 for d in self.shape)
            or self.dtype.hasobject or self.dtype.fields is not None or self.dtype.itemsize < 1
            or order != "C"
            or filters
        ):
            raise CorruptCheckpointError(
                f"zarr metadata {meta_path!r} describes a layout asyncckpt does not read "
                f"(chunks {self.chunks} for shape {self.shape}, dtype {self.dtype}, order "
                f"{order}, filters {filters})",
                checkpoint=checkpoint,
                file=meta_path,
            )

    def _read_zarr3(self, meta: dict) -> None:
        """The fields of a ``zarr.json`` (raises ValueError/KeyError/TypeError if malformed)."""
        if meta.get("zarr_format") != 3 or meta.get("node_type", "array") != "array":
            raise ValueError("not a zarr v3 array")
        grid = meta["chunk_grid"]
        if grid.get("name") != "regular":
            raise ValueError(f"chunk grid {grid.get('name')!r} (asyncckpt reads 'regular')")
        self.chunks = tuple(int(d) for d in grid["configuration"]["chunk_shape"])
        self.dtype = numpy_dtype(meta["data_type"])
        encoding = meta.get("chunk_key_encoding") or {"name": "default"}
        separator = (encoding.get("configuration") or {}).get("separator")
        if encoding.get("name") == "default":
            self._separator, self._prefix = separator or "/", ("c",)
        elif encoding.get("name") == "v2":
            self._separator = separator or "."
        else:
            raise ValueError(f"chunk key encoding {encoding.get('name')!r}")
        if self._separator not in ("/", "."):
            raise ValueError(f"chunk key separator {self._separator!r}")
        codecs = meta.get("codecs")
        raw = _raw_codecs(codecs, self.dtype.itemsize) and not meta.get("storage_transformers")
        self.compressor = None if raw else codecs
        self.fill_value = meta.get("fill_value")

    @property
    def compressed(self) -> bool:
        """Whether chunks are stored other than raw (read through TensorStore instead)."""
        return self.compressor is not None

    def chunk_key(self, coords: Sequence[int]) -> str:
        """The chunk's key relative to the array's directory (``0.1``, ``c/0/1``)."""
        if not self._zarr3:
            return chunk_name(coords)
        parts = (*self._prefix, *(str(c) for c in coords))
        return self._separator.join(parts) if parts else "0"

    @property
    def chunk_count(self) -> int:
        """How many chunks the array's grid holds (0 for an empty array)."""
        return math.prod(-(-d // c) for d, c in zip(self.shape, self.chunks, strict=True))

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one (whole, uncompressed) chunk."""
        return math.prod(self.chunks) * self.dtype.itemsize

    def chunk_path(self, coords: Sequence[int]) -> str:
        return os.path.join(self.dir, *self.chunk_key(coords).split("/"))

    def _bounds(self, index: tuple[slice, ...] | None) -> list[tuple[int, int]]:
        bounds = []
        for dim, s in zip(self.shape, index or [slice(None)] * len(self.shape), strict=True):
            start, stop, step = s.indices(dim)
            if step != 1:
                raise ValueError(f"strided restore index {s} is not supported")
            bounds.append((start, max(start, stop)))
        return bounds

    def _coords(self, bounds: list[tuple[int, int]]) -> list[tuple[int, ...]]:
        if any(b <= a for a, b in bounds):
            return []
        ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(bounds, self.chunks,
                                                                       strict=True)]
        return [tuple(r[i] for r, i in zip(ranges, idx, strict=True))
                for idx in np.ndindex(*(len(r) for r in ranges))]

    def chunk_paths(self, index: tuple[slice, ...] | None = None) -> list[str]:
        """The chunk files holding ``array[index]``."""
        return [self.chunk_path(c) for c in self._coords(self._bounds(index))]

    def _read_chunk(self, coords: tuple[int, ...]) -> np.ndarray:
        path = self.chunk_path(coords)
        count = math.prod(self.chunks)
        data = self._source(path)
        if data is None:
            # zarr: a missing chunk holds the fill value everywhere.
            return np.full(self.chunks, _fill(self.fill_value, self.dtype), dtype=self.dtype)
        if data.nbytes != count * self.dtype.itemsize:
            raise CorruptCheckpointError(
                f"checkpoint {self._checkpoint!r} is corrupt: chunk {path!r} holds "
                f"{data.nbytes} bytes, its array needs {count * self.dtype.itemsize}",
                checkpoint=self._checkpoint,
                file=path,
            )
        return data.view(self.dtype).reshape(self.chunks)

    def read(self, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Reads ``array[index]`` (unit-stride slices) into a host array."""
        if self.compressed:
            raise CorruptCheckpointError(
                f"{self.dir!r} is compressed ({self.compressor}); asyncckpt reads "
                "uncompressed arrays only",
                checkpoint=self._checkpoint,
            )
        if not self.shape:
            return self._read_chunk(()).copy()
        bounds = self._bounds(index)
        out_shape = tuple(b - a for a, b in bounds)
        coords = self._coords(bounds)
        if len(coords) == 1:
            (c,) = coords
            region = tuple(
                slice(a - i * n, b - i * n) for (a, b), i, n in zip(bounds, c, self.chunks,
                                                                     strict=True)
            )
            if all(a == i * n for (a, _), i, n in zip(bounds, c, self.chunks, strict=True)):
                return self._read_chunk(c)[region]  # the common case: one whole chunk
        out = np.empty(out_shape, dtype=self.dtype)
        for c in coords:
            chunk = self._read_chunk(c)
            src, dst = [], []
            for (a, b), i, n in zip(bounds, c, self.chunks, strict=True):
                lo, hi = max(a, i * n), min(b, (i + 1) * n)
                src.append(slice(lo - i * n, hi - i * n))
                dst.append(slice(lo - a, hi - a))
            out[tuple(dst)] = chunk[tuple(src)]
        return out
