"""Write stage: one large file from many host buffers, checksummed, at the disk's speed.

A checkpoint's bulk bytes go into a few large files: TensorFlow's bundle
data file (``tf/_bundlewrite``), the data files of a JAX OCDBT database
(``jax/_ocdbt``). ``write`` produces such a file from the buffers that
make it up, in file order, straight from host staging memory:

* the file is cut into ranges of 16 MiB that two threads checksum and
  write at their offsets (the checksums and the kernel's copies are CPU
  work the two cores share);
* in a file of 4 MiB or more, a whole, aligned range is gathered into a
  page-aligned buffer and written with ``O_DIRECT``: the copy costs memory
  bandwidth, but the write skips the page cache, whose filling and
  writeback set the pace of a large write on this project's VM and slow a
  training loop beside it (fresh pages for every new file: 3-5x the cost
  per save at 16-256 MiB). Smaller files, the unaligned tail and every range
  where the file system refuses ``O_DIRECT`` are written with ``pwritev``
  from the buffers, their writeback started at once (``sync_file_range``);
* each range is checksummed (CRC32C, ``fastcrc``, GIL-free) as it is
  written; the ranges' CRCs are combined, in file order, into the file's
  CRC32C and, for the callers that want them, each owner's (a TensorFlow
  tensor's entry records its own). Each byte is checksummed once and the
  file is never read back.

The caller records the file in its ``DurableWriter`` with the size and
checksum returned (``add_existing(known=...)``), which fsyncs it with the
save's other files. Durable / raw write+fsync, TensorFlow's bundle
(``benchmarks/bench_tf_write.py``): 1 GiB through the page cache 0.49-0.55x,
``O_DIRECT`` 1.07-1.32x; 64-256 MiB ``O_DIRECT`` 0.97-1.00x.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from asyncckpt._engine import fastcrc
from asyncckpt._engine.fastcrc import CRC32C, crc_combine
from asyncckpt._engine.metrics import CHECKSUM_BESIDE, WRITE, Phases

logger = logging.getLogger(__name__)

_RANGE = 16 << 20  # bytes per range at most: one pwritev (or O_DIRECT write)
# A file of less than 8 ranges is cut into 8 (of 1 MiB at least), so that its
# two threads overlap: one checksums (or gathers) while the other's write waits
# for the disk. One 16 MiB range for a 16 MiB file left the second thread idle.
_MIN_RANGE = 1 << 20
_MAX_IOV = 512  # views per pwritev (IOV_MAX is 1024 on Linux)
_THREADS = min(2, os.cpu_count() or 1)  # measured: two beat one on the 2-core machine
_SYNC_FILE_RANGE_WRITE = 2
_DIRECT_ALIGN = 4096  # offset, length and address alignment of an O_DIRECT write
_DIRECT_WRITES = True  # aligned ranges bypass the page cache (tests turn it off to compare)
# Files from this size on are written O_DIRECT. What decided 4 MiB is training:
# filling fresh page cache costs the training loop 3-5x more per save than O_DIRECT
# does (bench_tf_train_overhead.py, 16-256 MiB), about as much as a raw write that
# fills fresh pages.
DIRECT_MIN = 4 << 20
_COMBINE_MIN = 1 << 20  # views this large join the range's CRC by combining, not a 2nd pass


@dataclass(frozen=True)
class Written:
    """What ``write`` wrote.

    Attributes:
        size: The file's bytes.
        crc: Their CRC32C.
        owner_crcs: Each owner's CRC32C over its parts, in file order (None
            for an owner ``write`` was not asked to checksum, or without parts).
    """

    size: int
    crc: int
    owner_crcs: list[int | None]

    @property
    def sums(self) -> tuple[int, int, str]:
        """``(size, checksum, algorithm)``, as ``DurableWriter.add_existing(known=...)`` takes."""
        return self.size, self.crc, CRC32C


def available() -> bool:
    """Whether ``write`` can run: it needs the native, GIL-free CRC32C."""
    return fastcrc.available()


@dataclass
class _Range:
    """One contiguous range of the file: views of consecutive parts' bytes."""

    offset: int
    views: list[memoryview] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)  # each view's owner
    nbytes: int = 0


def _range_bytes(total: int) -> int:
    """Bytes per range of a file of ``total`` bytes: an eighth of it, in whole MiB, within
    ``_MIN_RANGE`` and ``_RANGE``."""
    return min(_RANGE, max(_MIN_RANGE, total // 8 >> 20 << 20))


def _coalesced(parts: Sequence[tuple[int, object]],
               needs_crc: Sequence[bool]) -> list[tuple[int, memoryview]]:
    """``parts`` as byte views, each run of parts that lie back to back in memory as one.

    A state of many small arrays is staged side by side (``_pages.packed_empty``),
    in file order: thousands of 8 KiB parts are then a few views, written and
    checksummed with a call each instead of thousands, and ``O_DIRECT``
    straight from the staging memory instead of through a gathering copy.
    Parts of different owners join only where neither owner's own CRC is wanted.
    A joined view reads the parts' memory by address: the parts must stay
    alive until the write returns (``write``'s caller holds them).
    """
    out: list[tuple[int, memoryview]] = []
    run_owner, run_start, run_end, run_view = -1, 0, 0, None
    joined = False

    def close_run() -> None:
        if run_view is None:
            return
        if joined:
            raw = (ctypes.c_char * (run_end - run_start)).from_address(run_start)
            out.append((run_owner, memoryview(raw).cast("B")))
        else:
            out.append((run_owner, run_view))

    for owner, piece in parts:
        view = memoryview(piece).cast("B")
        n = len(view)
        if not n:
            continue
        address = _address(view)
        if (run_view is not None and address == run_end
                and (owner == run_owner or not (needs_crc[owner] or needs_crc[run_owner]))):
            run_end += n
            joined = True
            continue
        close_run()
        run_owner, run_start, run_end, run_view, joined = owner, address, address + n, view, False
    close_run()
    return out


def _address(view: memoryview) -> int:
    """The address of ``view``'s first byte (not empty).

    Through ``ctypes`` for a writable view (staging buffers): 0.35 us, where
    NumPy's ``.ctypes.data`` took 1.3 us, 4 ms a save at 4,000 shards; a
    read-only one (``bytes``) through NumPy.
    """
    if view.readonly:
        return np.frombuffer(view, np.uint8).ctypes.data
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _ranges(parts: Sequence[tuple[int, object]], needs_crc: Sequence[bool]) -> list[_Range]:
    """Cuts the file into ranges (``_range_bytes``), in file order."""
    views = _coalesced(parts, needs_crc)
    size = _range_bytes(sum(len(v) for _, v in views))
    ranges = [_Range(0)]
    offset = 0
    for owner, view in views:
        start = 0
        while start < len(view):
            r = ranges[-1]
            if r.nbytes >= size:
                r = _Range(offset)
                ranges.append(r)
            part = view[start:start + size - r.nbytes]
            r.views.append(part)
            r.owners.append(owner)
            r.nbytes += len(part)
            start += len(part)
            offset += len(part)
    return ranges


def _run_range(fd: int, r: _Range, needs_crc: Sequence[bool], writeback,
               direct_fd: int = -1) -> tuple[list[int], int, float]:
    """Checksums and writes one range; returns each view's CRC32C, the range's, and the
    seconds the checksums took."""
    if direct_fd >= 0 and r.offset % _DIRECT_ALIGN == 0 and r.nbytes % _DIRECT_ALIGN == 0:
        try:
            return _run_range_direct(direct_fd, r, needs_crc)
        except OSError as e:
            if not isinstance(e, _DirectShort) and e.errno != errno.EINVAL:
                raise  # a real I/O error (no space, EIO): the save fails
            logger.debug("O_DIRECT write of %d bytes at %d refused (%s); written through "
                         "the page cache", r.nbytes, r.offset, e)
    t0 = time.perf_counter()
    crcs, range_crc = _checksums(r.views, r.owners, needs_crc)
    crc_s = time.perf_counter() - t0
    views, pos = r.views, r.offset
    while views:
        n = os.pwritev(fd, views[:_MAX_IOV], pos)
        pos += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
    # Start the disk on this range now; the fsync at commit waits for the rest.
    if (writeback is not None and r.nbytes
            and writeback(fd, r.offset, r.nbytes, _SYNC_FILE_RANGE_WRITE) != 0):
        logger.debug("sync_file_range failed (errno %d)", ctypes.get_errno())
    return crcs, range_crc, crc_s


def _checksums(views: list, owners: list[int],
               needs_crc: Sequence[bool]) -> tuple[list[int], int]:
    """Each view's CRC32C (0 where its owner's is not wanted) and the CRC32C of them all.

    A large view's CRC32C joins the range's by ``crc_combine``; small views
    (where a combine costs more than the bytes) are checksummed into the
    range's CRC directly, their own CRC computed too only when needed.
    """
    crcs = []
    range_crc = 0
    for view, owner in zip(views, owners, strict=True):
        if len(view) >= _COMBINE_MIN:
            c = fastcrc.crc32c_extend(0, view)
            range_crc = crc_combine(range_crc, c, len(view), CRC32C)
        else:
            c = fastcrc.crc32c_extend(0, view) if needs_crc[owner] else 0
            range_crc = fastcrc.crc32c_extend(range_crc, view)
        crcs.append(c)
    return crcs, range_crc


def _page_aligned(view: memoryview) -> bool:
    """Whether ``view`` can be an ``O_DIRECT`` write's buffer as it is (address and length)."""
    if len(view) % _DIRECT_ALIGN:
        return False
    return np.frombuffer(view, np.uint8).ctypes.data % _DIRECT_ALIGN == 0


def _run_range_direct(fd: int, r: _Range,
                      needs_crc: Sequence[bool]) -> tuple[list[int], int, float]:
    """``_run_range`` for an aligned range, written ``O_DIRECT``.

    A range whose every view is page-aligned (address and length, as a JAX
    staging slot's large buffers are) is written from those views with one
    ``pwritev``. Any other is first gathered into an aligned buffer: the copy
    (memory speed) buys a write that skips the page cache, so the disk, not
    this VM's memory, sets the pace; its checksums are taken from the
    gathered bytes, still in the CPU's cache, in one call where no view's own
    CRC is wanted.
    """
    if len(r.views) <= _MAX_IOV and all(map(_page_aligned, r.views)):
        t0 = time.perf_counter()
        crcs, range_crc = _checksums(r.views, r.owners, needs_crc)
        crc_s = time.perf_counter() - t0
        _write_direct(fd, r.views, r.offset, r.nbytes)
        return crcs, range_crc, crc_s
    bounce = _take_bounce(r.nbytes)
    try:
        parts = []
        pos = 0
        for view in r.views:
            part = bounce[pos:pos + len(view)]
            part[:] = np.frombuffer(view, np.uint8)
            parts.append(part)
            pos += len(view)
        t0 = time.perf_counter()
        if any(needs_crc[o] for o in r.owners):
            crcs, range_crc = _checksums(parts, r.owners, needs_crc)
        else:
            crcs, range_crc = [0] * len(parts), fastcrc.crc32c_extend(0, bounce[:pos])
        crc_s = time.perf_counter() - t0
        _write_direct(fd, [memoryview(bounce)[:pos]], r.offset, pos)
        return crcs, range_crc, crc_s
    finally:
        _give_bounce(bounce)


def _write_direct(fd: int, views: list, offset: int, nbytes: int) -> None:
    """Writes aligned ``views`` at ``offset`` on an ``O_DIRECT`` descriptor, all of them.

    Raises ``_DirectShort`` on a short write (the caller writes the range
    again through the page cache).
    """
    n = os.pwrite(fd, views[0], offset) if len(views) == 1 else os.pwritev(fd, views, offset)
    if n != nbytes:  # a short direct write: the range goes through the cache instead
        raise _DirectShort(max(n, 0))


class _DirectShort(OSError):
    """An ``O_DIRECT`` write stopped short (after ``done`` bytes)."""

    def __init__(self, done: int):
        super().__init__(f"short O_DIRECT write after {done} bytes")
        self.done = done


# Aligned buffers for direct writes, one per writing thread, kept between saves
# (allocating and faulting 16 MiB per range would cost more than the copy): at
# most _THREADS x _RANGE (32 MiB) of host memory, less for a file under 32 MiB.
_BOUNCE: list[np.ndarray] = []
_BOUNCE_LOCK = threading.Lock()
_BOUNCE_SIZE = [0]  # bytes of the buffers allocated, see _take_bounce


def _take_bounce(nbytes: int) -> np.ndarray:
    with _BOUNCE_LOCK:
        while _BOUNCE:
            buf = _BOUNCE.pop()
            if len(buf) >= nbytes:
                return buf
        # The largest range seen so far (at most _RANGE), in whole MiB: a small
        # file keeps small buffers, and a save's shorter tail range does not
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


def _run_ranges(fd: int, ranges: list[_Range], needs_crc: Sequence[bool], writeback,
                direct_fd: int = -1, pause: Callable[[], None] | None = None,
                ready: Callable[[list[int]], None] | None = None) -> list:
    """Runs the ranges on this thread and ``_THREADS - 1`` helpers; results in range order.

    Each thread calls ``pause`` (the engine's ``SaveGate.wait``) before each
    range, so the write yields to a save's copy between ranges, then
    ``ready`` with the range's owners (``write``).

    Plain threads rather than an executor: executors refuse new work once the
    interpreter has begun to shut down, which is when the exit flush of
    in-flight saves runs this.
    """
    results: list = [None] * len(ranges)
    errors: list[BaseException] = []
    lock = threading.Lock()
    next_range = iter(range(len(ranges)))

    def work() -> None:
        while not errors:
            with lock:
                i = next(next_range, None)
            if i is None:
                return
            try:
                if pause is not None:
                    pause()
                if ready is not None:
                    ready(ranges[i].owners)
                results[i] = _run_range(fd, ranges[i], needs_crc, writeback, direct_fd)
            except BaseException as e:  # re-raised below, on the writer thread
                errors.append(e)

    helpers = [threading.Thread(target=work, name="asyncckpt-datafile", daemon=True)
               for _ in range(min(_THREADS, len(ranges)) - 1)]
    for t in helpers:
        t.start()
    work()
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]
    return results


def write(path: str, parts: Sequence[tuple[int, object]], needs_crc: Sequence[bool], *,
          pause: Callable[[], None] | None = None, phases: Phases | None = None,
          kind: str = "data", mode: int | None = None,
          ready: Callable[[list[int]], None] | None = None) -> Written:
    """Writes ``parts`` as the file ``path``, in order; returns its size and CRC32C.

    Args:
        path: The new file (its directory exists).
        parts: ``(owner, buffer)`` in file order: an owner is an index into
            ``needs_crc`` (a tensor whose bytes may come in several parts).
        needs_crc: For each owner, whether ``Written.owner_crcs`` should hold
            its CRC32C.
        pause: The engine's gate, called before each range.
        phases: Records the write (``write:<kind>``, its wall time) and the
            checksums (``CHECKSUM_BESIDE``: their seconds on every thread).
        kind: Names the write's phase.
        mode: The file's permission bits (less the execute bits); None: the umask's.
        ready: Called before a range's bytes are read, with the owners of its
            parts (repeated per part): returns once their buffers hold what
            is to be written (a TensorFlow save's background copy still
            running, ``tf/_copy.py``). Its time counts in the write's.

    Requires ``available()``.
    """
    t0 = time.perf_counter()
    ranges = _ranges(parts, needs_crc)
    writeback = _sync_file_range()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    direct_fd = -1
    try:
        if mode is not None:
            os.fchmod(fd, mode & 0o666)
        if sum(r.nbytes for r in ranges) >= DIRECT_MIN:
            direct_fd = _open_direct_for_write(path)
        results = _run_ranges(fd, ranges, needs_crc, writeback, direct_fd, pause, ready)
    finally:
        if direct_fd >= 0:
            os.close(direct_fd)
        os.close(fd)
    owner_crcs: list[int | None] = [None] * len(needs_crc)
    file_crc = 0
    crc_s = 0.0
    for r, (crcs, range_crc, range_crc_s) in zip(ranges, results, strict=True):
        crc_s += range_crc_s
        file_crc = crc_combine(file_crc, range_crc, r.nbytes, CRC32C)
        for view, owner, c in zip(r.views, r.owners, crcs, strict=True):
            if needs_crc[owner]:
                prev = owner_crcs[owner]
                owner_crcs[owner] = c if prev is None else crc_combine(prev, c, len(view), CRC32C)
    size = sum(r.nbytes for r in ranges)
    if phases is not None:
        phases.add(CHECKSUM_BESIDE, crc_s, len(ranges), size)
        phases.add(WRITE + kind, time.perf_counter() - t0, 1, size)
    return Written(size, file_crc, owner_crcs)
