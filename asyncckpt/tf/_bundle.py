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


def _block(data: bytes, offset: int, size: int) -> list[tuple[bytes, bytes]]:
    """The (key, value) entries of one block at ``offset``."""
    end = offset + size
    if end + _TRAILER > len(data) or size < 4:
        raise BundleFormatError("block out of the file")
    if data[end] != 0:
        raise BundleFormatError(f"compressed block (type {data[end]})")
    block = data[offset:end]
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


def parse_index(data: bytes) -> BundleIndex:
    """Parses the bytes of a ``.index`` file.

    Raises:
        BundleFormatError: Not an uncompressed bundle index.
    """
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
    entries = {}
    stored: dict[str, dict[tuple, object]] = {}  # key -> (starts, lengths) -> entry
    for _, handle in _block(data, index_offset, index_size):
        offset, p = read_varint(handle, 0)
        size, _ = read_varint(handle, p)
        for key, value in _block(data, offset, size):
            if key == b"":
                header = tensor_bundle_pb2.BundleHeaderProto.FromString(value)
                continue
            entry = tensor_bundle_pb2.BundleEntryProto.FromString(value)
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
