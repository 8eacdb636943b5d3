"""Parallel, checksummed file reads straight into caller-owned buffers.

Restores read a checkpoint's bytes once: each file is split into pieces
(the caller's destination buffers, cut at ``PIECE`` bytes), the pieces of
every file are read by a pool of threads (``DIRECT_STREAMS`` for
``O_DIRECT`` reads, else ``streams_for`` the device) with ``preadv`` into
their final place, and each piece's CRC is
computed by the thread that read it, while its bytes are still in the CPU
cache. The pieces' CRCs are then combined in file order (``crc_combine``):
into the whole file's checksum, the one the manifest records (CRC32C, or
zlib's CRC32 in checkpoints written before CRC32C or without a native
CRC32C: ``FileRead.algorithm`` is the record's), so a file read by many
threads is still checked against a whole-file checksum, and into each
destination's CRC, which lets TensorFlow's per-tensor CRC32C be checked
instead or as well.

CRC32 or CRC32C, measured on the project's 2-core machine: ``zlib.crc32``
ran at 3.4 GB/s on an idle core, the hardware CRC32C (``engine.fastcrc``)
at 11 GB/s, a cold read of the disk at 1.0-1.5 GB/s. With the cores
shared, the checksum is CPU time the read competes for, which is why new
checkpoints record CRC32C. Both checksums run without the GIL (zlib
releases it; the hardware CRC32C is called through ``ctypes``, which does),
so one thread's checksum overlaps the other threads' reads.

Cold files are read with ``O_DIRECT`` (the device writes straight into the
destination, no page-cache copy) and destinations of 2 MiB and more are
fresh anonymous memory advised into huge pages, which the kernel faults in
512 times fewer steps. Measured on the project's 2-core VM (virtio disk,
256 MiB file, cold, medians of 5, against one ``readinto`` of the whole
file into memory touched beforehand, 107-110 ms): a ``readinto`` into
``np.empty`` memory took 1.0-5.3x (median 3.4x: the VM hands freed memory
back to its host, which must fault it in again), into huge-page memory
1.0x; buffered
``preadv`` of 8 MiB pieces from 2 threads into huge pages 1.7x (the threads
defeat the kernel's readahead), from 1 thread in 64 MiB pieces 1.0x;
``O_DIRECT`` reads of 8 MiB pieces from 4 threads into huge pages 0.95x and
from 8 threads 0.89x, and into 4 KiB pages 2.2x. Files mostly in the page
cache already (``resident_fraction``: ``cachestat``, else ``mincore``) are
read buffered: a copy from the cache beats the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from asyncckpt._engine import fastcrc
from asyncckpt.errors import AsyncCkptError

PIECE = 8 << 20  # bytes per read call: large enough for the disk, small enough to spread
DIRECT_ALIGN = 4096  # O_DIRECT: file offsets, lengths and addresses aligned like this
HUGE = 2 << 20  # destinations this large are huge-page memory
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)  # no effect on regular files

def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``crc_combine`` for zlib's CRC32."""
    return fastcrc.crc_combine(crc1, crc2, len2, fastcrc.CRC32)


def has_fast_crc32c() -> bool:
    """Whether the hardware CRC32C runs natively and GIL-free (``fastcrc.available``)."""
    return fastcrc.available()


def _checksum(algorithm: str):
    if algorithm == fastcrc.CRC32:
        return zlib.crc32
    return lambda view: fastcrc.crc32c_extend(0, view)


ALIGN = 64  # frameworks use host memory aligned like this without copying it


def aligned_empty(nbytes: int, *, file_offset: int = 0) -> np.ndarray:
    """An uninitialized uint8 array whose data is ``ALIGN``-byte aligned.

    TensorFlow (DLPack) and XLA's CPU client take over host memory without a
    copy only when it is aligned; ``np.empty`` guarantees 16 bytes. Arrays
    of ``HUGE`` bytes and more are anonymous memory advised into huge pages
    (see the module docstring), placed so that the array's address and
    ``file_offset`` agree modulo ``DIRECT_ALIGN`` when ``file_offset`` is a
    multiple of ``ALIGN``: the bytes read from there into the array can then
    go by ``O_DIRECT``.
    """
    start = file_offset % DIRECT_ALIGN if file_offset % ALIGN == 0 else 0
    try:
        memory = (mmap.mmap(-1, start + nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                  if nbytes >= HUGE else None)
    except OSError:  # out of mappings (vm.max_map_count): NumPy's allocator then
        memory = None
    if memory is None:
        raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % ALIGN
        return raw[start:start + nbytes]
    with contextlib.suppress(OSError, AttributeError):  # kernels without huge pages
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes, offset=start)


@dataclass(frozen=True)
class Piece:
    """One read: ``len(view)`` bytes of ``path`` at ``offset`` into ``view``.

    ``direct``: offset, length and address are ``DIRECT_ALIGN``-aligned, so
    the piece may be read with ``O_DIRECT``.
    """

    path: str
    offset: int
    view: memoryview
    direct: bool = False


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def _split(path: str, offset: int, view: memoryview) -> list[Piece]:
    """Pieces of one destination: an ``O_DIRECT``-able aligned middle, buffered ends."""
    head = -offset % DIRECT_ALIGN
    if len(view) < head + DIRECT_ALIGN or (_address(view) + head) % DIRECT_ALIGN:
        return [Piece(path, offset + k, view[k:k + BUFFERED_PIECE])
                for k in range(0, len(view), BUFFERED_PIECE)]
    body_end = head + (len(view) - head) // DIRECT_ALIGN * DIRECT_ALIGN
    pieces = [Piece(path, offset, view[:head])] if head else []
    pieces += [Piece(path, offset + k, view[k:min(k + PIECE, body_end)], direct=True)
               for k in range(head, body_end, PIECE)]
    if body_end < len(view):
        pieces.append(Piece(path, offset + body_end, view[body_end:]))
    return pieces


BUFFERED_PIECE = 32 << 20  # buffered pieces: fewer, longer streams keep readahead going


class FileRead:
    """The planned read of one file: its pieces and, after ``run``, their CRCs.

    Args:
        path: The file.
        size: Its size (the manifest's; bytes past it are not read).
        dests: ``(offset, buffer)`` pairs: where the bytes at ``offset``
            go. With ``whole_file``, byte ranges no buffer covers are read
            into scratch memory when ``checksum`` is set (the file's CRC
            needs every byte); otherwise they are not read.
        checksum: Compute CRCs.
        algorithm: ``fastcrc.CRC32`` or ``fastcrc.CRC32C``.
        whole_file: Compute the whole file's CRC (``crc``); the CRC of each
            destination (``dest_crcs``, in the order given) is computed in
            any case.
    """

    def __init__(self, path: str, size: int, dests: Sequence[tuple[int, object]], *,
                 checksum: bool, algorithm: str = fastcrc.CRC32, whole_file: bool = True):
        self.path = path
        self.size = size
        self.checksum = checksum
        self.algorithm = algorithm
        self.whole_file = whole_file and checksum
        self.crc: int | None = None
        self.dest_crcs: list[int | None] = [None] * len(dests)
        segments: list[tuple[int, memoryview, int]] = []  # offset, view, dest index or -1
        pos = 0
        for offset, i in sorted((d[0], i) for i, d in enumerate(dests)):
            view = memoryview(dests[i][1]).cast("B")
            if offset < pos or offset + len(view) > size:
                raise ValueError(f"{path}: overlapping or out-of-file read at {offset}")
            if offset > pos and self.whole_file:
                segments.append((pos, memoryview(bytearray(offset - pos)), -1))
            segments.append((offset, view, i))
            pos = offset + len(view)
        if pos < size and self.whole_file:
            segments.append((pos, memoryview(bytearray(size - pos)), -1))
        self.pieces: list[Piece] = []
        self._owners: list[int] = []
        for off, view, owner in segments:
            split = _split(path, off, view)
            self.pieces += split
            self._owners += [owner] * len(split)
        self._fds: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def open(self, *, direct: bool | None = None) -> bool:
        """Opens the file (once); returns whether its aligned pieces go by ``O_DIRECT``.

        ``direct`` None: when the file is mostly not in the page cache
        (``resident_fraction``) and its file system takes ``O_DIRECT``.
        The first piece to be read opens the file if nobody did: on the
        reading threads, where the opens of many small files overlap the
        reads of others instead of preceding them all.
        """
        with self._lock:
            if self._fds is None:
                fd = os.open(self.path, _READ_FLAGS)  # (a FIFO put there meanwhile: no wait)
                direct_fd = -1
                if any(p.direct for p in self.pieces) and (
                        direct if direct is not None
                        else resident_fraction(fd, self.size) < 0.5):
                    direct_fd = _open_direct(self.path)
                self._fds = (fd, direct_fd)
            return self._fds[1] >= 0

    def run(self, executor: Executor) -> list:
        """Submits the pieces; ``finish`` collects the futures."""
        crc = _checksum(self.algorithm) if self.checksum else None
        return [executor.submit(self._read, p, crc) for p in self.pieces]

    def _read(self, piece: Piece, crc) -> int:
        self.open()
        fd, direct_fd = self._fds
        return _read_piece(fd, direct_fd if piece.direct else -1, piece, crc)

    def close(self) -> None:
        """Closes the file's descriptors (``finish`` does; for reads never run)."""
        fds, self._fds = self._fds, None
        for fd in fds or ():
            if fd >= 0:
                os.close(fd)

    def finish(self, futures: list) -> None:
        """Waits for the pieces, closes the file and combines the CRCs in file order."""
        wait(futures)  # every piece read before the descriptors close
        self.close()
        crcs = [f.result() for f in futures]
        if not self.checksum:
            return
        whole = 0
        per: dict[int, int] = {}
        for piece, owner, c in zip(self.pieces, self._owners, crcs, strict=True):
            n = len(piece.view)
            if self.whole_file:
                whole = fastcrc.crc_combine(whole, c, n, self.algorithm)
            if owner >= 0:
                per[owner] = (fastcrc.crc_combine(per[owner], c, n, self.algorithm)
                              if owner in per else c)
        if self.whole_file:
            self.crc = whole
        for i in range(len(self.dest_crcs)):
            self.dest_crcs[i] = per.get(i, 0)  # an empty destination's CRC is 0


def _open_direct(path: str) -> int:
    """A descriptor reading ``path`` with ``O_DIRECT``, or -1 where that is refused (tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(path, _READ_FLAGS | flag)
    except OSError:
        return -1


_libc = None


def resident_pages(fd: int, size: int) -> tuple[int, int] | None:
    """``(resident, total)`` pages of a file in the page cache (``mincore``); None if unknown."""
    global _libc
    if size <= 0:
        return 0, 0
    try:
        if _libc is None:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
            _libc = lib
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(addr, size, vec) != 0:
                return None
            return int(np.count_nonzero(np.frombuffer(vec.raw, np.uint8) & 1)), pages
        finally:
            _libc.munmap(addr, size)
    except (OSError, AttributeError):
        return None


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_CACHESTAT = 451  # the same number on every architecture (added after the tables merged)
_syscall = None  # libc's syscall(), False where cachestat is unavailable


def cached_pages(fd: int, size: int) -> tuple[int, int] | None:
    """``(cached, total)`` pages of a file by ``cachestat(2)`` (Linux 6.5+); None if unknown.

    No mapping of the file and a walk over its cached pages only: about
    1 us for a cold 2 MiB file on the project's VM, where ``mincore``
    (mapping, a lookup per page, unmapping) took 35-70 us; a restore of
    512 chunk files paid 55 ms for it (``benchmarks/archive/bench_restore_reads.py``).
    """
    global _syscall
    if _syscall is None:
        try:
            if not sys.platform.startswith("linux"):
                raise OSError("not Linux")
            _syscall = ctypes.CDLL(None, use_errno=True).syscall
            _syscall.restype = ctypes.c_long
        except (OSError, AttributeError):
            _syscall = False
    if _syscall is False:
        return None
    stat = _CacheStat()
    rc = _syscall(ctypes.c_long(_CACHESTAT), ctypes.c_int(fd),
                  ctypes.byref(_CacheRange(0, size)), ctypes.byref(stat), ctypes.c_uint(0))
    if rc != 0:
        _syscall = False  # ENOSYS (an older kernel) or refused by a sandbox: mincore
        return None
    return int(stat.nr_cache), (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE


def resident_fraction(fd: int, size: int) -> float:
    """Fraction of a file's pages in the page cache; 0.0 if unknown.

    ``cached_pages`` where the kernel has ``cachestat``, else ``mincore``.
    """
    if size <= 0:
        return 0.0
    counted = cached_pages(fd, size) or resident_pages(fd, size)
    return counted[0] / counted[1] if counted and counted[1] else 0.0


class ShortReadError(AsyncCkptError, OSError):
    """A file ended before the bytes its manifest records (truncated under us).

    Attributes:
        path: The file.
    """

    def __init__(self, path: str, at: int):
        super().__init__(f"{path!r} ended at byte {at}")
        self.path = path


def _read_piece(fd: int, direct_fd: int, piece: Piece, crc) -> int:
    view = piece.view
    got = 0
    if direct_fd >= 0:
        try:
            while got < len(view):
                n = os.preadv(direct_fd, [view[got:]], piece.offset + got)
                if not n or n % DIRECT_ALIGN:
                    got += n
                    break  # the file ends early: the buffered read below says where
                got += n
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # Alignment the device does not take after all: read it buffered.
    while got < len(view):
        n = os.preadv(fd, [view[got:]], piece.offset + got)
        if not n:
            raise ShortReadError(piece.path, piece.offset + got)
        got += n
    return crc(view) if crc is not None else 0


def streams_for(path: str) -> int:
    """How many buffered reads to keep in flight on the device holding ``path``.

    Buffered reads of a cold file go through the kernel's readahead, which
    several threads reading one file in turns defeat: a disk that reports
    itself rotational (virtio disks of cloud VMs do, whatever backs them)
    gets ``ROTATIONAL_STREAMS``. Solid-state devices, and files with no
    block device behind them (tmpfs, overlay), get ``PARALLEL_STREAMS``.
    ``O_DIRECT`` reads have no readahead to defeat and get
    ``DIRECT_STREAMS`` (see ``read_all``).
    """
    try:
        dev = os.stat(path).st_dev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for queue in (f"{base}/queue/rotational", f"{base}/../queue/rotational"):
            if os.path.exists(queue):
                with open(queue) as f:
                    rotational = f.read().strip() == "1"
                return ROTATIONAL_STREAMS if rotational else PARALLEL_STREAMS
    except OSError:
        pass
    return PARALLEL_STREAMS


ROTATIONAL_STREAMS = 2
PARALLEL_STREAMS = 8  # enough to keep an NVMe queue busy from Python threads
# O_DIRECT reads in flight. The virtio disk of the project's VM read 8 MiB
# pieces into huge pages at 0.95x a whole-file readinto with 4 and 0.89x with
# 8 (reads alone); whole restores, which also checksum and fault memory in,
# were fastest with 16: 1 GiB TensorFlow 1.17x the raw read with 16 streams,
# 1.19x with 8, 1.32x with 4; 256 MiB JAX (2 MiB chunk files) 1.50x / 1.61x,
# 1 GiB JAX 1.57x / 2.01x; 32 streams about the same as 16 (1.44x, 1.59x).
DIRECT_STREAMS = 16


def read_all(reads: Sequence[FileRead], *, streams: int | None = None) -> None:
    """Reads every piece of every file; CRCs end up in ``FileRead.crc``/``dest_crcs``.

    ``streams`` reads run at once (default: ``DIRECT_STREAMS`` when pieces
    may go by ``O_DIRECT``, else ``streams_for`` the first file), each
    reading thread checksumming the piece it has just read while the other
    threads' reads keep the disk busy. All files' pieces are queued at once,
    in file order (small files do not leave the pool idle). The first error
    (a file that vanished, a short read) is raised after every submitted
    piece has finished, so no thread still writes into a buffer the caller
    frees.
    """
    if not reads:
        return
    if streams is None:
        direct = any(p.direct for r in reads for p in r.pieces)
        streams = DIRECT_STREAMS if direct else streams_for(reads[0].path)
    started: list[tuple[FileRead, list]] = []
    error: BaseException | None = None
    with ThreadPoolExecutor(max(1, streams), thread_name_prefix="asyncckpt-read") as pool:
        try:
            for r in reads:
                started.append((r, r.run(pool)))
        except BaseException as e:
            error = e
            for r in reads[len(started):]:
                r.close()  # opened by the caller, never run
        for r, futures in started:
            try:
                r.finish(futures)
            except BaseException as e:
                error = error or e
    if error is not None:
        raise error
