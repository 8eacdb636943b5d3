"""Host buffers for staging: 64-byte aligned, on huge pages where it pays, pre-faulted.

Split from ``slots`` so the spare-slot builder (``_spares``) can use them
without importing the pool.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

logger = logging.getLogger(__name__)

_ALIGNMENT = 64  # bytes; cache-line aligned, and what XLA/Eigen expect for zero-copy use.
# Buffers from this size on start on a page: a buffer whose length is whole pages
# is then written to disk with O_DIRECT from where it is (``_engine/datafile``),
# without a copy. At most 4 KiB more per buffer, 6% of the smallest.
_PAGE_FROM = 64 << 10
_PAGE = 4096
_FAULT_CHUNK = 1 << 20  # bytes touched per GIL-free step when pre-faulting
_ZEROS = np.zeros(_FAULT_CHUNK, dtype=np.uint8)


def touch_pages(buf: np.ndarray) -> None:
    """Touches every page of ``buf`` in chunks that run without the GIL.

    ``ndarray.fill`` holds the GIL for the whole buffer (tens of ms for
    hundreds of MiB); ``copyto`` from a zero chunk releases it, so a
    background thread pre-faulting never stalls the training thread.
    """
    for start in range(0, buf.nbytes, _FAULT_CHUNK):
        part = buf[start : start + _FAULT_CHUNK]
        np.copyto(part, _ZEROS[: part.nbytes])


_HUGE_PAGE = 2 << 20  # x86-64 transparent huge page


def _huge_empty(nbytes: int) -> np.ndarray | None:
    """A 2 MiB-aligned anonymous mapping that asks for transparent huge pages.

    With 4 KiB pages a 16 MiB copy into a slot walks 4096 page-table entries
    of the destination; on huge pages it walks 8, and the copy ran ~15% faster
    on this project's VM (at par with a memcpy into a warm 4 KiB-page array,
    issue 13.4). Pre-faulting takes one fault per 2 MiB instead of 512. Where
    the kernel's THP setting is ``madvise`` (common) only such a request gets
    them; with ``never`` the buffer is simply on 4 KiB pages. The mapping is
    unmapped when the last array viewing it is freed. None where the platform
    has no ``MADV_HUGEPAGE``.
    """
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as e:
        logger.debug("no huge-page staging buffer (%s)", e)
        return None
    raw = np.frombuffer(region, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _HUGE_PAGE
    return raw[offset : offset + nbytes]


def aligned_empty(nbytes: int, *, prefault: bool = True) -> np.ndarray:
    """Returns a 1-D uint8 array of ``nbytes`` whose data is 64-byte aligned (a page's, from
    64 KiB on).

    Args:
        nbytes: Size of the buffer.
        prefault: Touch every page now, so the first copy into the buffer does
            not pay for page faults on the training thread's clock.
    """
    # Huge pages only where rounding up to whole 2 MiB pages wastes little:
    # the kernel backs the buffer's last partial 2 MiB with a whole page.
    waste = -nbytes % _HUGE_PAGE
    buf = _huge_empty(nbytes) if nbytes >= _HUGE_PAGE and waste * 16 <= nbytes else None
    if buf is None:
        align = _PAGE if nbytes >= _PAGE_FROM else _ALIGNMENT
        raw = np.empty(nbytes + align, dtype=np.uint8)
        offset = (-raw.ctypes.data) % align
        buf = raw[offset : offset + nbytes]
    if prefault and nbytes:
        touch_pages(buf)
    return buf


# Buffers under this size are packed together (``packed_empty``); larger ones get
# a mapping of their own (on huge pages, ``aligned_empty``).
_PACK_BELOW = _HUGE_PAGE


def packed_empty(sizes: list[int], *, prefault: bool = True) -> list[np.ndarray]:
    """One buffer per size in ``sizes``, the small ones side by side in shared memory.

    A state of many small shards (a JAX array sharded over 8 devices gives 8)
    staged into a buffer each spread them over as many 4 KiB-page
    allocations: the data file written from them then needed a gathering
    copy (a buffer under 64 KiB did not start on a page, so ``O_DIRECT``
    could not take it) and the disk write pinned every page apart. Packed
    in order into one allocation (on huge pages from 2 MiB), each on a page
    boundary where its length is whole pages (else 64-byte aligned), they
    are written straight from where they are, back to back. Buffers of
    ``_PACK_BELOW`` and more get their own ``aligned_empty``. The shared
    memory is freed once every buffer packed into it is.
    """
    out: list[np.ndarray | None] = [None] * len(sizes)
    offsets: list[tuple[int, int]] = []
    end = 0
    for i, nbytes in enumerate(sizes):
        if nbytes >= _PACK_BELOW:
            out[i] = aligned_empty(nbytes, prefault=prefault)
            continue
        align = _PAGE if nbytes % _PAGE == 0 or nbytes >= _PAGE_FROM else _ALIGNMENT
        start = -(-end // align) * align
        offsets.append((i, start))
        end = start + nbytes
    if offsets:
        if end >= _PAGE_FROM:  # on a page (on huge pages where it pays)
            arena = aligned_empty(end, prefault=prefault)
        else:
            raw = np.empty(end + _PAGE, dtype=np.uint8)
            shift = (-raw.ctypes.data) % _PAGE
            arena = raw[shift:shift + end]
            if prefault:
                touch_pages(arena)
        for i, start in offsets:
            out[i] = arena[start:start + sizes[i]]
    return out  # type: ignore[return-value]
