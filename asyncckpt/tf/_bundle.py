"""Reads TensorFlow's bundle index: where each tensor lies in the data files.

A TensorFlow checkpoint's ``.index`` file is an SSTable (LevelDB's table
format) mapping each tensor's checkpoint key to a ``BundleEntryProto``
(dtype, shape, shard, offset, size, masked CRC32C), plus a
``BundleHeaderProto`` under the empty key. Knowing the offsets lets a
restore read the tensors itself, in parallel, straight into the arrays it
hands to TensorFlow, while the files stay the ones TensorFlow wrote (and
any TensorFlow can still read them).

Every key TensorFlow writes is read: the header's (``""``), the tensors'
(UTF-8 checkpoint keys) and the slices of partitioned tensors (binary
``OrderedCode`` keys, ``_slices.parse_slice_key``), checked against the
slices the full tensor's entry lists. Only uncompressed blocks are read:
anything this module does not understand (another block type, a key that
is neither, slices that do not match their listing or overlap) raises
``BundleFormatError`` before anything is read from the data files, and the
caller hands the whole restore to TensorFlow's own reader.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass, field

from asyncckpt.errors import AsyncCkptError
from asyncckpt.tf._slices import WHOLE, Slice, intersect, is_slice_key, parse_slice_key

_MAGIC = 0xDB4775248B80FB57  # tsl::table::kTableMagicNumber
_FOOTER = 48  # two block handles padded to 40 bytes, then the magic number
_TRAILER = 5  # block type byte + masked CRC32C


class BundleFormatError(AsyncCkptError, ValueError):
    """The index is not an uncompressed TensorFlow bundle SSTable."""


@dataclass(frozen=True)
class StoredSlice:
    """One stored slice of a partitioned tensor.

    Attributes:
        slice: Where it lies in the full tensor.
        entry: Its ``BundleEntryProto`` (dtype, slice shape, shard, offset,
            size, CRC32C).
    """

    slice: Slice
    entry: object


@dataclass(frozen=True)
class BundleIndex:
    """A parsed ``.index`` file.

    Attributes:
        num_shards: Number of data files (``.data-0000i-of-0000n``).
        entries: Checkpoint key -> ``BundleEntryProto``. A partitioned
            tensor's entry has the full shape, lists its ``slices`` and holds
            no bytes.
        slices: Checkpoint key of each partitioned tensor -> its stored
            slices, in the order its entry lists them.
    """

    num_shards: int
    entries: dict
    slices: dict[str, tuple[StoredSlice, ...]] = field(default_factory=dict)


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The unsigned LEB128 varint at ``buf[pos]`` and the position after it.

    TensorFlow's encoding of lengths in SSTables, string tensors and variant lists.

    Raises:
        BundleFormatError: ``buf`` ends inside it, or it is over 64 bits.
    """
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise BundleFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise BundleFormatError("varint too long")


_SNAPPY = 1  # tsl::table::kSnappyCompression, the one compression TensorFlow's tables know


def unsnappy(data: bytes) -> bytes:
    """A Snappy-compressed block, decompressed (bounded by what its bytes can expand to).

    Raises:
        BundleFormatError: not valid Snappy.
    """
    n, pos = read_varint(data, 0)
    if n > 32 * len(data):  # a 3-byte copy makes at most 64 bytes
        raise BundleFormatError("Snappy block declares more than it can hold")
    out = bytearray()
    while pos < len(data):
        tag = data[pos]
        pos += 1
        if tag & 3 == 0:  # literal
            length = tag >> 2
            if length >= 60:
                extra = length - 59
                length = int.from_bytes(data[pos:pos + extra], "little")
                pos += extra
            length += 1
            if pos + length > len(data):
                raise BundleFormatError("Snappy literal past the block")
            out += data[pos:pos + length]
            pos += length
        else:  # a copy of earlier output
            if tag & 3 == 1:
                length, offset, width = ((tag >> 2) & 7) + 4, (tag >> 5) << 8, 1
            else:
                length, offset, width = (tag >> 2) + 1, 0, 2 if tag & 3 == 2 else 4
            if pos + width > len(data):
                raise BundleFormatError("Snappy copy past the block")
            offset |= int.from_bytes(data[pos:pos + width], "little")
            pos += width
            if not 0 < offset <= len(out) or len(out) + length > n:
                raise BundleFormatError("bad Snappy copy")
            for _ in range(length):
                out.append(out[-offset])
        if len(out) > n:
            raise BundleFormatError("Snappy block longer than it declares")
    if len(out) != n:
        raise BundleFormatError("Snappy block shorter than it declares")
    return bytes(out)


def _block(data: bytes, offset: int, size: int, *,
           decompress: bool = False) -> list[tuple[bytes, bytes]]:
    """The (key, value) entries of one block at ``offset`` (``decompress``: Snappy too)."""
    end = offset + size
    if end + _TRAILER > len(data) or size < 0:
        raise BundleFormatError("block out of the file")
    if data[end] == _SNAPPY and decompress:
        block = unsnappy(data[offset:end])
    elif data[end] != 0:
        raise BundleFormatError(f"compressed block (type {data[end]})")
    else:
        block = data[offset:end]
    if len(block) < 4:
        raise BundleFormatError("block shorter than its restart count")
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 - 4 * restarts
    if limit < 0:
        raise BundleFormatError("bad restart array")
    out = []
    pos = 0
    key = b""
    while pos < limit:
        shared, pos = read_varint(block, pos)
        unshared, pos = read_varint(block, pos)
        vlen, pos = read_varint(block, pos)
        if shared > len(key) or pos + unshared + vlen > limit:
            raise BundleFormatError("bad block entry")
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        out.append((key, block[pos:pos + vlen]))
        pos += vlen
    return out


def stored_entries(data: bytes, *, decompress: bool = False
                   ) -> tuple[object, list[tuple[bytes, object]]]:
    """The header and every ``(key, BundleEntryProto)`` of an index, as stored.

    Args:
        data: The ``.index`` file.
        decompress: Read Snappy-compressed blocks too (TensorFlow's reader
            does; asyncckpt's reads only the uncompressed ones TensorFlow writes).

    Raises:
        BundleFormatError: Not an (uncompressed) SSTable of bundle entries.
    """
    from google.protobuf.message import DecodeError
    from tensorflow.core.protobuf import tensor_bundle_pb2

    if len(data) < _FOOTER:
        raise BundleFormatError("file shorter than a table footer")
    footer = data[-_FOOTER:]
    (magic,) = struct.unpack_from("<Q", footer, _FOOTER - 8)
    if magic != _MAGIC:
        raise BundleFormatError("not an SSTable (bad magic number)")
    _, pos = read_varint(footer, 0)  # metaindex offset
    _, pos = read_varint(footer, pos)  # metaindex size
    index_offset, pos = read_varint(footer, pos)
    index_size, _ = read_varint(footer, pos)
    header = None
    entries = []
    try:
        for _, handle in _block(data, index_offset, index_size, decompress=decompress):
            offset, p = read_varint(handle, 0)
            size, _ = read_varint(handle, p)
            for key, value in _block(data, offset, size, decompress=decompress):
                if key == b"":
                    header = tensor_bundle_pb2.BundleHeaderProto.FromString(value)
                else:
                    entries.append((key, tensor_bundle_pb2.BundleEntryProto.FromString(value)))
    except DecodeError as e:
        raise BundleFormatError(f"an entry is not a bundle entry ({e})") from None
    return header, entries


def parse_index(data: bytes) -> BundleIndex:
    """Parses the bytes of a ``.index`` file.

    Raises:
        BundleFormatError: Not an uncompressed bundle index.
    """
    from tensorflow.core.protobuf import tensor_bundle_pb2

    header, raw = stored_entries(data)
    entries = {}
    stored: dict[str, dict[tuple, object]] = {}  # key -> (starts, lengths) -> entry
    for key, entry in raw:
        if is_slice_key(key):
            try:
                name, starts, lengths = parse_slice_key(key)
            except ValueError as e:
                raise BundleFormatError(f"slice key {key!r}: {e}") from None
            stored.setdefault(name, {})[(starts, lengths)] = entry
            continue
        try:
            entries[key.decode()] = entry
        except UnicodeDecodeError:
            raise BundleFormatError(f"key {key!r} is neither UTF-8 nor a slice key") from None
    if header is None:
        raise BundleFormatError("no bundle header")
    if header.endianness != tensor_bundle_pb2.BundleHeaderProto.LITTLE:
        raise BundleFormatError("big-endian bundle")
    return BundleIndex(num_shards=header.num_shards, entries=entries,
                       slices=_match_slices(entries, stored))


# Bytes per element of the dtypes whose tensors are stored as raw elements: their
# size in the data file follows from the shape.
_WIDTHS = {
    "DT_FLOAT": 4, "DT_DOUBLE": 8, "DT_INT32": 4, "DT_UINT8": 1, "DT_INT16": 2,
    "DT_INT8": 1, "DT_COMPLEX64": 8, "DT_INT64": 8, "DT_BOOL": 1, "DT_QINT8": 1,
    "DT_QUINT8": 1, "DT_QINT32": 4, "DT_BFLOAT16": 2, "DT_QINT16": 2, "DT_QUINT16": 2,
    "DT_UINT16": 2, "DT_COMPLEX128": 16, "DT_HALF": 2, "DT_UINT32": 4, "DT_UINT64": 8,
}


@functools.cache
def _element_bytes() -> dict[int, int]:
    """``_WIDTHS`` by ``types_pb2.DataType`` value."""
    from tensorflow.core.framework import types_pb2

    return {getattr(types_pb2, name): width for name, width in _WIDTHS.items()}


# Bundles of more data files than this are refused before their names are made.
MAX_SHARDS = 1 << 16


def entry_problem(key: object, entry, num_shards: int,
                  data_sizes: dict[int, int | None]) -> str | None:
    """What is impossible about one stored entry, or None.

    Its shape has no negative (or unknown) dimension; its bytes lie in a
    data file of the bundle (``data_sizes``: shard -> its size, None where
    unknown) and, for a dtype of fixed-width elements, are exactly the
    shape's elements. An entry listing slices holds no bytes itself. These
    are what a reader sizes its buffers from, so they are checked before
    any buffer is sized or TensorFlow's reader is called.
    """
    if entry.shape.unknown_rank or any(d.size < 0 for d in entry.shape.dim):
        return f"records tensor {key!r} with the shape {shape_of(entry)}"
    if entry.slices:
        return None
    if not 0 <= entry.shard_id < num_shards:
        return f"puts tensor {key!r} in data file {entry.shard_id} of {num_shards}"
    if entry.offset < 0 or entry.size < 0:
        return f"puts tensor {key!r} at byte {entry.offset}, {entry.size} bytes"
    width = _element_bytes().get(entry.dtype)
    if width is not None:
        need = math.prod(shape_of(entry)) * width
        if need != entry.size:
            return (f"records {entry.size} bytes for tensor {key!r} of shape "
                    f"{list(shape_of(entry))} (which needs {need})")
    have = data_sizes.get(entry.shard_id)
    if have is not None and entry.offset + entry.size > have:
        return (f"puts tensor {key!r} at bytes {entry.offset}..{entry.offset + entry.size} of "
                f"a data file of {have} bytes")
    return None


def index_problem(index: BundleIndex, data_sizes: dict[int, int | None]) -> str | None:
    """``entry_problem`` of every entry and stored slice of a parsed index, the first found."""
    if not 0 <= index.num_shards <= MAX_SHARDS:
        return f"names {index.num_shards} data files"
    for key, entry in index.entries.items():
        if (problem := entry_problem(key, entry, index.num_shards, data_sizes)) is not None:
            return problem
    for key, pieces in index.slices.items():
        for piece in pieces:
            problem = entry_problem(f"{key} {piece.slice.starts}", piece.entry,
                                    index.num_shards, data_sizes)
            if problem is not None:
                return problem
    return None


def check_for_reader(prefix: str, *, data_sizes: dict[str, int] | None = None) -> None:
    """Refuses an index TensorFlow's reader must not be given.

    TensorFlow's reader trusts the ``.index``: a negative dimension aborts
    the process, a huge shape sizes a huge buffer. This reads the index as
    stored (``stored_entries``, Snappy-compressed blocks too: whatever this
    module would not restore itself, compressed blocks, slices or keys
    TensorFlow lays out otherwise, are still entries) and checks each entry
    (``entry_problem``) against the data files' sizes: ``data_sizes`` (file
    name -> size, a manifest's) or the files found beside it. An index that
    is no SSTable of entries cannot be checked: with a manifest it is damage,
    another tool's is left to TensorFlow (which refuses it). A missing index
    is left to TensorFlow too (its own "not found").

    Raises:
        CorruptCheckpointError: naming the ``.index``.
    """
    from asyncckpt._engine import contained
    from asyncckpt.errors import CorruptCheckpointError

    path = prefix + ".index"
    try:
        data = contained.read_file(path, checkpoint=prefix)
    except FileNotFoundError:
        return
    try:
        header, raw = stored_entries(data, decompress=True)
    except BundleFormatError as e:
        if data_sizes is None:
            return  # another tool's index, not a table this module reads: TensorFlow's
        raise CorruptCheckpointError(
            f"checkpoint {prefix!r} is corrupt: file {path!r} is not a bundle index ({e})",
            checkpoint=prefix, file=path) from e
    num_shards = header.num_shards if header is not None else 1
    problem = None if 0 <= num_shards <= MAX_SHARDS else f"names {num_shards} data files"
    sizes: dict[int, int | None] = {}
    base = os.path.basename(prefix)
    for _, entry in raw:
        shard = entry.shard_id
        if problem is not None or shard in sizes or not 0 <= shard < num_shards:
            continue
        name = os.path.basename(data_file(prefix, shard, num_shards))
        if data_sizes is not None:
            sizes[shard] = data_sizes.get(name)
            if sizes[shard] is None and not entry.slices and entry.size:
                problem = (f"puts tensor bytes in {name!r}, which the manifest of "
                           f"{base!r} does not list")
            continue
        try:
            sizes[shard] = contained.regular_size(os.path.join(os.path.dirname(path), name),
                                                  checkpoint=prefix)
        except OSError:
            sizes[shard] = None  # missing: TensorFlow says so
    for key, entry in raw:
        if problem is not None:
            break
        problem = entry_problem(key, entry, num_shards, sizes)
    if problem is not None:
        raise CorruptCheckpointError(f"checkpoint {prefix!r} is corrupt: file {path!r} {problem}",
                                     checkpoint=prefix, file=path)


def shape_of(entry) -> tuple[int, ...]:
    """The shape a ``BundleEntryProto`` records."""
    return tuple(d.size for d in entry.shape.dim)


def _match_slices(entries: dict, stored: dict[str, dict]) -> dict[str, tuple[StoredSlice, ...]]:
    """Each partitioned tensor's slices, exactly as its entry lists them.

    TensorFlow's reader looks each listed slice up by its key and refuses
    overlapping slices; anything else here is a format this reader does not
    vouch for, so it raises and TensorFlow's reader decides.
    """
    out = {}
    for key, entry in entries.items():
        if not entry.slices:
            continue
        full = shape_of(entry)
        have = stored.pop(key, {})
        pieces = []
        for proto in entry.slices:
            if len(proto.extent) != len(full):
                raise BundleFormatError(f"{key!r} lists a slice of another rank")
            starts = tuple(e.start for e in proto.extent)
            lengths = tuple(e.length if e.HasField("length") else WHOLE
                            for e in proto.extent)
            piece = have.pop((starts, lengths), None)
            if piece is None:
                raise BundleFormatError(f"{key!r} lists a slice {starts}/{lengths} that is "
                                        "not stored")
            sl = Slice(full, starts, lengths)
            if (any(stop > d for (_, stop), d in zip(sl.bounds, full, strict=True))
                    or piece.dtype != entry.dtype or shape_of(piece) != sl.shape
                    or piece.slices):
                raise BundleFormatError(f"slice {starts}/{lengths} of {key!r} does not match "
                                        "its tensor")
            pieces.append(StoredSlice(sl, piece))
        if have:
            raise BundleFormatError(f"{key!r} has slices its entry does not list")
        for i, a in enumerate(pieces):
            for b in pieces[:i]:
                if intersect(a.slice.bounds, b.slice.bounds) is not None:
                    raise BundleFormatError(f"{key!r} has overlapping slices")
        out[key] = tuple(pieces)
    if stored:
        raise BundleFormatError(f"slices of tensors without an entry: {sorted(stored)}")
    return out


def data_file(prefix: str, shard: int, num_shards: int) -> str:
    """Path of one data file of the bundle at ``prefix``."""
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


def string_tensor_crc32c(encoded: bytes, count: int) -> int:
    """The (unmasked) CRC32C TensorFlow records for a string tensor's encoding.

    A string tensor of ``count`` elements is stored as the varint lengths,
    a 4-byte masked CRC32C of those lengths, then the bytes. TensorFlow's
    checksum runs over each length as a little-endian uint32 (uint64 past
    4 GiB) rather than its varint, then those 4 bytes, then the bytes.

    Raises:
        BundleFormatError: The encoding is shorter than its lengths say.
    """
    import google_crc32c

    pos = 0
    lengths = []
    for _ in range(count):
        n, pos = read_varint(encoded, pos)
        lengths.append(n)
    if pos + 4 + sum(lengths) != len(encoded):
        raise BundleFormatError("string tensor encoding does not match its lengths")
    packed = b"".join(struct.pack("<I", n) if n <= 0xFFFFFFFF else struct.pack("<Q", n)
                      for n in lengths)
    crc = google_crc32c.value(packed)
    return google_crc32c.extend(crc, bytes(encoded[pos:]))
