"""Process-level lifecycle of the engines: the flush at exit, and ``fork()``.

**Exit.** Writer threads are daemons, so a forgotten ``close()`` never hangs
the interpreter. Saves still in flight when the main thread finishes are given
a bounded time (``AsyncOptions.exit_timeout_s``) to become durable by one
non-daemon *exit watcher* thread per process, started with the first save. It
blocks in ``threading.main_thread().join()``, which returns as soon as the
main thread has finished; the interpreter then waits for non-daemon threads
(the watcher among them) before it runs ``atexit`` handlers or tears anything
down. So the flush runs while TensorFlow and JAX are fully usable (their own
``atexit`` hooks, e.g. ``jax.distributed.shutdown``, have not run yet), using
only public API. A plain ``atexit`` hook would run after those, in an order
that depends on import order. Saves made by other non-daemon threads that
outlive the main thread are flushed once those threads end.

**Fork.** A child made by ``os.fork()`` inherits the parent's engines but not
their writer threads. ``os.register_at_fork`` marks every inherited engine
dead in the child: its saves belong to the parent, so the child never waits
for them at exit and never writes them; ``save()`` on an inherited engine
raises ``EngineClosedError``. (Module-level locks and thread pools that a
parent thread might have held at the fork are replaced in the child by
their own modules' fork hooks: ``_copy``, ``lock``.)

The engine's side of this interface is ``AsyncEngine.flush_at_exit`` and
``AsyncEngine.mark_forked``.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncckpt._engine.writer import AsyncEngine

logger = logging.getLogger(__name__)

ENGINES: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()
_lock = threading.Lock()
_watcher: threading.Thread | None = None


def register(engine: AsyncEngine) -> None:
    """Adds an engine to the set flushed at exit and killed in fork children."""
    with _lock:
        ENGINES.add(engine)


def unregister(engine: AsyncEngine) -> None:
    with _lock:
        ENGINES.discard(engine)


def _watch_main_thread() -> None:
    threading.main_thread().join()
    me = threading.current_thread()
    while True:
        with _lock:
            engines = list(ENGINES)
        for engine in engines:
            try:
                engine.flush_at_exit()
            except Exception:  # pragma: no cover - logged, never blocks exit
                logger.exception("flushing checkpoint saves at exit")
        # Training may run in other non-daemon threads, which the interpreter
        # waits for anyway: flush again once they are done.
        others = [t for t in threading.enumerate()
                  if t is not me and not t.daemon and t.is_alive()
                  and t is not threading.main_thread()]
        if not others:
            return
        for t in others:
            t.join()


def ensure_exit_watcher() -> None:
    """Starts the exit watcher once per process (called on the first save).

    When the main thread has already finished (an engine used only by
    threads that outlive it), no watcher is started: the interpreter is
    already shutting down and there is nothing left to wait for it.
    """
    global _watcher
    with _lock:
        if _watcher is not None:
            return
        if not threading.main_thread().is_alive():
            return
        _watcher = threading.Thread(
            target=_watch_main_thread, name="asyncckpt-exit-flush", daemon=False
        )
        _watcher.start()


def _after_fork_in_child() -> None:
    global _lock, _watcher
    # A parent thread may have held these at the fork: replace, never acquire.
    _lock = threading.Lock()
    _watcher = None
    for engine in list(ENGINES):
        engine.mark_forked()
    ENGINES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
