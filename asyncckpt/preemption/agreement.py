"""Cluster-wide agreement on the step to save at.

All workers must save at the same step: a save reads variables that may need
a collective (TensorFlow's sync-on-read variables), and a checkpoint mixing
steps is useless. The protocol, over a ``Coordinator`` (keys under the
handler's namespace ``ns``):

1. **Notice.** A worker that receives a notice claims ``ns/notice`` with its
   id, the time and the deadline (notice time + grace period). The claim is
   atomic: the first notice in the cluster wins, later ones only matter if
   their deadline is earlier (see 4). The winner then opens round 0 by
   claiming ``ns/round/0/go`` with ``final`` = "the grace period is shorter
   than the margin".
2. **Round.** Every worker's watcher thread waits for ``ns/round/<n>/go``.
   When it appears, it records the earliest step boundary its training thread
   can still stop at: the current step count if the training thread has not
   yet passed that boundary (or is parked at it), else the count + 1 (the
   step in progress must finish). It publishes that number under
   ``ns/round/<n>/at/<worker>``, and once all are in, the target is their
   maximum: the largest current step + 1 over the workers (or the current
   step, if every worker is still before its boundary). All workers compute
   the same target from the same keys, with no further exchange.
3. **Boundary.** The training thread never passes a step boundary while a
   round it knows of has no target yet (it parks, the watcher is not blocked
   by it), so no worker overshoots the target. At the target it saves; if
   the round is final it flushes and exits.
4. **Grace period.** After a non-final round 0 (with a save made at once, in
   case the notice overstates the time left, when the grace period is long
   enough to afford it), training continues. At each
   boundary a worker compares ``now + margin`` with the earliest deadline it
   knows (the cluster's, or an earlier one of its own later notice); the
   first worker to cross it opens round 1 (final) the same way. The margin
   is the *largest* of any worker's: in round 0 each worker publishes its
   margin (and the part of it owed to saves in flight, which shrinks as time
   passes) under ``ns/round/0/margin/<worker>`` before its step, so the
   slowest worker's estimate decides even where its training thread checks
   late (a slow step, a slow disk).
5. **Errors.** A worker whose training function raises claims ``ns/error``;
   every watcher polls it and the other workers raise ``PeerFailedError`` at
   their next step boundary.

Only the training thread saves; the watcher thread and notice callbacks only
read and write keys.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncckpt._coordination import Coordinator
from asyncckpt.errors import CoordinationTimeoutError, PeerFailedError
from asyncckpt.preemption.watchers import Notice

logger = logging.getLogger(__name__)

ROUNDS = 2  # round 0 at the notice, round 1 at the end of the grace period


class Decision(enum.Enum):
    """What the training thread does at a step boundary."""

    CONTINUE = "continue"
    SAVE = "save"  # save, then train on (the grace period is not over)
    SAVE_AND_EXIT = "save-and-exit"


@dataclass(frozen=True, kw_only=True)
class AgreementOptions:
    """Timing of the protocol.

    Attributes:
        poll_s: Slice of the watcher's waits (bounds how late it notices a
            stop request or a peer's error).
        timeout_s: Longest wait for another worker's part of a round.
        barrier_timeout_s: Longest wait, after this worker's final save is
            durable, for the others to confirm theirs before exiting anyway.
    """

    poll_s: float = 0.5
    timeout_s: float = 300.0
    barrier_timeout_s: float = 120.0


class StepAgreement:
    """One worker's side of the protocol.

    Args:
        coordinator: The key-value store shared by the workers.
        namespace: Key prefix, the same on every worker and unique per
            handler in a run.
        runs: Step count to start from (restored from the checkpoint).
        margin_fn: Seconds the final round needs before the deadline, or None
            while unknown (see ``grace.GraceClock.margin``).
        unknown_write_fraction: Share of the grace period after which the
            final round starts when ``margin_fn`` has no answer.
        save_at_notice_ratio: Round 0 saves (before the grace period is
            used for training) only if the grace period is at least this many
            margins long, or if no margin is known yet (the save measures
            one). Shorter grace periods go straight to the final save, which
            a save at the notice would only delay.
        queued_fn: The part of ``margin_fn``'s answer owed to saves in
            flight (it shrinks while they are written); default 0.
        full_margin_fn: The margin with every save in flight counted, for
            the decision to save at the notice (``margin_fn`` may leave a
            save in flight out: ``grace.GraceClock.margin_parts``); default
            ``margin_fn``.
        options: Protocol timing.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        namespace: str,
        runs: int,
        margin_fn: Callable[[], float | None],
        unknown_write_fraction: float = 0.5,
        save_at_notice_ratio: float = 4.0,
        queued_fn: Callable[[], float] | None = None,
        full_margin_fn: Callable[[], float | None] | None = None,
        options: AgreementOptions | None = None,
    ):
        self.coordinator = coordinator
        self.ns = namespace.rstrip("/")
        self.options = options or AgreementOptions()
        self._margin_fn = margin_fn
        self._queued_fn = queued_fn or (lambda: 0.0)
        self._full_margin_fn = full_margin_fn or margin_fn
        # Other workers' margins published at round 0: (margin, queued, monotonic time).
        self._peer_margins: list[tuple[float, float, float]] = []
        self._unknown_fraction = unknown_write_fraction
        self._save_ratio = save_at_notice_ratio
        self._cond = threading.Condition()
        self._runs = runs
        self._checked = -1  # last boundary passed without stopping
        self._known = [False] * ROUNDS  # round exists (go seen or claimed)
        self._seen_at = [0.0] * ROUNDS
        self._target: list[int | None] = [None] * ROUNDS
        self._final = [False] * ROUNDS
        self._save_at_notice = True
        self._done = [False] * ROUNDS
        self._notice: dict | None = None  # the cluster's winning notice
        self._local_deadline: float | None = None
        self._noticed_locally = False
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- keys ---------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return "/".join([self.ns, *map(str, parts)])

    @property
    def me(self) -> int:
        return self.coordinator.worker_id

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._watch_main, name=f"asyncckpt-agreement-{self.me}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- state --------------------------------------------------------------

    @property
    def runs(self) -> int:
        with self._cond:
            return self._runs

    def reset_runs(self, runs: int) -> None:
        """Sets the step count (after a restore, before any notice)."""
        with self._cond:
            if self._noticed_locally or self._notice is not None:
                raise RuntimeError("cannot reset the step count once a notice is known")
            self._runs = int(runs)
            self._checked = -1

    def step_done(self) -> None:
        """The training thread finished one step (one ``run`` call)."""
        with self._cond:
            self._runs += 1

    @property
    def noticed(self) -> bool:
        """A notice is known here (this worker's or the cluster's)."""
        with self._cond:
            return self._noticed_locally or self._notice is not None

    @property
    def cluster_notice(self) -> dict | None:
        with self._cond:
            return dict(self._notice) if self._notice else None

    def deadline(self) -> float | None:
        """Earliest known deadline (``time.time()`` seconds), or None."""
        with self._cond:
            return self._deadline_locked()

    def _deadline_locked(self) -> float | None:
        values = [v for v in (self._local_deadline,
                              self._notice["deadline"] if self._notice else None) if v is not None]
        return min(values) if values else None

    # -- notices --------------------------------------------------------------

    def notice(self, notice: Notice, grace_s: float) -> None:
        """Handles a notice received by this worker (any thread but a signal handler)."""
        deadline = notice.wall_time + grace_s
        with self._cond:
            first = not self._noticed_locally
            self._noticed_locally = True
            if self._local_deadline is None or deadline < self._local_deadline:
                self._local_deadline = deadline
            cluster_known = self._notice is not None or self._known[0]
            self._cond.notify_all()
        logger.warning("[worker %d] termination notice from %s (%s); grace period %.1f s",
                       self.me, notice.source, notice.detail or "-", grace_s)
        if cluster_known or not first:
            return  # a later notice: the boundary check honours an earlier deadline
        payload = {"worker": self.me, "source": notice.source,
                   "time": notice.wall_time, "deadline": deadline}
        if self.coordinator.claim_json(self._key("notice"), payload):
            margin = self._margin_fn()
            left = deadline - time.time()
            final = left <= 0 or (margin is not None and left <= margin)
            # A save here would queue behind every save in flight: all count.
            full = self._full_margin_fn() if margin is not None else None
            save = final or full is None or left >= self._save_ratio * full
            self.coordinator.claim_json(self._key("round", 0, "go"),
                                        {"final": final, "save": save, "by": self.me})
            logger.warning(
                "[worker %d] first notice in the cluster: %s (margin %s, %.1f s left)",
                self.me,
                "saving and exiting at the next step" if final
                else "saving now, then training on until the final save" if save
                else "training on until the final save",
                "unknown" if margin is None else f"{margin:.2f} s",
                left,
            )
        else:
            logger.info("[worker %d] another worker's notice came first", self.me)
        with self._cond:
            self._known[0] = True  # its round 0 is open, or opens right after its claim
            self._seen_at[0] = self._seen_at[0] or time.monotonic()
            self._cond.notify_all()

    # -- training thread ------------------------------------------------------

    def at_boundary(self) -> Decision:
        """Decides what happens at the current step boundary (training thread).

        Raises:
            PeerFailedError: Another worker's training function failed.
            CoordinationTimeoutError: A round did not complete in time.
        """
        while True:
            with self._cond:
                self._wait_resolved_locked()
                runs = self._runs
                decision = self._decide_locked(runs)
                if decision is not None:
                    return decision
                if not self._time_to_finish_locked():
                    self._checked = runs
                    return Decision.CONTINUE
                self._known[1] = True
                self._seen_at[1] = time.monotonic()
            # Outside the lock: an RPC. Losing the claim means another worker
            # opened the final round first, which is just as good.
            if self.coordinator.claim_json(self._key("round", 1, "go"),
                                           {"final": True, "by": self.me}):
                logger.warning("[worker %d] grace period ending: opening the final round",
                               self.me)

    def _raise_failure_locked(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _wait_resolved_locked(self) -> None:
        while True:
            self._raise_failure_locked()
            final_known = any(t is not None and f for t, f in zip(self._target, self._final,
                                                                   strict=True))
            pending = [n for n in range(ROUNDS) if self._known[n] and self._target[n] is None]
            if final_known or not pending:
                return
            waited = time.monotonic() - self._seen_at[pending[0]]
            if waited > self.options.timeout_s:
                raise CoordinationTimeoutError(
                    f"worker {self.me}: round {pending[0]} of the preemption protocol did not "
                    f"complete within {self.options.timeout_s:.0f} s"
                )
            self._cond.wait(self.options.poll_s)

    def _decide_locked(self, runs: int) -> Decision | None:
        finals = [t for t, f in zip(self._target, self._final, strict=True)
                  if t is not None and f]
        if finals and runs >= min(finals):
            if runs > min(finals):
                logger.error("[worker %d] passed the agreed step %d (now %d); saving now",
                             self.me, min(finals), runs)
            self._done = [True] * ROUNDS
            return Decision.SAVE_AND_EXIT
        t0 = self._target[0]
        if t0 is not None and not self._done[0] and runs >= t0:
            self._done[0] = True
            if self._save_at_notice:
                self._checked = runs
                return Decision.SAVE
        return None

    def _time_to_finish_locked(self) -> bool:
        if self._target[0] is None or self._final[0] or self._known[1]:
            return False
        deadline = self._deadline_locked()
        if deadline is None:
            return False
        now = time.time()
        margin = self.margin()
        if margin is None:
            start = self._notice["time"] if self._notice else now
            return now >= start + self._unknown_fraction * max(deadline - start, 0.0)
        return now + margin >= deadline

    def margin(self) -> float | None:
        """The largest margin of any worker: this one's now, the others' as published.

        A peer's margin is the one it published at the notice, less what its
        saves in flight have been written since (their part never drops below
        a quarter, as in ``grace.GraceClock.queued_seconds``).
        """
        own = self._margin_fn()
        now = time.monotonic()
        values = [] if own is None else [own]
        for margin, queued, at in self._peer_margins:
            left = max(queued - (now - at), queued / 4) if queued > 0 else 0.0
            values.append(margin - queued + left)
        return max(values) if values else None

    def _publish_margin(self) -> None:
        margin = self._margin_fn()
        if margin is None:
            return
        self.coordinator.claim_json(self._key("round", 0, "margin", self.me),
                                    {"margin": margin, "queued": float(self._queued_fn())})

    def _read_peer_margins(self) -> list[tuple[float, float, float]]:
        now = time.monotonic()
        out = []
        for w in range(self.coordinator.num_workers):
            if w == self.me:
                continue
            value = self.coordinator.try_get(self._key("round", 0, "margin", w))
            if value is not None:
                m = json.loads(value)
                out.append((float(m["margin"]), float(m.get("queued", 0.0)), now))
        return out

    # -- watcher thread -------------------------------------------------------

    def _watch_main(self) -> None:
        try:
            for n in range(ROUNDS):
                go = json.loads(self._wait_key(self._key("round", n, "go"), forever=True))
                if n == 0:
                    notice = json.loads(self._wait_key(self._key("notice")))
                    with self._cond:
                        self._notice = notice
                with self._cond:
                    runs = self._runs
                    at = runs + 1 if self._checked == runs else runs
                    if not self._known[n]:
                        self._known[n] = True
                        self._seen_at[n] = time.monotonic()
                if n == 0:  # before "at": whoever sees every "at" sees every margin
                    self._publish_margin()
                self.coordinator.claim(self._key("round", n, "at", self.me), str(at))
                ats = [int(self._wait_key(self._key("round", n, "at", w)))
                       for w in range(self.coordinator.num_workers)]
                target = max(ats)
                peers = self._read_peer_margins() if n == 0 else None
                with self._cond:
                    if peers is not None:
                        self._peer_margins = peers
                    self._target[n] = target
                    self._final[n] = bool(go["final"])
                    if n == 0:
                        self._save_at_notice = bool(go.get("save", True))
                    self._cond.notify_all()
                logger.warning("[worker %d] round %d: all workers save at step %d%s",
                               self.me, n, target, " and exit" if go["final"] else "")
                if go["final"]:
                    break
            # Keep relaying peer errors until stopped.
            while not self._stop.wait(self.options.poll_s):
                self._check_error()
        except InterruptedError:
            pass
        except (CoordinationTimeoutError, PeerFailedError) as e:
            self._fail(e)
        except Exception as e:
            if not self._stop.is_set():
                logger.exception("[worker %d] preemption watcher failed", self.me)
                self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = e
            self._cond.notify_all()

    def _wait_key(self, key: str, *, forever: bool = False) -> str:
        """Waits for ``key`` in slices, relaying peer errors and honouring ``stop``."""
        timeout = float("inf") if forever else self.options.timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if self._stop.is_set():
                raise InterruptedError(key)
            self._check_error()
            left = deadline - time.monotonic()
            if left <= 0:
                raise CoordinationTimeoutError(
                    f"worker {self.me}: no value for {key!r} after {timeout:.0f} s"
                )
            value = self.coordinator.get(key, min(left, self.options.poll_s))
            if value is not None:
                return value

    def _check_error(self) -> None:
        value = self.coordinator.try_get(self._key("error"))
        if value is None:
            return
        error = json.loads(value)
        if error.get("worker") != self.me:
            raise self.coordinator.peer_failed(int(error["worker"]), str(error.get("error")),
                                               error.get("code"))

    # -- errors -----------------------------------------------------------------

    def report_error(self, exc: BaseException) -> bool:
        """Publishes this worker's training error; True if it was the first."""
        if isinstance(exc, PeerFailedError):
            return False
        text = f"{type(exc).__name__}: {exc}"[:2000]
        try:
            code = getattr(exc, "error_code", None)  # a tf.errors.OpError's
            first = self.coordinator.claim_json(
                self._key("error"), {"worker": self.me, "error": text,
                                     "code": code if isinstance(code, int) else None})
        except Exception as e:
            logger.warning("[worker %d] could not publish error %s: %r", self.me, text, e)
            return False
        if first:
            logger.error("[worker %d] training failed (%s); telling the other workers",
                         self.me, text)
            self.coordinator.report_error(exc)
        return first

    def barrier(self, name: str, timeout_s: float) -> None:
        self.coordinator.barrier(self._key("barrier", name), timeout_s)
