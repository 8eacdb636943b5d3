"""Saves that block only for TensorFlow's reads: the host copy runs in the background.

A TensorFlow tensor is immutable, and a resource variable's read returns a
tensor that shares the variable's buffer. Every op that updates a variable in
place (``AssignAddVariableOp``, the ``ResourceApply*`` optimizer kernels,
scatter and sparse updates, XLA-compiled steps) first checks whether that
buffer is shared (its reference count is above one) and, if so, writes into
a fresh copy instead (copy-on-write); ``AssignVariableOp`` never writes into
the old buffer at all. So the tensors a save reads are an exact snapshot of
the state at the save call for as long as they are held, whatever training
does next.

A save in this mode therefore reads the values on the training thread and
returns; ``DeferredCopy`` copies each read tensor of host memory into the
staging slot on a background thread and drops it as soon as it is copied, so
the window in which a training step pays a copy-on-write is as short as the
copy. Values in device memory (GPU, TPU) are still copied to the host on the
training thread: the device-to-host copy is the save's snapshot there.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import numpy as np

from asyncckpt._engine._copy import copy_arrays

logger = logging.getLogger(__name__)

# Copied (and released) in groups of about this many bytes: large enough that
# the per-call cost of the copy is negligible, small enough that a tensor is
# released soon after its copy.
_GROUP_BYTES = 8 << 20


def _groups(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[list]:
    groups: list[list] = []
    current: list = []
    size = 0
    for pair in pairs:
        current.append(pair)
        size += pair[0].nbytes
        if size >= _GROUP_BYTES:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def _copy_group(group: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    try:
        copy_arrays(group)
    except RuntimeError:
        # The copy threads refuse work once the interpreter shuts down (a save
        # the exit flush completes): copy on this thread alone.
        for dst, src in group:
            np.copyto(dst, src)


class DeferredCopy:
    """The host copies of one save into its slot, run on the background copy thread.

    Holds the read tensors (NumPy views of their host memory, which keep
    TensorFlow's buffers alive) until each group is copied, then drops them,
    so a variable's buffer is shared with the save only while its copy is
    pending. Once it has run, or failed, or been cancelled, it holds nothing.

    Args:
        pairs: ``(slot buffer, view of a read tensor)`` to copy.
    """

    def __init__(self, pairs: list[tuple[np.ndarray, np.ndarray]]):
        self._groups = _groups(pairs)
        self.nbytes = sum(d.nbytes for d, _ in pairs)
        self._future: Future[None] = Future()
        self._lock = threading.Lock()
        self._copied = threading.Condition(self._lock)
        self._done = 0  # groups copied so far, in order
        # Which group copies into each slot buffer (by identity: the buffers
        # outlive the save; only their ids are kept).
        self._group_of = {id(d): g for g, group in enumerate(self._groups) for d, _ in group}
        self._started = False

    @property
    def pending(self) -> int:
        """Groups of read tensors still held (not yet copied or released)."""
        with self._lock:
            return len(self._groups)

    def start(self) -> None:
        """Queues the copies on the background copy thread (once; later calls do nothing)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        _worker().submit(self)

    def run(self) -> None:
        """Copies every group, releasing each as soon as it is copied.

        Called on the copy thread; the outcome is what ``wait`` returns or raises.
        """
        if not self._future.set_running_or_notify_cancel():
            return  # cancelled: cancel() has released the tensors
        try:
            while True:
                with self._lock:
                    if not self._groups:
                        break
                    group = self._groups[0]
                try:
                    _copy_group(group)
                finally:
                    del group
                with self._lock:
                    if self._groups:
                        del self._groups[0]
                    self._done += 1
                    self._copied.notify_all()
        except BaseException as e:
            self.release()
            # The frames of the failed copy hold views of the tensors: a stored
            # error must not keep the save's snapshot alive.
            traceback.clear_frames(e.__traceback__)
            self._future.set_exception(e)
        else:
            self._future.set_result(None)
        finally:
            with self._lock:
                self._copied.notify_all()

    def release(self) -> None:
        """Drops every read tensor still held (after a failure or a cancel)."""
        with self._lock:
            self._groups = []

    def wait_for(self, buffers: Iterable[np.ndarray]) -> None:
        """Returns once each of ``buffers`` (slot buffers) holds its copy.

        The bundle writer calls this before each range of the data file, so
        it writes what is copied while the rest is still being copied (the
        copies run in file order). A buffer this save does not copy in the
        background is ready already. Raises what the copy raised, and
        ``CancelledError`` once it is cancelled, if a buffer is not copied.
        """
        need = max((self._group_of.get(id(b), -1) for b in buffers), default=-1)
        if need < 0:
            return
        self.start()
        with self._lock:
            while self._done <= need and not self._future.done():
                self._copied.wait()
            if self._done > need:
                return
        self._future.result()  # failed or cancelled before this buffer was copied
        raise RuntimeError("background copy ended before every buffer was copied")

    def wait(self) -> None:
        """Returns once every value is in the slot; raises what the copy raised.

        Starts the copy if nothing has yet.
        """
        self.start()
        self._future.result()

    def cancel(self) -> None:
        """Stops the copy for a save that will not be written; never raises.

        Returns once the copy thread no longer touches the slot, so the slot
        may be given back.
        """
        if self._future.cancel():
            self.release()
            with self._lock:
                self._copied.notify_all()  # a waiting writer sees the cancel
            return
        try:
            self._future.result()
        except BaseException as e:  # the save is being abandoned anyway
            logger.debug("background copy of an abandoned save failed: %r", e)


class _Worker:
    """One daemon thread that runs the background copies of every save, in order.

    A daemon, so it never holds up interpreter exit by itself; the engines'
    exit flush waits for saves in flight, and so for their copies, while the
    interpreter is still whole. It runs at the training threads' priority: the
    sooner a copy ends, the fewer training steps meet a shared buffer.
    """

    def __init__(self):
        self._queue: queue.SimpleQueue[DeferredCopy] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="asyncckpt-tf-copy", daemon=True)
        self._thread.start()

    def submit(self, copy: DeferredCopy) -> None:
        self._queue.put(copy)

    def _loop(self) -> None:
        while True:
            copy = self._queue.get()
            copy.run()
            del copy


_worker_lock = threading.Lock()
_the_worker: _Worker | None = None


def _worker() -> _Worker:
    global _the_worker
    with _worker_lock:
        if _the_worker is None:
            _the_worker = _Worker()
        return _the_worker


def _after_fork_in_child() -> None:
    """A fork() child has none of the parent's threads: a new worker on first use."""
    global _the_worker, _worker_lock
    _the_worker = None
    _worker_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

