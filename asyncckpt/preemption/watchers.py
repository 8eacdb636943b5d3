"""Sources of termination notices: SIGTERM, the GCE metadata server, a user function.

Every watcher delivers a ``Notice`` through a callback that must be safe to
call from a signal handler (the handler passes ``queue.SimpleQueue.put``):
no watcher does any coordination itself. Watchers that own a thread stop
promptly on ``stop()``: a long-poll to the metadata server is aborted by
shutting its socket down, not waited out.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncckpt.preemption.platform import MetadataClient, MetadataError

logger = logging.getLogger(__name__)

MAINTENANCE_PATH = "instance/maintenance-event"
PREEMPTED_PATH = "instance/preempted"
TERMINATE_ON_HOST_MAINTENANCE = "TERMINATE_ON_HOST_MAINTENANCE"
MIGRATE_ON_HOST_MAINTENANCE = "MIGRATE_ON_HOST_MAINTENANCE"


@dataclass(frozen=True)
class Notice:
    """One termination notice.

    Attributes:
        source: ``"sigterm"`` (also when JAX's notifier caught it),
            ``"gce-maintenance"``, ``"gce-preempted"`` or ``"user"``.
        wall_time: ``time.time()`` when it was received.
        detail: Free text for logs.
    """

    source: str
    wall_time: float
    detail: str = ""


NoticeSink = Callable[[Notice], None]


class SigtermWatcher:
    """Turns SIGTERM into a notice, then calls the handler installed before.

    A Python handler installed earlier is chained (called after the notice is
    queued); the default action and ``SIG_IGN`` are not, since the default
    action would end the process before the checkpoint is saved. Signal
    handlers can only be installed from the main thread; elsewhere this
    watcher logs a warning and does nothing.

    Not used while ``jax.distributed`` runs its preemption service: JAX's
    C++ notifier owns SIGTERM there (a Python handler installed after it
    would silently disable it), and the handler reads JAX's sync point.
    """

    name = "sigterm"

    def __init__(self, sink: NoticeSink):
        self._sink = sink
        self._previous: object = None
        self._installed = False

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "preemption handler created off the main thread: SIGTERM is not watched "
                "(Python installs signal handlers only from the main thread)"
            )
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = True

    def _on_signal(self, signum, frame) -> None:
        self._sink(Notice("sigterm", time.time(), f"signal {signum}"))
        previous = self._previous
        if callable(previous):
            previous(signum, frame)

    def stop(self, *, restore: bool = True) -> None:
        """Reinstalls the previous handler if ours is still the current one."""
        if not self._installed:
            return
        self._installed = False
        if not restore or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._on_signal:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)


class _ThreadWatcher:
    """A watcher that runs ``_watch`` on a daemon thread until ``stop()``."""

    name = "watcher"

    def __init__(self, sink: NoticeSink):
        self._sink = sink
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._main, name=f"asyncckpt-{self.name}", daemon=True
        )
        self._thread.start()

    def _main(self) -> None:
        try:
            self._watch()
        except Exception:
            logger.exception("preemption watcher %s failed; it no longer watches", self.name)

    def _watch(self) -> None:
        raise NotImplementedError

    def _abort(self) -> None:
        """Unblocks ``_watch`` (called by ``stop`` after setting the event)."""

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._abort()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("preemption watcher %s did not stop within %.0f s",
                               self.name, timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class PollingWatcher(_ThreadWatcher):
    """Calls a user ``termination_watcher_fn`` every ``interval_s`` seconds.

    An exception from the function is logged (once per distinct message) and
    counts as "no notice". ``armed=False`` (watching again after a notice
    was handled): True is a notice only after the function has returned
    False once, so a function that stays True does not repeat the notice.
    """

    name = "user-watcher"

    def __init__(self, sink: NoticeSink, fn: Callable[[], bool], *, interval_s: float = 1.0,
                 armed: bool = True):
        super().__init__(sink)
        self._fn = fn
        self._interval_s = interval_s
        self._armed = armed

    def _watch(self) -> None:
        last_error = None
        while not self._stop.is_set():
            try:
                if not self._fn():
                    self._armed = True
                elif self._armed:
                    self._sink(Notice("user", time.time(), "termination_watcher_fn returned True"))
                    return
            except Exception as e:
                if repr(e) != last_error:
                    logger.warning("termination_watcher_fn raised %r; treated as no notice", e)
                    last_error = repr(e)
            self._stop.wait(self._interval_s)


class MetadataWatcher(_ThreadWatcher):
    """Long-polls one GCE metadata value and turns given values into a notice.

    The first request reads the current value and its ``ETag``; each later one
    asks with ``wait_for_change=true&last_etag=<etag>``, so the server answers
    only when the value changes (or after ``long_poll_s``). 5xx answers (the
    server answers 503 while it is busy) and connection errors are retried
    with exponential backoff and jitter; the backoff resets after a good
    answer.

    Args:
        sink: Where notices go.
        path: Metadata path, e.g. ``instance/maintenance-event``.
        source: ``Notice.source`` of the notice.
        notice_values: Values that are a notice (compared case-insensitively).
        logged_values: Values that are only logged (e.g. a live migration).
        client: Metadata client (default: the configured host).
        long_poll_s: ``timeout_sec`` of each long-poll.
        backoff_s: First retry delay; doubles up to ``max_backoff_s``.
        armed: False when watching again after a notice was handled: a
            notice value is then a notice only after another value was seen
            (the event that was handled may still be pending).
    """

    def __init__(
        self,
        sink: NoticeSink,
        *,
        path: str,
        source: str,
        notice_values: tuple[str, ...],
        logged_values: tuple[str, ...] = (),
        client: MetadataClient | None = None,
        long_poll_s: int = 60,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        armed: bool = True,
    ):
        super().__init__(sink)
        self._armed = armed
        self.name = f"gce-{path.rsplit('/', 1)[-1]}"
        self.path = path
        self.source = source
        self._notice_values = tuple(v.upper() for v in notice_values)
        self._logged_values = tuple(v.upper() for v in logged_values)
        self._client = client or MetadataClient()
        self._long_poll_s = long_poll_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self.requests = 0
        self.errors = 0

    def _abort(self) -> None:
        self._client.abort()

    def _watch(self) -> None:
        etag: str | None = None
        delay = self._backoff_s
        last_logged = None
        while not self._stop.is_set():
            try:
                self.requests += 1
                resp = self._client.get(
                    self.path,
                    wait_for_change=etag is not None,
                    last_etag=etag,
                    timeout_sec=self._long_poll_s,
                )
            except (OSError, MetadataError) as e:
                if self._stop.is_set():
                    return
                if isinstance(e, MetadataError) and not e.retriable:
                    logger.error("GCE watcher %s: %s; it no longer watches", self.path, e)
                    return
                self.errors += 1
                wait = delay * random.uniform(0.5, 1.0)
                logger.debug("GCE watcher %s: %s; retrying in %.2f s", self.path, e, wait)
                self._stop.wait(wait)
                delay = min(delay * 2, self._max_backoff_s)
                continue
            delay = self._backoff_s
            if resp is None:
                logger.info("GCE metadata has no %s; not watching it", self.path)
                return
            value = resp.value.strip().upper()
            if value in self._notice_values and self._armed:
                logger.warning("GCE metadata %s = %s: termination notice", self.path, value)
                self._sink(Notice(self.source, time.time(), f"{self.path}={value}"))
                return
            if value not in self._notice_values:
                self._armed = True
            if value in self._logged_values and value != last_logged:
                logger.warning(
                    "GCE metadata %s = %s: no checkpoint needed (the VM is live-migrated)",
                    self.path,
                    value,
                )
            last_logged = value
            if resp.etag is None:
                # No etag, no long-poll: fall back to polling once a second.
                self._stop.wait(1.0)
            etag = resp.etag


def maintenance_watcher(sink: NoticeSink, client: MetadataClient | None = None, *,
                        armed: bool = True) -> MetadataWatcher:
    """Watches ``instance/maintenance-event`` for ``TERMINATE_ON_HOST_MAINTENANCE``."""
    return MetadataWatcher(
        sink,
        path=MAINTENANCE_PATH,
        source="gce-maintenance",
        notice_values=(TERMINATE_ON_HOST_MAINTENANCE,),
        logged_values=(MIGRATE_ON_HOST_MAINTENANCE,),
        client=client,
        armed=armed,
    )


def spot_watcher(sink: NoticeSink, client: MetadataClient | None = None, *,
                 armed: bool = True) -> MetadataWatcher:
    """Watches ``instance/preempted`` (``TRUE`` once a Spot VM is preempted)."""
    return MetadataWatcher(
        sink, path=PREEMPTED_PATH, source="gce-preempted", notice_values=("TRUE",),
        client=client, armed=armed,
    )
