"""Snapshot stage: the pool of host staging slots.

A slot is a set of host buffers large enough for one copy of the training
state. A save takes a free slot, copies the state into it on the caller's
thread, and hands it to the background writer, which gives it back once the
bytes are in files. The pool is the writer/reader semaphore pair of the
classic design: ``acquire`` waits for a free slot (the writer semaphore), the
writer's queue plays the reader side.

Buffers are kept from save to save, keyed by a name the framework adapter
chooses, so the steady state allocates nothing and touches only warm pages.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

logger = logging.getLogger(__name__)

_ALIGNMENT = 64  # bytes; cache-line aligned, and what XLA/Eigen expect for zero-copy use.


def aligned_empty(nbytes: int, *, prefault: bool = True) -> np.ndarray:
    """Returns a 1-D uint8 array of ``nbytes`` whose data is 64-byte aligned.

    Args:
        nbytes: Size of the buffer.
        prefault: Touch every page now, so the first copy into the buffer does
            not pay for page faults on the training thread's clock.
    """
    raw = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _ALIGNMENT
    buf = raw[offset : offset + nbytes]
    if prefault and nbytes:
        buf.fill(0)
    return buf


_PIECE = 8 << 20  # bytes per parallel copy piece
_INLINE = 2 << 20  # arrays smaller than this are copied on the calling thread
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def _copy_threads() -> int:
    """Threads that copy together, the calling thread included."""
    return max(1, min(4, os.cpu_count() or 1))


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


def _copy_all(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src, casting="no")


def copy_arrays(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copies each source array into its destination, large ones in parallel.

    The training thread waits for this copy anyway, so the cores it leaves
    idle do the copy with it: large arrays are cut into 8 MiB pieces, split
    into one run of about equal bytes per thread, and copied by a small
    thread pool together with the calling thread (NumPy releases the GIL
    while copying). One task per thread, not per piece, keeps the hand-off
    cost constant however many arrays there are. Small arrays are copied by
    the calling thread while the pool works.

    Args:
        pairs: ``(destination, source)`` arrays of equal shape and dtype.
    """
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    inline: list[tuple[np.ndarray, np.ndarray]] = []
    for dst, src in pairs:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"staging copy mismatch: {src.shape}/{src.dtype} into {dst.shape}/{dst.dtype}"
            )
        if dst.nbytes < _INLINE or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            inline.append((dst, src))
            continue
        d, s = _flat_bytes(dst), _flat_bytes(src)
        for start in range(0, d.nbytes, _PIECE):
            pieces.append((d[start : start + _PIECE], s[start : start + _PIECE]))
    runs = _split_by_bytes(pieces, _copy_threads()) if len(pieces) > 1 else [pieces]
    futures = [_pool().submit(_copy_all, run) for run in runs[1:]]
    try:
        _copy_all(inline)
        _copy_all(runs[0])
    finally:
        for f in futures:
            f.result()


class Slot:
    """One set of reusable host buffers, holding at most one staged save."""

    def __init__(self, index: int):
        self.index = index
        self._buffers: dict[str, np.ndarray] = {}
        self._used: set[str] = set()

    def begin(self) -> None:
        """Starts filling the slot for a new save."""
        self._used.clear()

    def buffer(self, key: str, shape: Iterable[int], dtype: np.dtype | type) -> np.ndarray:
        """Returns a writable C-contiguous host buffer for one array.

        The same key with the same byte size gets the same memory back on the
        next save; a new key or size allocates (and pre-faults) a new buffer.

        Args:
            key: Stable name of the array within the state.
            shape: Shape of the array.
            dtype: NumPy dtype (extension dtypes such as bfloat16 work).
        """
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        raw = self._buffers.get(key)
        if raw is None or raw.nbytes != nbytes:
            raw = aligned_empty(nbytes)
            self._buffers[key] = raw
        self._used.add(key)
        return raw.view(dtype).reshape(shape)

    def trim(self) -> None:
        """Frees buffers that the save being staged did not use."""
        for key in [k for k in self._buffers if k not in self._used]:
            del self._buffers[key]

    @property
    def nbytes(self) -> int:
        """Host memory held by this slot."""
        return sum(b.nbytes for b in self._buffers.values())

    def clear(self) -> None:
        """Drops every buffer (used when the pool is closed)."""
        self._buffers.clear()
        self._used.clear()


class StagingPool:
    """A fixed number of slots; ``acquire`` blocks while all are in use."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._slots = [Slot(i) for i in range(num_slots)]
        self._free = list(self._slots)
        self._cond = threading.Condition()

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self._slots) - len(self._free)

    @property
    def nbytes(self) -> int:
        """Host memory held by all slots."""
        return sum(s.nbytes for s in self._slots)

    def acquire(self, timeout: float | None = None) -> tuple[Slot, float]:
        """Takes a free slot, waiting for the writer to release one if needed.

        Returns:
            The slot and the seconds spent waiting for it.

        Raises:
            TimeoutError: No slot became free within ``timeout`` seconds.
        """
        start = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout):
                raise TimeoutError(f"no staging slot became free within {timeout} s")
            # Prefer the most recently released slot: its pages are the warmest.
            slot = self._free.pop()
        slot.begin()
        return slot, time.perf_counter() - start

    def release(self, slot: Slot) -> None:
        """Returns a slot to the pool once its bytes are safely in files."""
        with self._cond:
            if slot in self._free:
                raise RuntimeError(f"staging slot {slot.index} released twice")
            self._free.append(slot)
            self._cond.notify()

    def close(self) -> None:
        """Frees all host buffers."""
        with self._cond:
            for slot in self._slots:
                slot.clear()
