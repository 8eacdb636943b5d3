"""OCDBT databases encoded by asyncckpt itself: B-tree nodes and manifests.

A JAX save in the OCDBT layout (``_ocdbt``) writes each process's database
without TensorStore: the values go into data files with plain writes,
straight from the staging buffers, checksummed as they are written and
fsynced once per file (``_ocdbt.DatabaseWriter``); this module encodes the
rest, the B-tree that maps each key to its value and the manifest that
names the tree's root. Through TensorStore's driver the same bytes took
2-3x a raw write+fsync to become durable on this project's VM (its
writes, then reading every file back for the manifest's checksums).

The encoding is TensorStore's documented OCDBT format, version 0, in the
subset a checkpoint needs:

* one version (generation 1), its root inline in the manifest, no version
  tree nodes; the single-file manifest kind;
* nodes and manifests uncompressed (compression method 0);
* a value of at most ``max_inline_value_bytes`` is stored inline in its
  leaf, a larger one is a (data file, offset, length) reference;
* leaves filled in key order up to ``max_decoded_node_bytes``; where there
  are more keys than one leaf holds, interior nodes over them, up to a
  single root. Every node of a database goes into one node file.

Every structure is framed the same way: a magic number (big-endian
``uint32``), the whole length (``uint64`` little-endian), the format
version and the compression method (varints), the body, then the CRC32C
of everything before it (``uint32`` little-endian). A data file table names
each file a node or manifest refers to as ``(base path, relative path)``;
a node reached through a base path resolves its own files' paths below it,
which is how an item's root manifest refers to process 0's tree without a
node of its own (``_ocdbt.DatabaseWriter.finish``).

TensorStore, and through it orbax, read these databases: the tests read
every save back through TensorStore's kvstore and orbax's restore, and a
multi-process save merges them with TensorStore (``_ocdbt.merge``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from asyncckpt._engine import fastcrc
from asyncckpt._engine.varint import varint

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_MAGIC = 0x0CDB20DE
FORMAT_VERSION = 0
UNCOMPRESSED = 0
MANIFEST_SINGLE_FILE = 0  # manifest kind: the manifest is one file, manifest.ocdbt
VERSION_TREE_ARITY_LOG2 = 4  # TensorStore's default; no version tree nodes are written
_ENTRY_OVERHEAD = 24  # bytes a leaf entry takes besides its key and inline value, at most


@dataclass(frozen=True)
class Config:
    """A database's configuration, recorded in its manifest.

    Attributes:
        uuid: 16 random bytes naming the database.
        max_inline_value_bytes: Values up to this size are stored in their leaf.
        max_decoded_node_bytes: The largest node (uncompressed) a reader accepts.
    """

    uuid: bytes
    max_inline_value_bytes: int
    max_decoded_node_bytes: int


Value = tuple[bytes, int, bytes | None, int, int]
"""One key of a leaf and where its value is: ``(key, size, inline, file, offset)``.

``key``: the key, as bytes (keys sort as unsigned bytes); ``size``: the
value's length; ``inline``: the value's bytes when stored in the leaf, None
when it is in a data file; ``file``: that data file (an index into the
leaf's data file table); ``offset``: the value's first byte in it.

A plain tuple, not a class: a save of thousands of shards makes one per
shard, and tuples of bytes and ints are dropped from the garbage
collector's tracking (a dataclass instance per value was promoted and set
off full collections, each 40-50 ms with JAX loaded, at 4,000 shards).
"""


@dataclass(frozen=True)
class Root:
    """The root node of a tree written by ``encode_tree``, as a manifest refers to it.

    Attributes:
        offset: Its first byte in the node file.
        length: Its length.
        height: 0 for a leaf.
        num_keys: Keys in the tree.
        num_tree_bytes: Bytes of every node of the tree.
        num_indirect_value_bytes: Bytes of the values in data files.
    """

    offset: int
    length: int
    height: int
    num_keys: int
    num_tree_bytes: int
    num_indirect_value_bytes: int


def _frame(magic: int, body: bytes) -> bytes:
    """Header, ``body`` (uncompressed), CRC32C footer."""
    total = 4 + 8 + 1 + 1 + len(body) + 4  # version and compression: one-byte varints
    head = struct.pack(">I", magic) + struct.pack("<Q", total) + bytes(
        (FORMAT_VERSION, UNCOMPRESSED))
    framed = head + body
    return framed + struct.pack("<I", fastcrc.crc32c_extend(0, framed))


def _file_table(paths: Sequence[tuple[str, str]]) -> bytes:
    """A data file table of ``(base path, relative path)`` pairs, without prefix sharing.

    Readers accept any order; a prefix length of 0 for every path keeps the
    rule on base paths trivially true.
    """
    encoded = [(base.encode(), rel.encode()) for base, rel in paths]
    out = [varint(len(encoded))]
    out += [varint(0)] * max(0, len(encoded) - 1)  # prefix shared with the previous path
    out += [varint(len(b) + len(r)) for b, r in encoded]
    out += [varint(len(b)) for b, _ in encoded]
    out += [b + r for b, r in encoded]
    return b"".join(out)


def _key_columns(keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """A node's key columns for sorted ``keys``: each key's prefix shared with the one
    before (from the second key on), the length of the rest, and the rest.

    No prefix is shared: every key is stored whole (readers take any shared
    length; a state of 4,500 keys encodes 10 ms faster, its node ~60 KiB larger).
    """
    return ([varint(0)] * (len(keys) - 1), [varint(len(k)) for k in keys], list(keys))


def encode_leaf(values: Sequence[Value], files: Sequence[tuple[str, str]]) -> bytes:
    """A leaf B-tree node holding ``values`` (sorted by key, keys unique).

    ``files``: the data file table that each value's ``file`` indexes.
    """
    prefixes, lengths, suffixes = _key_columns([v[0] for v in values])
    indirect = [v for v in values if v[2] is None]
    body = [bytes((0,)), _file_table(files), varint(len(values)), *prefixes, *lengths, *suffixes]
    body += [varint(v[1]) for v in values]
    body += [b"\x01" if v[2] is None else b"\x00" for v in values]
    body += [varint(v[3]) for v in indirect]
    body += [varint(v[4]) for v in indirect]
    body += [v[2] for v in values if v[2] is not None]
    return _frame(BTREE_MAGIC, b"".join(body))


@dataclass(frozen=True)
class _Child:
    first_key: bytes
    offset: int
    length: int
    num_keys: int
    num_tree_bytes: int
    num_indirect_value_bytes: int


def _encode_interior(height: int, children: Sequence[_Child], node_file: tuple[str, str]) -> bytes:
    prefixes, lengths, suffixes = _key_columns([c.first_key for c in children])
    body = [bytes((height,)), _file_table([node_file]), varint(len(children)), *prefixes,
            *lengths]
    body += [varint(0)] * len(children)  # no prefix is common to a whole subtree's keys
    body += suffixes
    body += [varint(0)] * len(children)  # every child is in the node file (index 0)
    body += [varint(c.offset) for c in children]
    body += [varint(c.length) for c in children]
    body += [varint(c.num_keys) for c in children]
    body += [varint(c.num_tree_bytes) for c in children]
    body += [varint(c.num_indirect_value_bytes) for c in children]
    return _frame(BTREE_MAGIC, b"".join(body))


def _leaf_groups(values: Sequence[Value], limit: int) -> list[Sequence[Value]]:
    """``values`` in runs whose leaves stay under ``limit`` bytes (one value at least each)."""
    groups = []
    start = size = 0
    for i, (key, length, inline, _, _) in enumerate(values):
        n = len(key) + (length if inline is not None else 0) + _ENTRY_OVERHEAD
        if size and size + n > limit:
            groups.append(values[start:i])
            start, size = i, 0
        size += n
    groups.append(values[start:])
    return groups


def encode_tree(values: Sequence[Value], files: Sequence[tuple[str, str]],
                node_file: tuple[str, str], max_node_bytes: int) -> tuple[bytes, Root]:
    """Every node of a B-tree over ``values``, concatenated as one node file, and its root.

    Args:
        values: Sorted by key, keys unique, at least one.
        files: The data file table of the leaves (each value's ``file`` indexes it).
        node_file: The node file's own ``(base path, relative path)``, as
            interior nodes refer to their children in it.
        max_node_bytes: No node is larger (the database's ``max_decoded_node_bytes``).
    """
    if not values:
        raise ValueError("an OCDBT tree needs at least one key")
    blob: list[bytes] = []
    offset = 0
    level: list[_Child] = []
    # Leaves hold entries of ~24 bytes besides their key; interior entries ~48 besides theirs.
    for group in _leaf_groups(values, max_node_bytes - 1024):
        node = encode_leaf(group, files)
        indirect = sum(v[1] for v in group if v[2] is None)
        level.append(_Child(group[0][0], offset, len(node), len(group), len(node), indirect))
        blob.append(node)
        offset += len(node)
    height = 0
    while len(level) > 1:
        height += 1
        parents: list[_Child] = []
        start = size = 0
        for i, c in enumerate([*level, None]):
            n = 0 if c is None else len(c.first_key) + 48
            if c is None or (size and size + n > max_node_bytes - 1024):
                run = level[start:i]
                node = _encode_interior(height, run, node_file)
                parents.append(_Child(
                    run[0].first_key, offset, len(node), sum(r.num_keys for r in run),
                    len(node) + sum(r.num_tree_bytes for r in run),
                    sum(r.num_indirect_value_bytes for r in run)))
                blob.append(node)
                offset += len(node)
                start, size = i, 0
            size += n
        level = parents
    root = level[0]
    return b"".join(blob), Root(root.offset, root.length, height, root.num_keys,
                                root.num_tree_bytes, root.num_indirect_value_bytes)


def encode_manifest(config: Config, root: Root, root_file: tuple[str, str],
                    commit_time_ns: int) -> bytes:
    """The single-file manifest of a database with one version whose root is ``root``.

    ``root_file``: ``(base path, relative path)`` of the node file holding
    the root, from the manifest's directory; the base path also prefixes
    every file the tree's nodes name.
    """
    if len(config.uuid) != 16:
        raise ValueError("an OCDBT database uuid is 16 bytes")
    body = [config.uuid, varint(MANIFEST_SINGLE_FILE), varint(config.max_inline_value_bytes),
            varint(config.max_decoded_node_bytes), bytes((VERSION_TREE_ARITY_LOG2,)),
            varint(UNCOMPRESSED), _file_table([root_file]),
            varint(1),  # versions inline in the manifest: one
            varint(1),  # its generation number
            bytes((root.height,)),
            varint(0), varint(root.offset), varint(root.length),  # data file 0 of the table
            varint(root.num_keys), varint(root.num_tree_bytes),
            varint(root.num_indirect_value_bytes),
            struct.pack("<Q", commit_time_ns),
            varint(0)]  # version tree nodes: none
    return _frame(MANIFEST_MAGIC, b"".join(body))
