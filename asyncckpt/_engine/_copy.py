"""Snapshot stage: copying arrays into staging buffers on every idle core.

Split from ``slots``: the copy threads and how a copy is cut into pieces,
used by the slot pool (pre-faulting new buffers) and by every framework
adapter (the state copy of a save).
"""

from __future__ import annotations

import itertools
import operator
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from asyncckpt._engine._pages import touch_pages

__all__ = ["copy_arrays", "copy_columns", "prefault_all"]


def prefault_all(bufs: Sequence[np.ndarray]) -> None:
    """Touches every page of ``bufs``, on the calling thread and the copy threads.

    Page faults run in the kernel without the GIL, so the threads fault in
    parallel; buffers are cut in 8 MiB pieces and split by bytes.
    """
    pieces = []
    for buf in bufs:
        flat = _flat_bytes(buf)
        for start in range(0, flat.nbytes, _PIECE):
            part = flat[start : start + _PIECE]
            pieces.append((part, part))
    if not pieces:
        return
    runs = _split_by_bytes(pieces, _copy_threads()) if len(pieces) > 1 else [pieces]
    futures = [_pool().submit(_prefault_run, run) for run in runs[1:]]
    try:
        _prefault_run(runs[0])
    finally:
        for f in futures:
            f.result()


def _prefault_run(pieces: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for part, _ in pieces:
        touch_pages(part)


_PIECE = 8 << 20  # bytes per parallel copy piece
_INLINE = 2 << 20  # states smaller than this are copied on the calling thread alone
# Arrays under this size are copied by the calling thread, never shared out: each
# copy takes the GIL, so small copies on several threads mostly hand the GIL back
# and forth. Measured (2-core VM, packed destinations): 4,000 copies of 8 KiB took
# 7.6 ms shared against 3.3 ms on the calling thread alone; 500 of 64 KiB 2.5 ms
# either way; 128 of 256 KiB 1.6 ms shared against 2.4 ms.
_SHARE_MIN = 64 << 10
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()
_cpus: int | None = None


def _copy_threads() -> int:
    """Threads that copy together, the calling thread included.

    ``os.cpu_count()`` reads ``/sys`` on every call (tens of microseconds on
    a save's clock): it is asked once.
    """
    global _cpus
    if _cpus is None:
        _cpus = max(1, min(4, os.cpu_count() or 1))
    return _cpus


def _pool() -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            workers = max(1, _copy_threads() - 1)
            _copy_pool = ThreadPoolExecutor(workers, thread_name_prefix="asyncckpt-copy")
        return _copy_pool


def _after_fork_in_child() -> None:
    """A fork() child has none of the parent's copy threads: start afresh."""
    global _copy_pool, _copy_pool_lock
    _copy_pool = None
    _copy_pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _split_by_bytes(
    pieces: list[tuple[np.ndarray, np.ndarray]], groups: int
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Cuts ``pieces`` into at most ``groups`` runs of about equal bytes, in order."""
    total = sum(d.nbytes for d, _ in pieces)
    out: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    done = 0
    for piece in pieces:
        if out[-1] and len(out) < groups and done >= total * len(out) / groups:
            out.append([])
        out[-1].append(piece)
        done += piece[0].nbytes
    return out


_first, _second = operator.itemgetter(0), operator.itemgetter(1)
_shape, _dtype, _nbytes = (operator.attrgetter(a) for a in ("shape", "dtype", "nbytes"))


def _copy_all(pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src, casting="no")


def _piece_bytes(total: int, threads: int) -> int:
    """Bytes per copy piece: about four pieces per thread, 1-8 MiB, page multiples.

    Threads take pieces as they come (below), so a thread that starts late
    or is preempted leaves its pieces to the others; more pieces than
    threads is what lets the load even out.
    """
    return max(1 << 20, min(_PIECE, total // (4 * threads) // 4096 * 4096))


def copy_arrays(pairs: Sequence[tuple[np.ndarray, Any]]) -> None:
    """Copies each source array into its destination, on the idle cores too.

    ``pairs``: ``(destination, source)`` of equal shape and dtype; see
    ``copy_columns``, which this is with the pairs taken apart.

    Raises:
        ValueError: a pair differs in shape or dtype; nothing is copied then.
    """
    copy_columns(list(map(_first, pairs)), list(map(_second, pairs)))


def copy_columns(dsts: Sequence[np.ndarray], srcs: Sequence[Any]) -> None:
    """Copies each ``srcs[i]`` into ``dsts[i]``, on the idle cores too.

    The training thread waits for this copy anyway, so the cores it leaves
    idle do the copy with it: arrays are cut into pieces of 1-8 MiB (about
    four per thread), and the calling thread and a small thread pool take
    the pieces and the smaller arrays from one shared queue until none is
    left (NumPy releases the GIL while copying). A copy thread that wakes
    late, or whose core is busy (the writer, the step's own threads), then
    costs at most its piece in hand: with fixed runs of equal bytes per
    thread, the calling thread waited for the late thread's whole run. A
    state of many arrays is shared out like a large one (100 arrays of
    16-64 MiB in all: 1.40x a memcpy on the calling thread alone, 0.97-1.14x
    shared), except arrays under ``_SHARE_MIN``, which the calling thread
    copies while the others take the rest. Under ``_INLINE`` bytes in all,
    the calling thread copies alone.

    A source may also be what NumPy views without copying (a CPU
    ``jax.Array`` shard, through the buffer protocol): it is viewed only
    when copied, so each view, and the memoryview NumPy keeps as its base,
    dies as soon as its copy is done. Views taken up front for a state of
    thousands of shards were alive through the whole copy, so the garbage
    collector promoted them, 8,000 objects a save, and every fifth save at
    4,000 shards paid a full collection (70 ms with JAX loaded) inside the
    training thread's wait. For the same reason the sources come as a
    column, not as pairs: a tuple holding a ``jax.Array`` is tracked by the
    collector, and 4,000 of them alive through the copy were promoted too.

    Args:
        dsts: The destinations (NumPy arrays).
        srcs: The sources, as many: NumPy arrays, or sources as above, each
            of its destination's shape and dtype.

    Raises:
        ValueError: a source differs in shape or dtype, or the two differ in
            length; nothing is copied then.
    """
    if len(dsts) != len(srcs):
        raise ValueError(f"staging copy: {len(srcs)} sources for {len(dsts)} destinations")
    # Checked and summed by C-level maps: a state of hundreds of arrays paid
    # about 0.5 us an array for a Python loop here.
    if (list(map(_shape, dsts)) != list(map(_shape, srcs))
            or list(map(_dtype, dsts)) != list(map(_dtype, srcs))):
        for dst, src in zip(dsts, srcs, strict=True):
            _check_pair(dst, src)  # raises, naming the first mismatch
    sizes = list(map(_nbytes, dsts))
    total = sum(sizes)
    threads = _copy_threads()
    if total < _INLINE or threads < 2 or max(sizes) < _SHARE_MIN:
        _copy_all(zip(dsts, srcs, strict=True))
        return
    step = _piece_bytes(total, threads)
    # Arrays over a piece are cut (a state of many small arrays: each is one).
    large = [(d, s) for d, s, n in zip(dsts, srcs, sizes, strict=True) if n >= _SHARE_MIN]
    pieces = large if max(sizes) <= step else _cut(large, step)
    # The calling thread's alone (``_SHARE_MIN``); a pair at a time, as copied.
    small = ((d, s) for d, s, n in zip(dsts, srcs, sizes, strict=True) if n < _SHARE_MIN)
    if len(pieces) < 2:
        _copy_all(itertools.chain(small, pieces))
        return
    shared = iter(pieces)  # next() on it is atomic under the GIL: each piece once
    futures = [_pool().submit(_copy_all, shared)
               for _ in range(min(threads, len(pieces)) - 1)]
    try:
        _copy_all(itertools.chain(small, shared))  # small ones first, while the pool starts
    finally:
        for f in futures:
            f.result()


def _cut(pairs: Sequence[tuple[np.ndarray, np.ndarray]],
         step: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The pairs with every contiguous array over ``step`` bytes cut into pieces of it."""
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for dst, src in pairs:
        if dst.nbytes <= step:
            pieces.append((dst, src))
            continue
        src = np.asarray(src)  # a view, kept while its pieces are copied
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            pieces.append((dst, src))
            continue
        d, s = _flat_bytes(dst), _flat_bytes(src)
        for start in range(0, d.nbytes, step):
            pieces.append((d[start : start + step], s[start : start + step]))
    return pieces


def _check_pair(dst: np.ndarray, src: np.ndarray) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"staging copy mismatch: {src.shape}/{src.dtype} into {dst.shape}/{dst.dtype}"
        )
