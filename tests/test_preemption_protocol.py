"""The step-agreement protocol and the grace margin, with threads as workers.

Each worker is a thread with its own ``StepAgreement`` over a shared
in-process store; a ``threading.Barrier`` inside each step plays the
collective that keeps real workers in lockstep (and that would deadlock a
protocol which blocked one worker's training thread on another's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from asyncckpt.engine.writer import AsyncEngine
from asyncckpt.preemption import grace as grace_lib
from asyncckpt.preemption.agreement import AgreementOptions, Decision, StepAgreement
from asyncckpt.preemption.coordination import InProcessCoordinator, PeerFailedError
from asyncckpt.preemption.watchers import Notice

OPTIONS = AgreementOptions(poll_s=0.05, timeout_s=60)


class Cluster:
    """``n`` workers, each a thread running steps through its ``StepAgreement``.

    Args:
        n: Workers.
        lockstep: Run a barrier in every step, like a collective.
        start_runs: Per-worker starting step counts.
        margin: What ``margin_fn`` answers.
    """

    def __init__(self, n: int, *, lockstep: bool = True, start_runs=None, margin=0.0,
                 step_s: float = 0.005, max_steps: int = 100000):
        self.coordinators = InProcessCoordinator.group(n)
        self.margin = margin
        self.agreements = [
            StepAgreement(c, namespace="t", runs=(start_runs or [0] * n)[i],
                          margin_fn=lambda: self.margin, options=OPTIONS)
            for i, c in enumerate(self.coordinators)
        ]
        self.collective = threading.Barrier(n) if lockstep else None
        self.step_s = step_s
        self.max_steps = max_steps
        self.saves: list[list[tuple[int, bool]]] = [[] for _ in range(n)]
        self.errors: list[BaseException | None] = [None] * n
        self.progress = [0] * n
        self.progress_changed = threading.Condition()
        self.fail_at: dict[int, int] = {}
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True)
                        for i in range(n)]

    def _work(self, i: int) -> None:
        agreement = self.agreements[i]
        try:
            for _ in range(self.max_steps):
                decision = agreement.at_boundary()
                if decision is not Decision.CONTINUE:
                    self.saves[i].append((agreement.runs, decision is Decision.SAVE_AND_EXIT))
                    if decision is Decision.SAVE_AND_EXIT:
                        return
                if self.fail_at.get(i) == agreement.runs:
                    err = RuntimeError(f"step {agreement.runs} failed on worker {i}")
                    agreement.report_error(err)
                    raise err
                if self.collective is not None:
                    self.collective.wait(timeout=60)
                time.sleep(self.step_s)
                agreement.step_done()
                with self.progress_changed:
                    self.progress[i] = agreement.runs
                    self.progress_changed.notify_all()
        except threading.BrokenBarrierError:
            self.errors[i] = threading.BrokenBarrierError()
        except BaseException as e:
            self.errors[i] = e
            if self.collective is not None:
                self.collective.abort()  # what the framework does to a failed collective

    def __enter__(self) -> Cluster:
        for a in self.agreements:
            a.start()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for t in self.threads:
            t.join(60)
        for a in self.agreements:
            a.stop()
        assert not any(t.is_alive() for t in self.threads), "a worker hung"

    def wait_progress(self, runs: int) -> None:
        with self.progress_changed:
            ok = self.progress_changed.wait_for(lambda: min(self.progress) >= runs, timeout=60)
        assert ok, f"workers stuck at {self.progress}"


def notice(grace: float = 0.0, source: str = "sigterm") -> tuple[Notice, float]:
    return Notice(source, time.time()), grace


def test_a_notice_on_one_worker_makes_all_save_at_the_same_step():
    with Cluster(3) as cluster:
        cluster.wait_progress(20)
        cluster.agreements[1].notice(*notice())
    finals = [s[-1] for s in cluster.saves]
    assert len({run for run, _ in finals}) == 1, cluster.saves
    assert all(final for _, final in finals)
    assert all(len(s) == 1 for s in cluster.saves)  # no grace: one save only
    assert not any(cluster.errors)


def test_workers_far_apart_agree_on_the_largest_step_plus_one():
    # No collective: the workers drift apart; the agreed step is still one step.
    with Cluster(3, lockstep=False, start_runs=[0, 50, 10]) as cluster:
        cluster.wait_progress(15)
        cluster.agreements[0].notice(*notice())
    runs = {s[-1][0] for s in cluster.saves}
    assert len(runs) == 1
    (run,) = runs
    assert run >= 50 + 15  # at or after the most advanced worker's next boundary


def test_first_notice_wins_and_a_later_one_does_not_reopen_the_protocol():
    with Cluster(2, margin=0.0) as cluster:
        cluster.wait_progress(10)
        first = Notice("gce-maintenance", time.time())
        cluster.agreements[0].notice(first, 3600.0)
        cluster.agreements[1].notice(Notice("user", time.time()), 3600.0)
        notice0 = cluster.coordinators[0].try_get("t/notice")
        cluster.wait_progress(cluster.progress[0] + 5)
        # Both saved once at the notice, then trained on in the grace period.
        assert [len(s) for s in cluster.saves] == [1, 1]
        assert cluster.saves[0] == cluster.saves[1]
        # A SIGTERM (no grace) on worker 1 ends the grace period for everyone.
        cluster.agreements[1].notice(Notice("sigterm", time.time()), 0.0)
    assert '"worker": 0' in notice0 and '"gce-maintenance"' in notice0
    assert cluster.saves[0] == cluster.saves[1]
    assert [final for _, final in cluster.saves[0]] == [False, True]


def test_long_grace_period_saves_at_once_trains_until_the_margin_then_saves_again():
    grace, margin = 2.5, 0.5  # at least 4 margins: a save at the notice too
    with Cluster(2, margin=margin) as cluster:
        cluster.wait_progress(5)
        n, g = notice(grace, "user")
        cluster.agreements[1].notice(n, g)
    assert cluster.saves[0] == cluster.saves[1]
    (first, _), (final, is_final) = cluster.saves[0]
    assert is_final and final > first
    deadline = cluster.agreements[0].deadline()
    assert deadline == pytest.approx(n.wall_time + grace)


def test_short_grace_period_trains_until_the_margin_and_saves_once():
    grace, margin = 1.2, 0.5  # under 4 margins: a save at the notice would only delay
    with Cluster(2, margin=margin) as cluster:
        cluster.wait_progress(5)
        at_notice = min(cluster.progress)
        n, g = notice(grace, "user")
        cluster.agreements[0].notice(n, g)
        cluster.threads[0].join(60)
        ended = time.time()
    assert cluster.saves[0] == cluster.saves[1]
    ((run, final),) = cluster.saves[0]
    assert final and run > at_notice + 5  # trained in the grace period
    assert ended >= n.wall_time + grace - margin


def test_grace_shorter_than_the_margin_saves_at_once():
    with Cluster(2, margin=5.0) as cluster:
        cluster.wait_progress(5)
        cluster.agreements[0].notice(*notice(2.0, "user"))
    assert all(len(s) == 1 and s[0][1] for s in cluster.saves)


def test_unknown_write_time_trains_for_part_of_the_grace_period():
    with Cluster(1, margin=None) as cluster:
        cluster.wait_progress(5)
        n, g = notice(1.0, "user")
        cluster.agreements[0].notice(n, g)
        cluster.threads[0].join(60)
        ended = time.time()
    (first, f0), (final, f1) = cluster.saves[0]
    assert not f0 and f1 and final > first
    assert ended >= n.wall_time + 0.5  # trained for half the grace period


def test_an_error_on_one_worker_stops_the_others():
    with Cluster(3) as cluster:
        cluster.fail_at[2] = 12
    assert isinstance(cluster.errors[2], RuntimeError)
    for i in (0, 1):
        # Released from the collective by the failure, then told at the boundary.
        err = cluster.errors[i]
        assert isinstance(err, (PeerFailedError, threading.BrokenBarrierError)), err


def test_peer_error_is_raised_at_the_next_boundary_without_collectives():
    with Cluster(2, lockstep=False) as cluster:
        cluster.fail_at[1] = 5
    assert isinstance(cluster.errors[0], PeerFailedError)
    assert cluster.errors[0].worker == 1 and "step 5 failed" in cluster.errors[0].error


# -- the margin ------------------------------------------------------------------


def test_margin_formula():
    opts = grace_lib.GraceOptions()
    m = grace_lib.margin_seconds(write_s=2.0, blocking_s=0.1, queued_s=0.0, step_s=0.1,
                                 options=opts)
    assert m == pytest.approx(1.5 * (2.0 + 0.1 + 3 * 0.1) + 0.5)
    assert grace_lib.tf_final_save_start(100.0, 10.0, 0.5) == pytest.approx(107.0)


class _SlowJob:
    """A save job whose write takes ``seconds`` (a slow disk)."""

    def __init__(self, seconds: float, nbytes: int = 1000):
        self.label, self.step, self.nbytes, self.seconds = "job", None, nbytes, seconds
        self.started = threading.Event()

    def write(self):
        self.started.set()
        time.sleep(self.seconds)  # the slow disk at work

    def commit(self, stats):
        pass

    def abort(self):
        pass


def test_grace_clock_uses_measured_write_time_and_persists_it():
    with AsyncEngine(name="t") as engine:
        clock = grace_lib.GraceClock(engine)
        assert clock.margin() is None  # nothing measured
        for _ in range(2):
            engine.save(lambda slot: _SlowJob(0.3), label="job").result()
        for _ in range(10):
            clock.steps.update(0.01)
        margin = clock.margin()
        assert margin >= 1.5 * (0.3 + 3 * 0.01) + 0.5
        estimates = clock.estimates()
        assert estimates["write_s"] >= 0.3 and estimates["step_s"] == pytest.approx(0.01)
        # A save in flight delays the final one: it is part of the margin, by
        # what is left of its write.
        job = _SlowJob(0.3)
        engine.save(lambda slot: job, label="job")
        assert job.started.wait(30)  # the writer is on it: busy_for counts
        in_flight = clock.margin()
        assert margin < in_flight <= margin + 1.5 * clock.write_seconds() + 1e-9
        time.sleep(0.1)
        assert clock.margin() < in_flight  # the write moved on
        engine.sync()
        assert engine.busy_for is None and clock.margin() == pytest.approx(margin, rel=0.05)
    with AsyncEngine(name="t2") as engine2:
        restarted = grace_lib.GraceClock(engine2)
        restarted.seed(estimates)
        assert restarted.margin() == pytest.approx(margin, rel=0.05)


def test_importing_and_detecting_imports_no_framework():
    code = ("import os, sys, asyncckpt.preemption as p; "
            "os.environ['GCE_METADATA_HOST'] = '127.0.0.1:9'; "
            "print(p.detect_platform(refresh=True).value, "
            "'tensorflow' in sys.modules, 'jax' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_PLATFORM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout
    assert out.split() == ["other", "False", "False"]
