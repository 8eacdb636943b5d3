"""Writes TensorFlow's tensor bundle straight from the host staging buffers.

TensorFlow's ``SaveV2`` copies every tensor through an 8 MiB buffer while
it computes each tensor's CRC32C, and only then can the engine read the
file back for the manifest's CRC32 and fsync it: at 1 GiB the data file
was serialized for 1.5-1.7 s before the fsync started (issue 13). Here the
same two files are produced by asyncckpt itself:

* ``<prefix>.data-00000-of-00001``: the tensors' bytes concatenated in the
  order given (no padding: ``SaveV2`` uses an alignment of 1), cut into ranges
  of 16 MiB that two threads checksum and write at their offsets. In a data
  file of 4 MiB or more, a whole, aligned range is gathered into a
  page-aligned buffer and written with ``O_DIRECT``: the copy costs memory
  bandwidth, but the write skips the page cache, whose filling and writeback
  set the pace of a large write on this VM (1 GiB: 0.56 s to durable with
  ``O_DIRECT``, 1.52 s through the page cache, raw write+fsync 0.74 s, in one
  run) and slow the training loop beside it (fresh pages for every new file:
  3-5x the cost per save at 16-256 MiB). Smaller files, the unaligned tail and
  every range where the file system refuses ``O_DIRECT`` are written with
  ``pwritev`` from the staging buffers, their writeback started at once
  (``sync_file_range``). Each range is checksummed as it is written: CRC32C
  per tensor (``engine.fastcrc``, GIL-free), combined in file order into each
  tensor's CRC32C and the whole file's (the manifest's, also CRC32C), so the
  engine need not read the file back and each byte is checksummed once.
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

import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from asyncckpt._engine import fastcrc
from asyncckpt._engine.fastcrc import CRC32C, crc_combine
from asyncckpt._engine.metrics import CHECKSUM_BESIDE, WRITE, Phases
from asyncckpt.tf._compat import OBJECT_GRAPH_KEY, tf
from asyncckpt.tf._slices import WHOLE, parse_spec, slice_key
from asyncckpt.tf._sstable import build_table, varint
from asyncckpt.tf._variant import CapturedVariant

logger = logging.getLogger(__name__)

_CHUNK = 16 << 20  # bytes per range: one pwritev, then its writeback starts
_MAX_IOV = 512  # views per pwritev (IOV_MAX is 1024 on Linux)
_THREADS = min(2, os.cpu_count() or 1)  # measured: two beat one on the 2-core machine
_SYNC_FILE_RANGE_WRITE = 2
_DIRECT_ALIGN = 4096  # offset, length and address alignment of an O_DIRECT write
_DIRECT_WRITES = True  # aligned ranges bypass the page cache (tests turn it off to compare)
# Data files from this size on are written O_DIRECT. Durable / raw write+fsync
# (bench_tf_write.py): 1 GiB through the page cache 0.49-0.55x, O_DIRECT 1.07-1.32x;
# 64-256 MiB O_DIRECT 0.97-1.00x, the page cache faster (1.2-1.5x) where it reuses
# freed pages. What decided 4 MiB is training: filling fresh page cache costs the
# training loop 3-5x more per save than O_DIRECT does (bench_tf_train_overhead.py,
# 16-256 MiB), about as much as a raw write that fills fresh pages.
_DIRECT_MIN = 4 << 20

FileSums = dict[str, tuple[int, int, str]]  # file name -> (size, checksum, algorithm)
_COMBINE_MIN = 1 << 20  # views this large join the file's CRC by combining, not a 2nd pass


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


@dataclass
class _Job:
    """One contiguous range of the data file: views of consecutive tensors' bytes."""

    offset: int
    views: list[memoryview] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)  # index of each view's tensor
    nbytes: int = 0


def _jobs(plan: _Plan) -> list[_Job]:
    """Cuts the data file into ranges of about ``_CHUNK`` bytes, in file order."""
    jobs = [_Job(0)]
    offset = 0
    for i, t in enumerate(plan.tensors):
        for piece in t.pieces:
            view = memoryview(piece).cast("B")
            start = 0
            while start < len(view):
                job = jobs[-1]
                if job.nbytes >= _CHUNK:
                    job = _Job(offset)
                    jobs.append(job)
                part = view[start:start + _CHUNK - job.nbytes]
                job.views.append(part)
                job.owners.append(i)
                job.nbytes += len(part)
                start += len(part)
                offset += len(part)
    return jobs


def _run_job(fd: int, job: _Job, needs_crc: list[bool], writeback,
             direct_fd: int = -1) -> tuple[list[int], int, float]:
    """Checksums and writes one range; returns each view's CRC32C, the range's, and the
    seconds the checksums took."""
    if direct_fd >= 0 and job.offset % _DIRECT_ALIGN == 0 and job.nbytes % _DIRECT_ALIGN == 0:
        try:
            return _run_job_direct(direct_fd, job, needs_crc)
        except OSError as e:
            if not isinstance(e, _DirectShort) and e.errno != errno.EINVAL:
                raise  # a real I/O error (no space, EIO): the save fails
            logger.debug("O_DIRECT write of %d bytes at %d refused (%s); written through "
                         "the page cache", job.nbytes, job.offset, e)
    t0 = time.perf_counter()
    crcs, job_crc = _checksums(job.views, job.owners, needs_crc)
    crc_s = time.perf_counter() - t0
    views, pos = job.views, job.offset
    while views:
        n = os.pwritev(fd, views[:_MAX_IOV], pos)
        pos += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
    # Start the disk on this range now; the fsync at commit waits for the rest.
    if (writeback is not None and job.nbytes
            and writeback(fd, job.offset, job.nbytes, _SYNC_FILE_RANGE_WRITE) != 0):
        logger.debug("sync_file_range failed (errno %d)", ctypes.get_errno())
    return crcs, job_crc, crc_s


def _checksums(views: list, owners: list[int], needs_crc: list[bool]) -> tuple[list[int], int]:
    """Each view's CRC32C (0 where its tensor's is known) and the CRC32C of them all.

    A large view's CRC32C joins the range's by ``crc_combine``; small views
    (where a combine costs more than the bytes) are checksummed into the
    range's CRC directly, their own CRC computed too only when needed.
    """
    crcs = []
    job_crc = 0
    for view, owner in zip(views, owners, strict=True):
        if len(view) >= _COMBINE_MIN:
            c = fastcrc.crc32c_extend(0, view)
            job_crc = crc_combine(job_crc, c, len(view), CRC32C)
        else:
            c = fastcrc.crc32c_extend(0, view) if needs_crc[owner] else 0
            job_crc = fastcrc.crc32c_extend(job_crc, view)
        crcs.append(c)
    return crcs, job_crc


def _run_job_direct(fd: int, job: _Job, needs_crc: list[bool]) -> tuple[list[int], int, float]:
    """``_run_job`` for an aligned range: gathered into an aligned buffer, written ``O_DIRECT``.

    The copy (memory speed) buys a write that skips the page cache: no pages
    to fill and write back, so the disk, not this VM's memory, sets the pace.
    The checksums are taken from the gathered bytes, still in the CPU's cache.
    """
    bounce = _take_bounce(job.nbytes)
    try:
        parts = []
        pos = 0
        for view in job.views:
            part = bounce[pos:pos + len(view)]
            part[:] = np.frombuffer(view, np.uint8)
            parts.append(part)
            pos += len(view)
        t0 = time.perf_counter()
        crcs, job_crc = _checksums(parts, job.owners, needs_crc)
        crc_s = time.perf_counter() - t0
        out = memoryview(bounce)[:pos]
        done = 0
        while done < pos:
            n = os.pwrite(fd, out[done:], job.offset + done)
            if n <= 0 or n % _DIRECT_ALIGN:  # a short direct write: finish through the cache
                raise _DirectShort(done + max(n, 0))
            done += n
        return crcs, job_crc, crc_s
    finally:
        _give_bounce(bounce)


class _DirectShort(OSError):
    """An ``O_DIRECT`` write stopped short (after ``done`` bytes)."""

    def __init__(self, done: int):
        super().__init__(f"short O_DIRECT write after {done} bytes")
        self.done = done


# Aligned buffers for direct writes, one per writing thread, kept between saves
# (allocating and faulting 16 MiB per range would cost more than the copy): at
# most _THREADS x _CHUNK (32 MiB) of host memory, less for a state under 32 MiB.
_BOUNCE: list[np.ndarray] = []
_BOUNCE_LOCK = threading.Lock()
_BOUNCE_SIZE = [0]  # bytes of the buffers allocated, see _take_bounce


def _take_bounce(nbytes: int) -> np.ndarray:
    with _BOUNCE_LOCK:
        while _BOUNCE:
            buf = _BOUNCE.pop()
            if len(buf) >= nbytes:
                return buf
        # The largest range seen so far (at most _CHUNK), in whole MiB: a small
        # state keeps small buffers, and a save's shorter tail range does not
        # make the next save allocate (and fault in) a full-size buffer again.
        _BOUNCE_SIZE[0] = size = max(_BOUNCE_SIZE[0], -(-nbytes // (1 << 20)) << 20)
    # mmap: page-aligned, as O_DIRECT needs (NumPy's allocator gives 64 bytes).
    mem = mmap.mmap(-1, size)
    if size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        mem.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mem, np.uint8)


def _give_bounce(buf: np.ndarray) -> None:
    with _BOUNCE_LOCK:
        if len(_BOUNCE) < _THREADS and len(buf) >= _BOUNCE_SIZE[0]:
            _BOUNCE.append(buf)


def _open_direct_for_write(path: str) -> int:
    """A second, ``O_DIRECT`` descriptor of ``path``; -1 where the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or not _DIRECT_WRITES:
        return -1
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return -1


def _sync_file_range():
    if not _SFR:
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        except (OSError, AttributeError):
            fn = None
        _SFR.append(fn)
    return _SFR[0]


_SFR: list = []


def _run_jobs(fd: int, jobs: list[_Job], needs_crc: list[bool], writeback,
              direct_fd: int = -1, pause: Callable[[], None] | None = None) -> list:
    """Runs the jobs on this thread and ``_THREADS - 1`` helpers; results in job order.

    Each thread calls ``pause`` (the engine's ``SaveGate.wait``) before each
    range, so the write yields to a save's copy between ranges.

    Plain threads rather than an executor: executors refuse new work once the
    interpreter has begun to shut down, which is when the exit flush of
    in-flight saves runs this.
    """
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []
    lock = threading.Lock()
    next_job = iter(range(len(jobs)))

    def work() -> None:
        while not errors:
            with lock:
                i = next(next_job, None)
            if i is None:
                return
            try:
                if pause is not None:
                    pause()
                results[i] = _run_job(fd, jobs[i], needs_crc, writeback, direct_fd)
            except BaseException as e:  # re-raised below, on the writer thread
                errors.append(e)

    helpers = [threading.Thread(target=work, name="asyncckpt-bundle", daemon=True)
               for _ in range(min(_THREADS, len(jobs)) - 1)]
    for t in helpers:
        t.start()
    work()
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]
    return results


def _write_data(path: str, plan: _Plan, pause: Callable[[], None] | None = None,
                phases: Phases | None = None) -> tuple[int, int, str]:
    """Writes the data file; fills each entry's CRC32C; returns ``(size, crc32c, "crc32c")``.

    ``phases``: records the write (its wall time) and the checksums (their
    seconds on every thread, beside the writes).

    The ranges are checksummed and written by ``_THREADS`` threads (the
    checksums and the kernel's copy into the page cache are CPU work that
    two cores share, the writes go to their own offsets); the ranges' CRCs
    are then combined in file order.
    """
    t0 = time.perf_counter()
    jobs = _jobs(plan)
    needs_crc = [t.crc is None for t in plan.tensors]
    writeback = _sync_file_range()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    big = sum(j.nbytes for j in jobs) >= _DIRECT_MIN
    direct_fd = _open_direct_for_write(path) if big else -1
    try:
        results = _run_jobs(fd, jobs, needs_crc, writeback, direct_fd, pause)
    finally:
        if direct_fd >= 0:
            os.close(direct_fd)
        os.close(fd)
    tensor_crc: list[int | None] = [None] * len(plan.tensors)
    file_crc = 0
    crc_s = 0.0
    for job, (crcs, job_crc, job_crc_s) in zip(jobs, results, strict=True):
        crc_s += job_crc_s
        file_crc = crc_combine(file_crc, job_crc, job.nbytes, CRC32C)
        for view, owner, c in zip(job.views, job.owners, crcs, strict=True):
            prev = tensor_crc[owner]
            tensor_crc[owner] = c if prev is None else crc_combine(prev, c, len(view), CRC32C)
    for t, crc in zip(plan.tensors, tensor_crc, strict=True):
        t.entry.crc32c = fastcrc.mask(t.crc if t.crc is not None else (crc or 0))
    size = sum(j.nbytes for j in jobs)
    if phases is not None:
        phases.add(CHECKSUM_BESIDE, crc_s, len(jobs), size)
        phases.add(WRITE + "bundle data", time.perf_counter() - t0, 1, size)
    return size, file_crc, CRC32C


def _header() -> bytes:
    from tensorflow.core.protobuf import tensor_bundle_pb2

    header = tensor_bundle_pb2.BundleHeaderProto(
        num_shards=1, endianness=tensor_bundle_pb2.BundleHeaderProto.LITTLE)
    header.version.producer = 1  # kTensorBundleVersion
    header.version.min_consumer = 0
    return header.SerializeToString()


def write_bundle(prefix: str, state, *, pause: Callable[[], None] | None = None,
                 phases: Phases | None = None) -> FileSums | None:
    """Writes ``state`` as ``prefix.index`` + ``prefix.data-00000-of-00001``.

    Returns each file's size and CRC32C (for the manifest), or None,
    having written nothing, when the state needs TensorFlow's ``SaveV2``.
    ``pause`` is called before each range of the data file (see ``_run_jobs``);
    ``phases`` records where the time goes.
    """
    if not fastcrc.available():
        logger.debug("no native CRC32C; the bundle is written by SaveV2")
        return None
    plan = _plan(state)
    if isinstance(plan, str):
        logger.debug("bundle written by SaveV2: %s", plan)
        return None
    data_path = f"{prefix}.data-00000-of-00001"
    sums: FileSums = {os.path.basename(data_path): _write_data(data_path, plan, pause, phases)}
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
