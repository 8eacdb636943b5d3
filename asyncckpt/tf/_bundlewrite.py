"""Writes TensorFlow's tensor bundle straight from the host staging buffers.

TensorFlow's ``SaveV2`` copies every tensor through an 8 MiB buffer while
it computes each tensor's CRC32C, and only then can the engine read the
file back for the manifest's CRC32 and fsync it: at 1 GiB the data file
was serialized for 1.5-1.7 s before the fsync started (issue 13). Here the
same two files are produced by asyncckpt itself:

* ``<prefix>.data-00000-of-00001``: the tensors' bytes concatenated in the
  order given (no padding: ``SaveV2`` uses an alignment of 1), written by the
  engine's data-file writer (``_engine/datafile.py``: ranges of 16 MiB that
  two threads checksum and write at their offsets, ``O_DIRECT`` from an
  aligned buffer in files of 4 MiB or more, the rest with ``pwritev`` and
  its writeback started at once), each range checksummed as it is written:
  CRC32C per tensor, combined in file order into each tensor's CRC32C and
  the whole file's (the manifest's, also CRC32C), so the engine need not
  read the file back and each byte is checksummed once.
* ``<prefix>.index``: the SSTable of ``asyncckpt.tf._sstable``, mapping
  ``""`` to the ``BundleHeaderProto`` and each key to its
  ``BundleEntryProto``.

String tensors (the object graph, Python state) use TensorFlow's string
encoding: the varint64 lengths, a masked CRC32C of the lengths, then the
bytes; their entry's CRC32C covers each length as a little-endian uint32
(uint64 past 4 GiB), the length checksum and the bytes. Variant tensors
(``tf.data`` iterator state, ``_variant``) use ``WriteVariantTensor``'s:
for each element its length as a varint64, its encoded bytes, then the
masked CRC32C of the tensor's bytes so far; their entry's CRC32C covers each
length as a little-endian uint64, the bytes and those checksums. Partitioned
variables (a non-empty slice spec) get a full-tensor entry listing its
slices and one entry per slice under TensorFlow's ordered-code key.

For the same tensors in the same order the files are byte-identical to
``SaveV2``'s (the tests compare them). Anything else (a resource tensor, a
variant whose encoding ``_variant`` does not recognize, an I/O device other
than the local CPU, a slice spec that does not parse, a host buffer whose
itemsize differs from the dtype's) returns None and the caller uses ``SaveV2``.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from asyncckpt._engine import datafile, fastcrc
from asyncckpt._engine.fastcrc import CRC32C
from asyncckpt._engine.metrics import WRITE, Phases
from asyncckpt._engine.varint import varint
from asyncckpt.tf._compat import OBJECT_GRAPH_KEY, tf
from asyncckpt.tf._slices import WHOLE, parse_spec, slice_key
from asyncckpt.tf._sstable import build_table
from asyncckpt.tf._variant import CapturedVariant

logger = logging.getLogger(__name__)

FileSums = dict[str, tuple[int, int, str]]  # file name -> (size, checksum, algorithm)


# --- encodings ---------------------------------------------------------------------


def _string_encoding(values: np.ndarray) -> tuple[list[bytes], int]:
    """A string tensor's bytes in the data file, and the CRC32C its entry records."""
    items = [bytes(v) if not isinstance(v, bytes) else v for v in values.reshape(-1)]
    lengths = b"".join(varint(len(b)) for b in items)
    packed = b"".join(struct.pack("<I", len(b)) if len(b) <= 0xFFFFFFFF
                      else struct.pack("<Q", len(b)) for b in items)
    crc = fastcrc.crc32c_extend(0, packed)
    length_sum = struct.pack("<I", fastcrc.mask(crc))
    crc = fastcrc.crc32c_extend(crc, length_sum)
    for b in items:
        crc = fastcrc.crc32c_extend(crc, b)
    return [lengths + length_sum, *items], crc


def _variant_encoding(elements: list) -> tuple[list, int]:
    """A variant tensor's bytes in the data file, and the CRC32C its entry records.

    ``elements``: each element's ``Variant::Encode`` bytes (``_variant``).
    """
    pieces: list = []
    crc = 0
    for elem in elements:
        n = len(elem)
        crc = fastcrc.crc32c_extend(crc, struct.pack("<Q", n))
        crc = fastcrc.crc32c_extend(crc, elem)
        check = struct.pack("<I", fastcrc.mask(crc))
        crc = fastcrc.crc32c_extend(crc, check)
        pieces += [varint(n), elem, check]
    return pieces, crc


# --- planning and writing -------------------------------------------------------------


@dataclass
class _Tensor:
    key: bytes
    entry: object  # BundleEntryProto
    pieces: list  # buffers, in file order
    nbytes: int
    crc: int | None = None  # CRC32C known in advance (strings)


@dataclass
class _Plan:
    tensors: list[_Tensor] = field(default_factory=list)
    entries: dict[bytes, object] = field(default_factory=dict)  # key -> BundleEntryProto


def _local_cpu(io_device: str | None) -> bool:
    if io_device is None:
        return True
    try:
        spec = tf.DeviceSpec.from_string(io_device)
    except (ValueError, TypeError):
        return False
    return ((spec.device_type or "CPU").upper() == "CPU" and spec.job in (None, "localhost")
            and spec.task in (None, 0) and spec.replica in (None, 0))


def _plan(state) -> _Plan | str:
    """The entries and data pieces for ``state``, or why only ``SaveV2`` can write it."""
    from tensorflow.core.protobuf import tensor_bundle_pb2

    if not _local_cpu(state.io_device):
        return f"io_device {state.io_device!r} is not the local CPU"
    plan = _Plan()
    staged = [(t.key, t.slice_spec, t.dtype, t.host) for t in state.tensors]
    staged.append((OBJECT_GRAPH_KEY, "", tf.string,
                   np.array(state.object_graph, dtype=object)))
    offset = 0
    for key, spec, dtype, host in staged:
        if dtype == tf.string:
            pieces, crc = _string_encoding(host)
        elif dtype == tf.variant and isinstance(host, CapturedVariant):
            elements = host.elements()
            if elements is None:
                return f"{key!r} is a variant whose encoding is not an element list"
            pieces, crc = _variant_encoding(elements)
        elif dtype in (tf.variant, tf.resource) or host.dtype.itemsize != dtype.size or (
                host.dtype == object):
            return f"{key!r} has dtype {dtype.name} (host {host.dtype})"
        else:
            if not host.flags.c_contiguous:
                return f"{key!r} is not contiguous in host memory"
            pieces, crc = [host.reshape(-1).view(np.uint8)], None
        shape = host.shape
        name = key.encode()
        if spec:
            try:
                sl = parse_spec(spec)
            except ValueError as e:
                return str(e)
            if sl.shape != tuple(shape):
                return f"slice {spec!r} of {key!r} does not match shape {shape}"
            if not sl.is_full:
                full = plan.entries.get(name)
                if full is None:
                    full = plan.entries[name] = tensor_bundle_pb2.BundleEntryProto()
                elif full.dtype != dtype.as_datatype_enum or not full.slices:
                    return f"{key!r} is saved twice"
                full.dtype = dtype.as_datatype_enum
                del full.shape.dim[:]
                for d in sl.full_shape:
                    full.shape.dim.add(size=d)
                extent = full.slices.add().extent
                for s, n in zip(sl.starts, sl.lengths, strict=True):
                    e = extent.add()
                    if n != WHOLE:
                        e.start = s
                        e.length = n
                name = slice_key(key, sl.starts, sl.lengths)
        if name in plan.entries:
            return f"{key!r} is saved twice"
        entry = tensor_bundle_pb2.BundleEntryProto(
            dtype=dtype.as_datatype_enum, shard_id=0, offset=offset)
        entry.shape.SetInParent()  # TensorFlow writes a scalar's empty shape too
        for d in shape:
            entry.shape.dim.add(size=d)
        nbytes = sum(len(memoryview(p).cast("B")) for p in pieces)
        entry.size = nbytes
        plan.entries[name] = entry
        plan.tensors.append(_Tensor(name, entry, pieces, nbytes, crc))
        offset += nbytes
    return plan


def _write_data(path: str, plan: _Plan, pause: Callable[[], None] | None = None,
                phases: Phases | None = None,
                ready: Callable[[list[int]], None] | None = None) -> tuple[int, int, str]:
    """Writes the data file; fills each entry's CRC32C; returns ``(size, crc32c, "crc32c")``.

    The engine's data-file writer (``datafile.write``): ranges checksummed
    and written by two threads, ``O_DIRECT`` where it pays; each tensor's
    CRC32C combined from its views'. ``ready``: see ``write_bundle``.
    """
    parts = [(i, piece) for i, t in enumerate(plan.tensors) for piece in t.pieces]
    written = datafile.write(path, parts, [t.crc is None for t in plan.tensors], pause=pause,
                             phases=phases, kind="bundle data", ready=ready)
    for t, crc in zip(plan.tensors, written.owner_crcs, strict=True):
        t.entry.crc32c = fastcrc.mask(t.crc if t.crc is not None else (crc or 0))
    return written.sums


def _header() -> bytes:
    from tensorflow.core.protobuf import tensor_bundle_pb2

    header = tensor_bundle_pb2.BundleHeaderProto(
        num_shards=1, endianness=tensor_bundle_pb2.BundleHeaderProto.LITTLE)
    header.version.producer = 1  # kTensorBundleVersion
    header.version.min_consumer = 0
    return header.SerializeToString()


def write_bundle(prefix: str, state, *, pause: Callable[[], None] | None = None,
                 phases: Phases | None = None,
                 ready: Callable[[list], None] | None = None) -> FileSums | None:
    """Writes ``state`` as ``prefix.index`` + ``prefix.data-00000-of-00001``.

    Returns each file's size and CRC32C (for the manifest), or None,
    having written nothing, when the state needs TensorFlow's ``SaveV2``.
    ``pause`` is called before each range of the data file (see ``_run_jobs``);
    ``phases`` records where the time goes. ``ready``, before a range of
    the data file is read, with the staged buffers (``state.tensors[i].host``)
    it reads: returns once they hold their values (the background copy,
    ``DeferredCopy.wait_for``), so the write starts before the copy ends.
    """
    if not fastcrc.available():
        logger.debug("no native CRC32C; the bundle is written by SaveV2")
        return None
    plan = _plan(state)
    if isinstance(plan, str):
        logger.debug("bundle written by SaveV2: %s", plan)
        return None
    data_path = f"{prefix}.data-00000-of-00001"
    owners_ready = None
    if ready is not None:
        # The plan's tensors are the state's, in order, then the object graph's.
        hosts = [t.host for t in state.tensors]

        def owners_ready(owners: list[int]) -> None:
            ready([hosts[i] for i in set(owners) if i < len(hosts)])

    sums: FileSums = {os.path.basename(data_path): _write_data(data_path, plan, pause, phases,
                                                               owners_ready)}
    t0 = time.perf_counter()
    items = [(b"", _header())]
    items += [(k, plan.entries[k].SerializeToString()) for k in sorted(plan.entries)]
    index = build_table(items)
    index_path = prefix + ".index"
    with open(index_path, "wb") as f:
        f.write(index)
    sums[os.path.basename(index_path)] = (len(index), fastcrc.crc32c_extend(0, index), CRC32C)
    if phases is not None:
        phases.add(WRITE + "bundle index", time.perf_counter() - t0, 1, len(index))
    return sums
