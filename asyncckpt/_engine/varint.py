"""LEB128 varints (protobuf's, LevelDB's): the integers of the on-disk formats asyncckpt
writes itself, TensorFlow's bundle index (``tf/_sstable.py``, ``tf/_bundlewrite.py``) and
OCDBT's B-tree nodes and manifests (``jax/_ocdbtwrite.py``)."""

from __future__ import annotations

_ONE_BYTE = [bytes((i,)) for i in range(0x80)]  # most varints written are one byte


def varint(n: int) -> bytes:
    """``n`` (non-negative) as a varint: 7 bits a byte, least significant first."""
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
