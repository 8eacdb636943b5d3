"""Builds the ``.index`` file of a TensorFlow bundle: a LevelDB-format SSTable.

Uncompressed blocks with a masked CRC32C trailer, 256 KiB data blocks with a
restart point every 16 keys, an index block, an empty metaindex block and
the 48-byte footer, built exactly as TensorFlow's ``TableBuilder`` builds
them (the bundle writer's tests compare the files byte for byte with
``SaveV2``'s). ``asyncckpt.tf._bundle`` reads them.
"""

from __future__ import annotations

import struct

from asyncckpt._engine import fastcrc
from asyncckpt._engine.varint import varint

_BLOCK_SIZE = 262144  # tsl::table::Options().block_size
_RESTART_INTERVAL = 16  # tsl::table::Options().block_restart_interval
_MAGIC = 0xDB4775248B80FB57  # tsl::table::kTableMagicNumber
_HANDLE_MAX = 20  # BlockHandle::kMaxEncodedLength


class _Block:
    """tsl::table::BlockBuilder: prefix-compressed entries with restart points."""

    def __init__(self, restart_interval: int):
        self.interval = restart_interval
        self.reset()

    def reset(self) -> None:
        self.buf = bytearray()
        self.restarts = [0]
        self.counter = 0
        self.last = b""

    @property
    def empty(self) -> bool:
        return not self.buf

    def size_estimate(self) -> int:
        return len(self.buf) + 4 * len(self.restarts) + 4

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.counter < self.interval:
            limit = min(len(key), len(self.last))
            while shared < limit and key[shared] == self.last[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buf))
            self.counter = 0
        self.buf += varint(shared) + varint(len(key) - shared) + varint(len(value))
        self.buf += key[shared:] + value
        self.last = key
        self.counter += 1

    def finish(self) -> bytes:
        out = bytes(self.buf) + b"".join(struct.pack("<I", r) for r in self.restarts)
        out += struct.pack("<I", len(self.restarts))
        self.reset()
        return out


def _separator(start: bytes, limit: bytes) -> bytes:
    """The bytewise comparator's FindShortestSeparator."""
    n = min(len(start), len(limit))
    i = 0
    while i < n and start[i] == limit[i]:
        i += 1
    if i < n and start[i] < 0xFF and start[i] + 1 < limit[i]:
        return start[:i] + bytes([start[i] + 1])
    return start


def _successor(key: bytes) -> bytes:
    """The bytewise comparator's FindShortSuccessor."""
    for i, b in enumerate(key):
        if b != 0xFF:
            return key[:i] + bytes([b + 1])
    return key


def build_table(items: list[tuple[bytes, bytes]]) -> bytes:
    """An uncompressed SSTable of sorted ``(key, value)`` pairs, as TableBuilder writes it."""
    out = bytearray()

    def write_block(contents: bytes) -> bytes:
        handle = varint(len(out)) + varint(len(contents))
        crc = fastcrc.crc32c_extend(fastcrc.crc32c_extend(0, contents), b"\x00")
        out.extend(contents + b"\x00" + struct.pack("<I", fastcrc.mask(crc)))
        return handle

    data = _Block(_RESTART_INTERVAL)
    index = _Block(1)
    pending: bytes | None = None  # handle of the last data block, not yet indexed
    last = b""
    for n, (key, value) in enumerate(items):
        if n and len(key) + len(value) >= 2 * _BLOCK_SIZE and not data.empty:
            pending = write_block(data.finish())
        if pending is not None:
            index.add(_separator(last, key), pending)
            pending = None
        last = key
        data.add(key, value)
        if data.size_estimate() >= _BLOCK_SIZE:
            pending = write_block(data.finish())
    if not data.empty:
        pending = write_block(data.finish())
    metaindex = write_block(_Block(_RESTART_INTERVAL).finish())
    if pending is not None:
        index.add(_successor(last), pending)
    index_handle = write_block(index.finish())
    footer = (metaindex + index_handle).ljust(2 * _HANDLE_MAX, b"\x00")
    out += footer + struct.pack("<II", _MAGIC & 0xFFFFFFFF, _MAGIC >> 32)
    return bytes(out)
