"""A verified TensorFlow bundle, and reads of only some of its tensors.

``open_bundle`` checks a checkpoint's files against its manifest as far as
that is cheap (every file's size; the ``.index``'s checksum) and parses the
index: what each tensor's dtype, shape, place and TensorFlow CRC32C are.
From then on the index is trusted, so a tensor read by ``read_tensors`` is
verified by its own CRC32C, with no need to read the rest of its file: that
is what lets a restore read only what it assigns.

What is read are *pieces*: an unpartitioned tensor is one piece, named by
its checkpoint key; a partitioned tensor (a ``ShardedVariable``) is its
stored slices, each a piece named ``(key, starts, lengths)`` with its own
entry (place, size, CRC32C). ``assemble`` builds the slice a ``RestoreV2``
asks for from the pieces it overlaps, so a restore into another number of
shards (or into one variable) is read by us too.

``predict`` says which tensors a restore into a live object graph will ask
for: TensorFlow's own matching of the checkpoint's object graph to the
Python objects (``tf.train.CheckpointView.match``), the attributes of every
matched node, and the slot variables of matched optimizers for matched
variables. It is a prediction only: a restore asks for what it asks, and
whatever was not predicted is read when asked (``_restore``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from asyncckpt._engine import fastcrc, reads
from asyncckpt._engine.files import FileRecord
from asyncckpt._engine.manifest import Manifest, verify_files
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.tf import _bundle
from asyncckpt.tf._compat import OBJECT_GRAPH_KEY, tf
from asyncckpt.tf._slices import Slice, full_slice, intersect, parse_spec

logger = logging.getLogger(__name__)

# Dtypes whose tensors are raw little-endian bytes in the data file.
PLAIN = {d.as_datatype_enum: d for d in (
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64,
    tf.uint8, tf.uint16, tf.uint32, tf.uint64, tf.bool, tf.complex64, tf.complex128,
)}
STRING = tf.string.as_datatype_enum


@dataclass(frozen=True)
class Piece:
    """Stored bytes of one tensor or of one slice of a partitioned tensor.

    Attributes:
        id: The tensor's checkpoint key, or ``(key, starts, lengths)`` for a slice.
        entry: Its ``BundleEntryProto``.
        slice: Where it lies in the full tensor.
    """

    id: Hashable
    entry: object
    slice: Slice


def masked(crc: int) -> int:
    """TensorFlow's masked CRC32C (``crc32c::Mask``), as bundle entries store it."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def fail(prefix: str, path: str, what: str) -> CorruptCheckpointError:
    """The error for a checkpoint file that is not what its manifest or index says."""
    return CorruptCheckpointError(f"checkpoint {prefix!r} is corrupt: file {path!r} {what}",
                                  checkpoint=prefix, file=path)


def aligned_empty(shape: list[int], dtype: np.dtype, file_offset: int) -> np.ndarray:
    """An aligned array for a tensor at ``file_offset`` (``reads.aligned_empty``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return reads.aligned_empty(nbytes, file_offset=file_offset).view(dtype).reshape(shape)


def _identity(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class Bundle:
    """A checkpoint whose index was checked against its manifest and parsed.

    Attributes:
        prefix: The checkpoint's prefix (absolute).
        directory: Its directory.
        index: The parsed ``.index``.
        records: Manifest file name -> record.
        data_names: The data files' names, by shard.
        index_name: The ``.index`` file's name.
        checksums: Whether reads verify what they read.
    """

    prefix: str
    directory: str
    index: _bundle.BundleIndex
    records: dict[str, FileRecord]
    data_names: list[str]
    index_name: str
    checksums: bool
    _index_id: tuple[int, int, int]

    def current(self) -> bool:
        """Whether the ``.index`` is still the file that was verified (not rewritten since)."""
        try:
            return _identity(os.path.join(self.directory, self.index_name)) == self._index_id
        except OSError:
            return False

    def plain_keys(self) -> set[str]:
        """Keys of the tensors ``read_tensors`` reads (of a plain dtype, partitioned or not)."""
        return {k for k, e in self.index.entries.items() if e.dtype in PLAIN}

    def pieces(self, key: str) -> list[Piece]:
        """What holds ``key``'s values: its own entry, or its stored slices."""
        stored = self.index.slices.get(key)
        if stored is None:
            entry = self.index.entries[key]
            return [Piece(key, entry, full_slice(_bundle.shape_of(entry)))]
        return [Piece((key, s.slice.starts, s.slice.lengths), s.entry, s.slice) for s in stored]

    @functools.cached_property
    def _all_pieces(self) -> tuple[Piece, ...]:
        return tuple(p for key in self.index.entries for p in self.pieces(key))

    def all_pieces(self) -> tuple[Piece, ...]:
        """Every piece of every tensor, in key order."""
        return self._all_pieces

    def readable(self, key: str, dtype) -> bool:
        """Whether ``read_tensors`` can verify and read ``key`` as ``dtype`` by itself.

        Needs TensorFlow's CRC32C computed without the GIL when checksums
        are on (else TensorFlow's reader, with its own CRC32C, is faster).
        """
        entry = self.index.entries.get(key)
        return (entry is not None and entry.dtype in PLAIN
                and tf.as_dtype(dtype).base_dtype == PLAIN[entry.dtype]
                and (not self.checksums or reads.has_fast_crc32c()))


def open_bundle(prefix: str, manifest: Manifest, *, checksums: bool) -> Bundle | None:
    """Checks every file's size and the index's checksum; parses and checks the index.

    Every entry of the index is checked (``_bundle.index_problem``) before
    anything is sized from it: a shape with no negative dimension, whose
    elements are the bytes recorded, within a data file the manifest lists.

    Returns:
        The bundle, or None when this checkpoint is not one asyncckpt reads
        itself (another index format: TensorFlow's reader gets it, after
        ``_bundle.check_for_reader``).

    Raises:
        CorruptCheckpointError: A file is missing, has the wrong size, or the
            index fails its checksum, describes a tensor its data files
            cannot hold, or puts one in a file the manifest does not list.
    """
    directory = os.path.dirname(os.path.abspath(prefix))
    verify_files(directory, manifest.files, checksums=False, checkpoint=prefix)  # sizes
    base = os.path.basename(prefix)
    records = {r.name: r for r in manifest.files}
    index_rec = records.get(base + ".index")
    if index_rec is None:
        return None
    index_path = os.path.join(directory, index_rec.name)
    with open(index_path, "rb") as f:
        index_id = _identity(index_path)
        index_bytes = f.read()
    if checksums and index_rec.crc is not None:
        crc = fastcrc.updater(index_rec.algorithm)(index_bytes, 0)
        if crc != index_rec.crc:
            raise fail(prefix, index_path, f"fails its {index_rec.mismatch(crc)}")
    try:
        index = _bundle.parse_index(index_bytes)
    except _bundle.BundleFormatError as e:
        logger.info("%s: %s; restoring through TensorFlow's reader", prefix, e)
        return None
    if not 0 <= index.num_shards <= len(records):
        raise fail(prefix, index_path, f"names {index.num_shards} data files, the manifest "
                   f"lists {len(records)} files")
    data_names = [os.path.basename(_bundle.data_file(prefix, s, index.num_shards))
                  for s in range(index.num_shards)]
    unlisted = [n for n in data_names if n not in records]
    if unlisted:
        raise fail(prefix, os.path.join(directory, unlisted[0]),
                   "is a data file of the index that the manifest does not list")
    problem = _bundle.index_problem(
        index, {s: records[n].size for s, n in enumerate(data_names)})
    if problem is not None:
        raise fail(prefix, index_path, problem)
    return Bundle(os.path.abspath(prefix), directory, index, records, data_names,
                  index_rec.name, checksums, index_id)


def check_string(bundle: Bundle, path: str, entry, encoded) -> None:
    count = math.prod(d.size for d in entry.shape.dim)
    try:
        ok = masked(_bundle.string_tensor_crc32c(encoded, count)) == entry.crc32c
    except _bundle.BundleFormatError:
        ok = False
    if not ok:
        raise fail(bundle.prefix, path, f"fails the CRC32C check of the string tensor at "
                   f"byte {entry.offset}")


def read_tensors(bundle: Bundle, keys) -> dict[Hashable, tuple[tf.DType, np.ndarray]]:
    """Reads every piece of the tensors ``keys`` (``read_pieces``)."""
    return read_pieces(bundle, [p for key in set(keys) for p in bundle.pieces(key)])


def read_pieces(bundle: Bundle, pieces) -> dict[Hashable, tuple[tf.DType, np.ndarray]]:
    """Reads the plain ``pieces`` in parallel, each checked by its CRC32C.

    Only their bytes are read (``engine.reads``, ``O_DIRECT`` for cold
    files), each piece CRC32C'd by its reading thread and the parts
    combined into each piece's CRC32C, compared with the index's before
    this returns. String pieces (the object graph) are read and checked
    too, but not returned: TensorFlow reads those itself. Without checksums
    (``bundle.checksums`` off) nothing is checked.

    Returns:
        Piece id -> (dtype, array) for the pieces of a plain dtype.

    Raises:
        CorruptCheckpointError: A piece fails its check, or a file is
            shorter than its manifest says, or missing.
    """
    out: dict[Hashable, tuple[tf.DType, np.ndarray]] = {}
    dests: dict[int, list] = {}
    entries: dict[int, list] = {}
    for piece in sorted({p.id: p for p in pieces}.values(),
                        key=lambda p: (p.entry.shard_id, p.entry.offset)):
        entry = piece.entry
        if entry.dtype == STRING and entry.size:
            buf = bytearray(entry.size)
        elif entry.dtype in PLAIN:
            dtype = PLAIN[entry.dtype]
            shape = list(_bundle.shape_of(entry))
            array = aligned_empty(shape, np.dtype(dtype.as_numpy_dtype), entry.offset)
            if array.nbytes != entry.size:
                raise fail(bundle.prefix, os.path.join(bundle.directory, bundle.index_name),
                           f"records {entry.size} bytes for tensor {piece.id!r} of shape "
                           f"{shape}, {dtype.name} (which needs {array.nbytes})")
            out[piece.id] = (dtype, array)
            if not entry.size:
                continue
            buf = array.reshape(-1).view(np.uint8)
        else:
            continue
        dests.setdefault(entry.shard_id, []).append((entry.offset, buf))
        entries.setdefault(entry.shard_id, []).append(entry)
    file_reads = []
    try:
        for shard in sorted(dests):
            name = bundle.data_names[shard]
            file_reads.append(reads.FileRead(
                os.path.join(bundle.directory, name), bundle.records[name].size, dests[shard],
                checksum=bundle.checksums, algorithm=fastcrc.CRC32C, whole_file=False))
    except ValueError as e:  # overlapping tensors or one past the end: a damaged index
        raise fail(bundle.prefix, os.path.join(bundle.directory, bundle.index_name),
                   f"describes an impossible layout ({e})") from e
    try:
        reads.read_all(file_reads)
    except reads.ShortReadError as e:
        raise fail(bundle.prefix, e.path, "is shorter than its manifest records "
                   "(truncated while being read)") from e
    except FileNotFoundError as e:
        raise fail(bundle.prefix, e.filename, "is missing") from e
    if not bundle.checksums:
        return out
    for shard, fr in zip(sorted(dests), file_reads, strict=True):
        for entry, (_, buf), crc in zip(entries[shard], dests[shard], fr.dest_crcs, strict=True):
            if entry.dtype == STRING:
                check_string(bundle, fr.path, entry, buf)
            elif masked(crc) != entry.crc32c:
                raise fail(bundle.prefix, fr.path, f"fails the CRC32C check of the tensor at "
                           f"byte {entry.offset} (stored {entry.crc32c:#010x}, computed "
                           f"{masked(crc):#010x})")
    return out


# -- building the slice a RestoreV2 asks for from the pieces -------------------------


@dataclass(frozen=True)
class Request:
    """One tensor a ``RestoreV2`` asks for, and the pieces that hold it.

    Attributes:
        key: Its checkpoint key.
        dtype: Its dtype.
        target: The slice asked for (all of the tensor for an empty spec).
        pieces: The pieces it overlaps; one piece of exactly ``target``'s
            bounds when there is one (``exact``).
    """

    key: str
    dtype: tf.DType
    target: Slice
    pieces: tuple[Piece, ...]

    @property
    def exact(self) -> bool:
        """Whether one piece is exactly the slice asked for (handed over without a copy)."""
        return len(self.pieces) == 1 and self.pieces[0].slice.bounds == self.target.bounds


def _volume(bounds) -> int:
    return math.prod(hi - lo for lo, hi in bounds)


def plan(bundle: Bundle, key: str, spec: str, dtype) -> Request | None:
    """How to answer a ``RestoreV2`` of ``key`` with shape-and-slice ``spec`` as ``dtype``.

    Any stored layout answers any request TensorFlow's reader answers: a
    whole tensor or a slice of it, from a tensor saved whole or in slices
    (a ``ShardedVariable`` restored into another number of shards, or into
    one variable, and back).

    Returns:
        The request, or None where TensorFlow's reader must answer: a
        dtype other than saved or not a plain one, a spec that does not
        parse or names another full shape, slices that do not cover the
        one asked for (TensorFlow then raises its own error).
    """
    entry = bundle.index.entries.get(key)
    if entry is None or PLAIN.get(entry.dtype) != tf.as_dtype(dtype).base_dtype:
        return None
    full = _bundle.shape_of(entry)
    if spec:
        try:
            target = parse_spec(spec)
        except ValueError:
            return None
        if target.full_shape != full:
            return None
    else:
        target = full_slice(full)
    bounds = target.bounds
    stored = bundle.pieces(key)
    for piece in stored:
        if piece.slice.bounds == bounds:
            return Request(key, PLAIN[entry.dtype], target, (piece,))
    used = [(p, cut) for p in stored if (cut := intersect(p.slice.bounds, bounds)) is not None]
    if sum(_volume(cut) for _, cut in used) != _volume(bounds):  # (stored slices never overlap)
        return None
    return Request(key, PLAIN[entry.dtype], target, tuple(p for p, _ in used))


def assemble(request: Request, array_of) -> np.ndarray:
    """The slice ``request`` asks for, copied from its pieces' arrays.

    ``array_of(piece_id)``: the array read for that piece.
    """
    np_dtype = np.dtype(request.dtype.as_numpy_dtype)
    out = aligned_empty(list(request.target.shape), np_dtype, 0)
    raw = np.dtype((np.void, np_dtype.itemsize))  # copies bytes, whatever the dtype
    target = request.target.bounds
    for piece in request.pieces:
        cut = intersect(piece.slice.bounds, target)
        if cut is None:
            continue
        into = tuple(slice(lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(cut, target, strict=True))
        src = tuple(slice(lo - s0, hi - s0)
                    for (lo, hi), (s0, _) in zip(cut, piece.slice.bounds, strict=True))
        out.view(raw)[into] = array_of(piece.id).view(raw)[src]
    return out


def predict(root, bundle: Bundle) -> set[str] | None:
    """The keys a restore of ``bundle`` into ``root`` (a ``tf.train.Checkpoint``) will ask for.

    The object graph is read by TensorFlow here (``tf.train.CheckpointView``,
    public API) after the caller has checked its CRC32C; None when it cannot
    be read or matched (the caller then reads every tensor).
    """
    if OBJECT_GRAPH_KEY not in bundle.index.entries:
        return None
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    from asyncckpt.tf import _compat

    try:
        view = tf.train.CheckpointView(bundle.prefix)
        matched = set(view.match(_compat.graph_view_of(root).root))
        reader = tf.train.load_checkpoint(bundle.prefix)
        proto = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
            reader.get_tensor(OBJECT_GRAPH_KEY))
    except Exception as e:  # a graph TensorFlow itself would fail to match: it says so
        logger.debug("%s: no restore prediction (%s)", bundle.prefix, e)
        return None
    # restore() creates the save counter and restores it (read() leaves it: 8 bytes).
    matched.update(c.node_id for c in proto.nodes[0].children if c.local_name == "save_counter")
    for node_id in list(matched):
        for slot in proto.nodes[node_id].slot_variables:  # node_id: an optimizer
            if slot.original_variable_node_id in matched:
                matched.add(slot.slot_variable_node_id)
    entries = bundle.index.entries
    return {a.checkpoint_key for n in matched if n < len(proto.nodes)
            for a in proto.nodes[n].attributes if a.checkpoint_key in entries}
