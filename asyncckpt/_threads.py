"""Thread helpers shared by the engine's background threads and the storage clients.

Neutral: imports nothing of asyncckpt, so every layer (engine, storage,
the framework adapters) can use it without importing another layer.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> None:
    """Raises the calling thread's niceness by ``nice`` (Linux only; best effort).

    On Linux each thread has its own niceness and threads it starts inherit
    it, so a background thread's helpers run at the same priority. Lowering
    one's own priority needs no privilege; where it is refused or the
    platform has no per-thread priority, the thread runs unchanged.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError as e:
        logger.debug("could not lower a background thread's priority: %s", e)


def run_in_threads(fn: Callable, items: Sequence, workers: int, *, name: str) -> None:
    """Calls ``fn(item)`` for every item on up to ``workers`` threads named ``name``.

    Returns once all calls returned; re-raises the first failure (in the
    order of ``items``) after the calls already started have ended.
    """
    if not items:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items))),
                            thread_name_prefix=name) as pool:
        for _ in pool.map(fn, items):
            pass
