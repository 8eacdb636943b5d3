"""Spare staging slots: built off the training thread when a save had to wait.

With a fixed number of slots, a burst of saves deeper than the slots (a save
issued while every slot is still being written) waits for the disk. The pool
therefore learns the burst depth: when a save finds no free slot, one more
slot of the state's layout is built here, on a background thread, and joins
the pool pre-faulted, so the next burst of that depth blocks only for its
copies. The waiting save takes whichever comes first, a slot the writer
releases or the finished spare; a slot joins the pool only once every buffer
of it is built, so no save ever copies into pages still being faulted.

This module holds the part without pool state: the build itself, which
stops between 8 MiB pieces once the pool is closed and pauses there while a
save copies. Whether a spare fits in host memory is the pool's budget's call
(``asyncckpt._engine.budget``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from asyncckpt._engine._pages import packed_empty

logger = logging.getLogger(__name__)

_STEP = 8 << 20  # bytes faulted between checks for a closed pool


def build_buffers(
    layout: Mapping[str, int],
    stopped: Callable[[], bool],
    fault: Callable[[np.ndarray], None],
    on_alloc: Callable[[int], None] | None = None,
    *,
    pause: Callable[[], None] | None = None,
) -> dict[str, np.ndarray] | None:
    """Allocates and pre-faults one buffer per ``layout`` entry (key to byte size).

    Runs on the calling thread only: the copy threads belong to the saving
    thread, whose copies must not queue behind this build. Page faults run
    without the GIL, so training threads keep running meanwhile.

    Args:
        layout: Byte size of each buffer, by key.
        stopped: Checked before each 8 MiB piece; True abandons the build.
        fault: Touches the pages of one piece.
        on_alloc: Told the byte size of each buffer as it is allocated.
        pause: Called before each piece: waits while a save copies (the
            engine's ``SaveGate.wait``), so the build's page faults and
            zeroing do not compete with the copy for cores and memory.

    Returns:
        The buffers, or None when ``stopped`` said so (they are then freed).
    """
    if stopped():
        return None
    # Allocated at once, the small ones side by side as the slot's own are
    # (``packed_empty``); faulted in buffer by buffer.
    bufs = dict(zip(layout, packed_empty(list(layout.values()), prefault=False), strict=True))
    for key, nbytes in layout.items():
        if stopped():
            return None
        buf = bufs[key]
        if on_alloc is not None:
            on_alloc(nbytes)
        for start in range(0, nbytes, _STEP):
            if pause is not None:
                pause()
            if stopped():
                return None
            fault(buf[start : start + _STEP])
    return bufs
