"""Reads TensorFlow's bundle index: where each tensor lies in the data files.

A TensorFlow checkpoint's ``.index`` file is an SSTable (LevelDB's table
format) mapping each tensor's checkpoint key to a ``BundleEntryProto``
(dtype, shape, shard, offset, size, masked CRC32C), plus a
``BundleHeaderProto`` under the empty key. Knowing the offsets lets a
restore read the tensors itself, in parallel, straight into the arrays it
hands to TensorFlow, while the files stay the ones TensorFlow wrote (and
any TensorFlow can still read them).

Only what the bundle writer produces is read: uncompressed blocks (any
other block type raises ``BundleFormatError``, and the caller falls back to
TensorFlow's own reader).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_MAGIC = 0xDB4775248B80FB57  # tsl::table::kTableMagicNumber
_FOOTER = 48  # two block handles padded to 40 bytes, then the magic number
_TRAILER = 5  # block type byte + masked CRC32C


class BundleFormatError(ValueError):
    """The index is not an uncompressed TensorFlow bundle SSTable."""


@dataclass(frozen=True)
class BundleIndex:
    """A parsed ``.index`` file.

    Attributes:
        num_shards: Number of data files (``.data-0000i-of-0000n``).
        entries: Checkpoint key -> ``BundleEntryProto``.
    """

    num_shards: int
    entries: dict


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
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
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        vlen, pos = _varint(block, pos)
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
    _, pos = _varint(footer, 0)  # metaindex offset
    _, pos = _varint(footer, pos)  # metaindex size
    index_offset, pos = _varint(footer, pos)
    index_size, _ = _varint(footer, pos)
    header = None
    entries = {}
    for _, handle in _block(data, index_offset, index_size):
        offset, p = _varint(handle, 0)
        size, _ = _varint(handle, p)
        for key, value in _block(data, offset, size):
            if key == b"":
                header = tensor_bundle_pb2.BundleHeaderProto.FromString(value)
            else:
                entries[key.decode()] = tensor_bundle_pb2.BundleEntryProto.FromString(value)
    if header is None:
        raise BundleFormatError("no bundle header")
    if header.endianness != tensor_bundle_pb2.BundleHeaderProto.LITTLE:
        raise BundleFormatError("big-endian bundle")
    return BundleIndex(num_shards=header.num_shards, entries=entries)


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
        n, pos = _varint(encoded, pos)
        lengths.append(n)
    if pos + 4 + sum(lengths) != len(encoded):
        raise BundleFormatError("string tensor encoding does not match its lengths")
    packed = b"".join(struct.pack("<I", n) if n <= 0xFFFFFFFF else struct.pack("<Q", n)
                      for n in lengths)
    crc = google_crc32c.value(packed)
    return google_crc32c.extend(crc, bytes(encoded[pos:]))
